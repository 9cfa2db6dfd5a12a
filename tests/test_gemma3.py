"""The second model family (Gemma 3): sliding-window layers, two RoPE bases, a GGUF split over
several PyPI packages. Fast tests on a tiny random Gemma 3 built in code; the real Gemma 3 270M
end to end is in test_gemma3_real (slow)."""
import hashlib

import pytest
import torch

from conftest import fitted_book, float64_model, tiny_lm
from kvcompress.config import ModelConfig
from kvcompress.errors import UserError
from kvcompress.models.gguf import join_parts
from kvcompress.reference import spec_cache_nbytes
from kvcompress.spec import KVSpec, LayerFormat
from kvcompress.stages.profile import rope_inv_freq
from test_eval_equivalence import TOL, decode_logits, onepass_logits, with_spec


@pytest.fixture(scope="module")
def gemma():
    return tiny_lm("gemma3", layers=3, heads=4, kv_heads=1, head_dim=32)


def test_geometry_reads_sliding_layers_and_per_layer_rope(gemma):
    g = gemma.geometry
    assert g.sliding_windows == (16, 16, 0)
    assert g.rope_theta == 1_000_000.0  # the full-attention layers' base
    inv = rope_inv_freq(gemma.model, g)
    assert inv.shape == (3, 16)
    torch.testing.assert_close(inv[0], inv[1])
    assert not torch.allclose(inv[0], inv[2])  # local base 1e4 vs global 1e6
    assert g.stored_tokens(0, 100) == 16 and g.stored_tokens(2, 100) == 100 and g.stored_tokens(0, 10) == 10


def test_onepass_equals_decode_with_sliding_layers():
    """In float64, as the other one-pass vs decode tests (conftest.float64_model); a fresh model, since it is converted."""
    lm = tiny_lm("gemma3", layers=3, heads=4, kv_heads=1, head_dim=32)
    book = fitted_book(lm, window=5, sink_tokens=2, outlier_channels=1)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))  # 40 > window 16
    with pytest.MonkeyPatch.context() as mp:
        float64_model(lm, mp)
        dec, _ = decode_logits(lm.model, book, ids)
        torch.testing.assert_close(onepass_logits(lm.model, book, ids), dec, **TOL)
        off_by_one = onepass_logits(lm.model, with_spec(book, window=6), ids)
        assert float((off_by_one - dec).abs().max()) > 1e-3


def test_self_check_passes_and_the_window_matters(gemma):
    from kvcompress.stages.validate import self_check

    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    assert self_check(gemma, ids, "tiny_gemma3")["passed"]
    cfg = gemma.model.config
    with torch.no_grad():
        own = gemma.model(input_ids=ids).logits
        saved = cfg.sliding_window
        cfg.sliding_window = 10_000
        try:
            full = gemma.model(input_ids=ids).logits
        finally:
            cfg.sliding_window = saved
    assert (own - full).abs().max() > 1e-3  # the check above could fail if windows were ignored


def test_bytes_count_a_sliding_layer_as_a_rolling_buffer(gemma):
    g = gemma.geometry
    spec = KVSpec(name="t", window=8, sink_tokens=0)
    per_layer = [sum(spec_cache_nbytes(spec, g.layer(i), 4096).values()) for i in range(3)]
    total = sum(spec_cache_nbytes(spec, g, 4096).values())
    assert total == sum(per_layer)
    assert per_layer[0] == per_layer[1] == sum(spec_cache_nbytes(spec, g.layer(2), 16).values())  # 16 tokens held
    assert per_layer[2] > 100 * per_layer[0]
    mixed = KVSpec(name="m", window=8, sink_tokens=0, layers=(LayerFormat(key_bits=16, value_bits=16),) * 2
                   + (LayerFormat(key_bits=4, value_bits=4, value_group=32, outlier_channels=0),))
    b = spec_cache_nbytes(mixed, g, 4096)
    assert b["fp16_tokens"] == 2 * 16 * 2 * 32 * 2  # two fp16 sliding layers hold 16 tokens each


def test_tuner_prices_layers_by_what_they_hold(gemma):
    from kvcompress.stages.tune import layer_bytes

    spec = KVSpec(name="t", window=8, sink_tokens=0)
    f = LayerFormat(key_bits=8, value_bits=4, value_group=32, outlier_channels=0)
    assert layer_bytes(spec, f, gemma.geometry, 4096, 0) < layer_bytes(spec, f, gemma.geometry, 4096, 2) / 100


def test_split_gguf_is_joined_checked_and_reused(tmp_path):
    parts = []
    for i, data in enumerate([b"GGUF" + b"a" * 100, b"b" * 50, b"c" * 7]):
        p = tmp_path / f"m.gguf.part{i:02d}"
        p.write_bytes(data)
        parts.append(p)
    whole = b"".join(p.read_bytes() for p in parts)
    sha = hashlib.sha256(whole).hexdigest()
    out = join_parts(parts, sha, tmp_path / "cache" / "m.gguf")
    assert out.read_bytes() == whole
    parts[0].write_bytes(b"x")  # already joined: reused, not re-read
    assert join_parts(parts, sha, out) == out
    with pytest.raises(UserError, match="sha256"):
        join_parts(parts, sha, tmp_path / "cache2" / "m.gguf")
    assert not list((tmp_path / "cache2").iterdir())  # nothing half-written left behind


def test_parts_need_the_joined_sha256():
    part = {"package": "p", "file": "f"}
    with pytest.raises(ValueError, match="model.sha256"):
        ModelConfig(name="x", source="gguf_package", parts=[part])
    ModelConfig(name="x", source="gguf_package", parts=[part], sha256="0" * 64)


def test_missing_part_package_is_one_line_user_error(tmp_path):
    from kvcompress.models import model_fingerprint

    cfg = ModelConfig(name="x", source="gguf_package", parts=[{"package": "no-such-kvc-part", "file": "f"}], sha256="0" * 64)
    with pytest.raises(UserError, match="no-such-kvc-part"):
        model_fingerprint(cfg)


@pytest.mark.slow
def test_gemma3_270m_end_to_end(tmp_path):
    """The second real model family (Gemma 3 270M from four chunk packages) through profile, fit and
    validate from an EMPTY cache: chunks joined and checked, GGUF dequantized, the evaluation path
    reproduces the model (sliding-window layers included), bytes counted with rolling sliding layers.
    The TensorRT-LLM export is for Llama-family models and says so in one line."""
    import json

    from conftest import run_cli

    run = tmp_path / "run"
    p = run_cli("model=gemma3_270m", "calib=smoke", "eval=smoke", "export=none", f"hydra.run.dir={run}", cache_dir=tmp_path / "cache", timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "dequantizing gemma-3-270m-q4_k_m.gguf once" in p.stdout + p.stderr
    assert (tmp_path / "cache" / "gguf").is_dir() and not list((tmp_path / "cache" / "gguf").rglob("*.tmp"))
    r = json.loads((run / "report.json").read_text())
    g = r["model"]["geometry"]
    assert r["model"]["architecture"] == "Gemma3ForCausalLM" and g["head_dim"] == 256 and g["n_kv_heads"] == 1
    assert list(g["sliding_windows"]).count(512) == 15 and list(g["sliding_windows"]).count(0) == 3
    assert r["self_check"]["passed"] and r["self_check"]["kl_mean"] < 1e-6
    assert r["quality"]["kl_mean"] > 0  # keys and values really are quantized on the evaluated path
    p = run_cli("model=gemma3_270m", "calib=smoke", "eval=smoke", f"hydra.run.dir={tmp_path / 'run2'}", cache_dir=tmp_path / "cache")
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "Gemma3ForCausalLM: add export=none" in p.stderr


@pytest.mark.parametrize("cache", ["kept", "sliding"])
def test_task_scoring_sees_the_whole_prompt_past_the_sliding_window(gemma, monkeypatch, cache):
    """The retrieval/copy tasks prefill the prompt, then teacher-force the answer over that prefix:
    with a prompt longer than the sliding window its fp16 side must equal the model's own forward
    on prompt + answer. transformers' sliding cache layers (what DynamicCache(config=...) builds for
    Gemma 3) keep only the last window, and the scores go wrong: the negative case shows it."""
    from transformers import DynamicCache

    from kvcompress.eval import retrieval

    if cache == "sliding":
        monkeypatch.setattr(retrieval, "full_cache", lambda model: DynamicCache(config=model.config))
    g = torch.Generator().manual_seed(0)
    prompt, ans = torch.randint(0, 256, (60,), generator=g).tolist(), torch.randint(0, 256, (6,), generator=g).tolist()
    got = retrieval.score_sample(gemma.model, prompt, ans, {})["fp16"][0]
    with torch.no_grad():
        lp = torch.log_softmax(gemma.model(input_ids=torch.tensor([prompt + ans])).logits[0].float(), -1)
    want = sum(float(lp[len(prompt) - 1 + i, a]) for i, a in enumerate(ans))
    assert (abs(got - want) < 1e-3) == (cache == "kept")
