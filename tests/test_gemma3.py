"""The second model family (Gemma 3): sliding-window layers, two RoPE bases, a GGUF split over
several PyPI packages. Fast tests on a tiny random Gemma 3 built in code; the real Gemma 3 270M
end to end is in test_gemma3_real (slow)."""
import hashlib
import json

import pytest
import torch

from conftest import fitted_book, float64_model, tiny_lm
from kvcompress.config import ModelConfig
from kvcompress.errors import UserError
from kvcompress.models.gguf import join_parts
from kvcompress.fold import apply_fold
from kvcompress.reference import spec_cache_nbytes
from kvcompress.scalebook import ScaleBook
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



def random_qk_norms(layers) -> None:
    """Gemma's q/k norms multiply by 1 + w and init leaves w = 0: give the weights seeded values in [-0.4, 0.8)."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in layers:
            for n in ("q_norm", "k_norm"):
                w = getattr(layer.self_attn, n).weight
                w.copy_(torch.rand(w.shape, generator=g) * 1.2 - 0.4)


def gemma_norms(lm):
    """A tiny Gemma 3 whose q/k norm weights are not zero."""
    random_qk_norms(lm.model.model.layers)
    return lm


def test_key_norm_offset_is_probed_from_the_model():
    from kvcompress.stages.profile import key_norm_offset

    assert key_norm_offset(gemma_norms(tiny_lm("gemma3", layers=1)).model) == 1.0  # x / rms(x) * (1 + w)
    assert key_norm_offset(tiny_lm("qwen3", layers=1).model) == 0.0  # x / rms(x) * w
    assert key_norm_offset(tiny_lm("llama", layers=1).model) == 0.0  # no key norm


def test_fold_into_gemmas_one_plus_w_norms_is_exact():
    """Head-shared key factors (>= fold.OFFSET_FLOOR) and value factors folded into a Gemma 3: the same logits, the
    cached keys k / sigma (q_norm and k_norm hold (1 + w) * sigma - 1 and (1 + w) / sigma - 1). Negative: the same
    factors folded as into a standard norm (w * sigma) give another model."""
    import copy

    from conftest import assert_folded_like
    from kvcompress.fold import OFFSET_FLOOR, fold_state_dict
    from kvcompress.models.fused import fuse, unfuse

    lm = gemma_norms(tiny_lm("gemma3", layers=3, heads=4, kv_heads=2, head_dim=32))
    L, H, D = lm.geometry.n_layers, lm.geometry.n_kv_heads, lm.geometry.head_dim
    g = torch.Generator().manual_seed(0)
    sigma = (torch.rand(L, 1, D // 2, generator=g) * (1 - OFFSET_FLOOR) + OFFSET_FLOOR).repeat(1, 1, 2).expand(L, H, D).contiguous()
    tau = torch.rand(L, H, D, generator=g) * 0.8 + 0.2
    folded = copy.deepcopy(lm.model)
    apply_fold(folded, sigma, tau)
    k0, k1 = lm.model.model.layers[0].self_attn.k_norm.weight, folded.model.layers[0].self_attn.k_norm.weight
    torch.testing.assert_close(k1, (1 + k0) / sigma[0, 0] - 1)
    ids = torch.randint(0, 256, (2, 40), generator=g)  # 40 > the sliding window (16)
    a = assert_folded_like(lm.model, folded, sigma, ids)
    wrong = copy.deepcopy(lm.model)
    own = {k: v.detach() for k, v in wrong.state_dict().items()}
    wrong.load_state_dict(fuse(fold_state_dict(unfuse(own, lm.geometry), lm.geometry, sigma, tau, None, 0.0), own))
    with torch.no_grad():
        assert (wrong(input_ids=ids).logits - a).abs().max() > 1e-2


def test_fit_keeps_gemmas_key_factors_above_the_floor():
    """native_fp8 on a Gemma 3: fit reads the offset from the stats, gives head-shared key factors >= OFFSET_FLOOR
    (the stored q_norm weight (1 + w) * sigma - 1 keeps its precision) and says so; a standard norm may go lower."""
    from kvcompress.fold import OFFSET_FLOOR
    from kvcompress.spec import native_spec
    from kvcompress.stages.fit import fit
    from kvcompress.stages.profile import profile
    from conftest import SMOKE_CALIB
    from kvcompress.data import load_texts

    lm = gemma_norms(tiny_lm("gemma3", layers=3, heads=4, kv_heads=2, head_dim=32))
    stats = profile(lm, SMOKE_CALIB, load_texts(SMOKE_CALIB), progress=False)
    assert stats.header["key_norm"] == "shared" and stats.header["key_norm_offset"] == 1.0
    spec = native_spec("native_fp8").model_copy(update={"fold_strength": 1.0, "fold_keys": True})
    book = fit(stats, spec)
    fk = book.tensors["fold_k"]
    assert torch.equal(fk, fk[:, :1].expand_as(fk)) and fk.min() >= OFFSET_FLOOR and (fk == OFFSET_FLOOR).any()
    assert "(w + 1)" in book.fit_info["key_norm"]
    stats.header["key_norm_offset"] = 0.0  # the same statistics read as a standard norm: nothing holds the factors up
    assert fit(stats, spec).tensors["fold_k"].min() < OFFSET_FLOOR


def test_the_export_guard_holds_offset_norm_factors_at_the_floor():
    """A ScaleBook fitted before the offset was known (stats without key_norm_offset) can carry key factors below
    OFFSET_FLOOR: the export's guard raises them to it for (1 + w) norms and counts them; a standard norm keeps them."""
    from kvcompress.fold import OFFSET_FLOOR, guard_layer

    lm = gemma_norms(tiny_lm("gemma3", layers=1, heads=4, kv_heads=2, head_dim=32))
    state = {k: v.detach() for k, v in lm.model.state_dict().items()}
    sigma = torch.full((2, 32), 0.1)
    sigma[:, :4] = 0.9
    held, n = guard_layer(state, lm.geometry, 0, sigma, torch.bfloat16, norm_offset=1.0)
    assert n == 2 * 28 and held.min() == OFFSET_FLOOR and torch.equal(held[:, :4], sigma[:, :4])
    kept, n0 = guard_layer(state, lm.geometry, 0, sigma, torch.bfloat16)
    assert n0 == 0 and torch.equal(kept, sigma)

def test_gemma3_exports_the_fp8_hf_checkpoint_alone(tmp_path):
    """export=trtllm with kv=native_fp8 on a Gemma 3 (an HF directory) writes hf_ckpt/ only: bfloat16 weights with
    the fold in (1 + w) form, FP8 scales, a config.json that transformers reads back as the same Gemma 3 (per-layer
    RoPE, sliding windows), re-measured against validate within tolerance; the manifest says why there is no
    TensorRT-LLM checkpoint; streamed layer by layer, the same. Another kv format or float16 weights: one line, nothing written."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from test_export import _dir_run, _hf_dir

    ckpt = _hf_dir(tmp_path, "gemma3")
    p, run = _dir_run(tmp_path, ckpt, "run", "kv=native_fp8", "export.dtype=bfloat16", "kv.fold_strength=1.0", "kv.fold_keys=true")
    assert p.returncode == 0, p.stderr[-3000:]
    manifest = json.loads((run / "export" / "manifest.json").read_text())
    assert set(manifest["artifacts"]) == {"hf_ckpt"} and "trtllm_ckpt" in manifest["not_written"]
    assert not (run / "export" / "trtllm_ckpt").exists() and all(c["status"] == "passed" for c in manifest["checks"]), manifest["checks"]
    assert manifest["artifacts"]["hf_ckpt"]["remeasured"]["passed"] and "trtllm-serve export/hf_ckpt" in manifest["next_step_on_gpu_host"]
    out = run / "export" / "hf_ckpt"
    cfg, src_cfg = AutoConfig.from_pretrained(str(out)), AutoConfig.from_pretrained(str(ckpt))
    assert type(cfg).__name__ == "Gemma3TextConfig" and cfg.architectures == ["Gemma3ForCausalLM"]
    assert cfg.rope_parameters == src_cfg.rope_parameters and cfg.layer_types == src_cfg.layer_types and cfg.sliding_window == src_cfg.sliding_window
    w = load_file(str(next(out.glob("*.safetensors"))))
    src = load_file(str(ckpt / "model.safetensors"))
    assert w["model.layers.0.self_attn.k_norm.weight"].dtype == torch.bfloat16
    book = ScaleBook.load(run / "scalebook.safetensors")
    sigma = book.tensors["fold_k"][0, 0]
    assert (sigma < 1).any()
    torch.testing.assert_close(w["model.layers.0.self_attn.k_norm.weight"].float(),
                               ((1 + src["model.layers.0.self_attn.k_norm.weight"].float()) / sigma - 1).bfloat16().float())
    p, runs = _dir_run(tmp_path, ckpt, "run_streamed", "kv=native_fp8", "export.dtype=bfloat16", "kv.fold_strength=1.0", "kv.fold_keys=true",
                       "model.streaming=true")  # a model too large to load: layer by layer, re-measured the same way
    assert p.returncode == 0, p.stderr[-3000:]
    ms = json.loads((runs / "export" / "manifest.json").read_text())
    assert any("layer by layer" in c["check"] and c["status"] == "passed" for c in ms["checks"]), ms["checks"]
    assert ms["artifacts"]["hf_ckpt"]["remeasured"]["validated_kl"] == manifest["artifacts"]["hf_ckpt"]["remeasured"]["validated_kl"]
    p, run2 = _dir_run(tmp_path, ckpt, "run2", "export.dtype=bfloat16")
    assert p.returncode != 0 and "kv=int8k_asym_rotv is not that format: use kv=native_fp8, or add export=none" in p.stderr
    assert "Traceback" not in p.stderr and not (run2 / "export").exists()
    p, run3 = _dir_run(tmp_path, ckpt, "run3", "kv=native_fp8")
    assert p.returncode != 0 and "export.dtype=float16: Gemma3ForCausalLM is trained and served in bfloat16" in p.stderr and "Traceback" not in p.stderr


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


def test_concurrent_runs_joining_or_converting_one_gguf_do_not_collide(tmp_path):
    """Two runs on one machine share the cache: join_parts wrote every run's chunks into one fixed temp name (a concurrent
    run's half-written file renamed as the joined one), and the conversion's rename of its directory onto one another run
    had just published was an OSError traceback."""
    from kvcompress.models.gguf import publish_dir

    parts = [tmp_path / "m.gguf.part00", tmp_path / "m.gguf.part01"]
    parts[0].write_bytes(b"GGUF" + b"a" * 64)
    parts[1].write_bytes(b"b" * 9)
    out = tmp_path / "cache" / "m.gguf"
    out.parent.mkdir()
    other = out.with_name(out.name + ".tmp")  # another run's temp file, being written
    other.write_bytes(b"GGUF half")
    assert join_parts(parts, hashlib.sha256(b"GGUF" + b"a" * 64 + b"b" * 9).hexdigest(), out).read_bytes() == b"GGUF" + b"a" * 64 + b"b" * 9
    assert other.read_bytes() == b"GGUF half" and sorted(p.name for p in out.parent.iterdir()) == ["m.gguf", "m.gguf.tmp"]
    done, mine = tmp_path / "models" / "abc", tmp_path / "models" / "abc.tmp1"
    for d in (done, mine):
        d.mkdir(parents=True)
        (d / "config.json").write_text(d.name)
    publish_dir(mine, done)  # the other run's directory stays; this one's copy goes
    assert (done / "config.json").read_text() == "abc" and not mine.exists()
    broken = tmp_path / "models" / "half"
    broken.mkdir()
    (broken / "x").write_text("")  # a non-empty directory that is not a conversion: the error stands
    (mine := tmp_path / "models" / "abc.tmp2").mkdir()
    with pytest.raises(OSError):
        publish_dir(mine, broken)


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
    The export writes Gemma 3 as the FP8 HF checkpoint only (kv=native_fp8); another kv format is refused in one line."""
    import json

    from conftest import run_cli

    run = tmp_path / "run"
    # context-phase task prompts: decode-equivalent ones (tests/test_tasks.py) would add a stepwise greedy check over
    # Gemma's 262K vocabulary to CI's longest test, and are not what this test is about
    p = run_cli("model=gemma3_270m", "calib=smoke", "eval=smoke", "eval.tasks.prompt=context", "export=none", f"hydra.run.dir={run}",
                cache_dir=tmp_path / "cache", timeout=900)
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
    assert "kv=int8k_asym_rotv is not that format: use kv=native_fp8, or add export=none" in p.stderr
    # the native FP8 HF checkpoint: bfloat16 weights, the key fold in Gemma's (1 + w) norms, re-measured through transformers
    run = tmp_path / "run3"
    p = run_cli("model=gemma3_270m", "kv=native_fp8", "calib=smoke", "eval=smoke", "export.dtype=bfloat16", f"hydra.run.dir={run}",
                cache_dir=tmp_path / "cache", timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    m = json.loads((run / "export" / "manifest.json").read_text())
    assert set(m["artifacts"]) == {"hf_ckpt"} and m["artifacts"]["hf_ckpt"]["remeasured"]["passed"]
    assert all(c["status"] == "passed" for c in m["checks"]), m["checks"]


@pytest.mark.parametrize("cache", ["kept", "sliding"])
def test_task_scoring_sees_the_whole_prompt_past_the_sliding_window(gemma, monkeypatch, cache):
    """The retrieval/copy tasks prefill the prompt, then teacher-force the answer over that prefix:
    with a prompt longer than the sliding window its fp16 side must equal the model's own forward
    on prompt + answer. transformers' sliding cache layers (what DynamicCache(config=...) builds for
    Gemma 3) keep only the last window: scoring over such a prefix is refused, not scored shifted."""
    from transformers import DynamicCache

    from kvcompress.eval import retrieval

    if cache == "sliding":
        monkeypatch.setattr(retrieval, "full_cache", lambda model: DynamicCache(config=model.config))
    g = torch.Generator().manual_seed(0)
    prompt, ans = torch.randint(0, 256, (60,), generator=g).tolist(), torch.randint(0, 256, (6,), generator=g).tolist()
    if cache == "sliding":
        with pytest.raises(RuntimeError, match="the prompt's cache holds 15 of its 60 tokens"):
            retrieval.score_sample(gemma.model, prompt, ans, {})
        return
    got = retrieval.score_sample(gemma.model, prompt, ans, {})["fp16"][0]
    with torch.no_grad():
        lp = torch.log_softmax(gemma.model(input_ids=torch.tensor([prompt + ans])).logits[0].float(), -1)
    want = sum(float(lp[len(prompt) - 1 + i, a]) for i, a in enumerate(ans))
    assert abs(got - want) < 1e-3
