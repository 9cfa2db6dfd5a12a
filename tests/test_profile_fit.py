"""profile observes post-RoPE K/V where they are cached; fit turns KVStats into a ScaleBook."""
import json

import pytest
import torch
from safetensors import safe_open
from transformers import DynamicCache

from conftest import SMOKE_CALIB, tiny_lm
from kvcompress.data import load_texts, token_windows
from kvcompress.errors import ArtifactError
from kvcompress.observers.mse import score_error
from kvcompress.reference import KeyParams, key_qmax
from kvcompress.scalebook import ScaleBook
from kvcompress.spec import KVSpec
from kvcompress.stages.fit import fit
from kvcompress.stages.profile import profile
from kvcompress.stats import KVStats


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_profile_sees_the_cached_post_rope_keys(arch):
    lm = tiny_lm(arch)
    texts = load_texts(SMOKE_CALIB)
    stats = profile(lm, SMOKE_CALIB, texts, progress=False)
    ids = token_windows(lm.tokenizer, texts, SMOKE_CALIB.n_samples, SMOKE_CALIB.seq_len, seed=SMOKE_CALIB.seed)
    cache = DynamicCache(config=lm.model.config)
    with torch.no_grad():
        lm.model(input_ids=ids, cache=cache, use_cache=True)
    for layer in range(lm.geometry.n_layers):
        k = cache.layers[layer].keys  # [B, H, T, D] exactly what transformers caches (post-RoPE)
        v = cache.layers[layer].values
        torch.testing.assert_close(stats["k_absmax"][layer], k.abs().amax(dim=(0, 2)))
        torch.testing.assert_close(stats["v_min"][layer], v.amin(dim=(0, 2)))
        mean = k.double().mean(dim=(0, 2))
        torch.testing.assert_close(stats.mean("k")[layer], mean, atol=1e-6, rtol=1e-6)
        assert int(stats["k_hist"][layer].sum()) == k.numel()
    assert int(stats["count"][0]) == ids.numel()
    # pre-RoPE keys differ from post-RoPE ones (RoPE really happened between them)
    assert not torch.allclose(stats["k_prerope_absmax"], stats["k_absmax"])
    assert stats.header["provenance"]["calib"]["sha256"] == texts.sha256


def test_raw_sample_is_bounded(tiny_llama):
    cfg = SMOKE_CALIB.model_copy(update={"sample_tokens": 10})
    stats = profile(tiny_llama, cfg, load_texts(cfg), progress=False)
    g = tiny_llama.geometry
    assert stats["sample_k"].shape[1] <= 10 and "sample_q" not in stats.tensors
    # the queries are kept as their second moment per kv head: bounded by kv heads, not query heads or tokens
    assert stats["q_gram"].shape == (g.n_layers, g.n_kv_heads, g.head_dim, g.head_dim)
    assert int(stats["q_count"][0]) == stats.header["provenance"]["calib"]["tokens"] * (g.n_heads // g.n_kv_heads)


def test_q_gram_is_the_exact_second_moment_of_the_queries(tiny_llama):
    """q_gram / q_count equals E[q q^T] over the queries of each kv-head group, recomputed from a capture."""
    from kvcompress.data import token_windows
    from kvcompress.models.observe import attention_hook

    stats = profile(tiny_llama, SMOKE_CALIB, load_texts(SMOKE_CALIB), progress=False)
    ids = token_windows(tiny_llama.tokenizer, load_texts(SMOKE_CALIB), SMOKE_CALIB.n_samples, SMOKE_CALIB.seq_len, seed=SMOKE_CALIB.seed)
    seen = {}
    with torch.no_grad(), attention_hook(tiny_llama.model, lambda layer, q: seen.setdefault(layer, q.clone())):
        tiny_llama.model(input_ids=ids, use_cache=False)
    H = tiny_llama.geometry.n_kv_heads
    q = seen[1].double()  # [B, Hq, T, D]
    qg = q.unflatten(1, (H, -1)).permute(1, 0, 2, 3, 4).flatten(1, 3)  # [H, B*g*T, D]
    torch.testing.assert_close(stats.q_second_moment(1), qg.transpose(1, 2) @ qg / qg.shape[1], atol=1e-9, rtol=1e-9)


def test_fit_ties_rope_pairs_and_picks_outliers(tiny_stats):
    spec = KVSpec(name="t", outlier_channels=2, key={"bits": 8, "clip": "minmax"})
    book = fit(tiny_stats, spec)
    D = book.geometry["head_dim"]
    s = book.tensors["k_scale"]
    assert torch.equal(s[..., : D // 2], s[..., D // 2 :])
    absmax = tiny_stats["k_absmax"]
    top = absmax.topk(2, dim=-1).indices.sort(-1).values
    assert torch.equal(book.tensors["k_outliers"], top)
    # a non-outlier pair's scale is its own max / 127
    untied = fit(tiny_stats, KVSpec(name="u", key={"clip": "minmax", "tie_rope_pairs": False}))
    torch.testing.assert_close(untied.tensors["k_scale"], absmax / key_qmax(8))


def test_mse_clipping_beats_raw_range_on_the_sample(tiny_stats):
    spec_mse = KVSpec(name="m", key={"bits": 4, "clip": "mse"})
    spec_max = KVSpec(name="x", key={"bits": 4, "clip": "minmax"})
    b_mse, b_max = fit(tiny_stats, spec_mse), fit(tiny_stats, spec_max)
    total_mse = total_max = 0.0
    for layer in range(b_mse.geometry["n_layers"]):
        k = tiny_stats["sample_k"][layer].transpose(0, 1)
        q = tiny_stats.q_second_moment(layer)
        total_mse += float(score_error(q, k, b_mse.key_params(layer)).sum())
        total_max += float(score_error(q, k, b_max.key_params(layer)).sum())
    assert total_mse <= total_max
    assert float(b_mse.tensors["k_clip"].min()) < 1.0  # int4 on random keys: clipping pays


def test_percentile_and_asymmetric_fit(tiny_stats):
    b = fit(tiny_stats, KVSpec(name="p", key={"clip": "percentile", "clip_percentile": 99.0}))
    assert bool((b.tensors["k_scale"] * 127 <= tiny_stats["k_absmax"].amax() + 1e-6).all())
    a = fit(tiny_stats, KVSpec(name="a", key={"symmetric": False, "clip": "minmax", "tie_rope_pairs": False}))
    lo, hi = tiny_stats["k_min"], tiny_stats["k_max"]
    torch.testing.assert_close(a.tensors["k_zero"], (lo + hi) / 2)
    p = a.key_params(0)
    assert isinstance(p, KeyParams)


def test_scalebook_round_trip_and_refusals(tmp_path, tiny_stats):
    book = fit(tiny_stats, KVSpec(name="int8k_int4v"))
    path = tmp_path / "scalebook.safetensors"
    book.save(path)
    loaded = ScaleBook.load(path, book.geometry)
    assert loaded.spec == book.spec and torch.equal(loaded.tensors["k_scale"], book.tensors["k_scale"])
    with safe_open(str(path), "pt") as f:
        header = json.loads(f.metadata()["kvcompress"])
    assert header["format_version"] == 2 and header["geometry"]["head_dim"] == 32 and "provenance" in header
    with pytest.raises(ArtifactError, match="geometry does not match"):
        ScaleBook.load(path, {**book.geometry, "head_dim": 64})
    from kvcompress.artifacts import save_artifact

    save_artifact(tmp_path / "v1.safetensors", book.tensors, {**header, "format_version": 1})  # written before per-layer formats
    assert ScaleBook.load(tmp_path / "v1.safetensors").spec == book.spec
    save_artifact(tmp_path / "future.safetensors", book.tensors, {**header, "format_version": 99})
    with pytest.raises(ArtifactError, match="format_version=99"):
        ScaleBook.load(tmp_path / "future.safetensors")
    with pytest.raises(ArtifactError, match="expected 'kv_stats'"):
        KVStats.load(path)
    assert not list(tmp_path.glob(".*tmp"))  # atomic writes leave no temp files


def test_stats_round_trip(tmp_path, tiny_stats):
    tiny_stats.save(tmp_path / "s.safetensors")
    again = KVStats.load(tmp_path / "s.safetensors")
    assert torch.equal(again["k_hist"], tiny_stats["k_hist"]) and again.header["geometry"] == tiny_stats.header["geometry"]
    q = again.quantile_abs("k", 50.0)
    assert bool((q <= again["k_absmax"] + 1e-6).all())
