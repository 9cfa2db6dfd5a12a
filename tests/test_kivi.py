"""kv=kivi_int4: a KIVI-style comparison format (keys per channel over groups of tokens, scales
computed when written), validated beside the project's formats, never shipped."""
import pytest
import torch

from kvcompress import reference as ref


def test_grouped_keys_quantize_each_channel_over_aligned_token_groups():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 70, 8, generator=g) * torch.linspace(0.1, 10, 8)  # [B, H, T, D], channels of different ranges
    kq = ref.fake_quant_keys_grouped(k, 4, 32)
    assert kq.shape == k.shape
    for lo in (0, 32, 64):  # groups [0, 32), [32, 64), [64, 70)
        blk = kq[0, 0, lo : lo + 32]  # [tokens, D]
        for d in range(8):
            assert blk[:, d].unique().numel() <= 16  # 4 bits per channel within a group
        # each group's range is its own: a group never sees another group's values
        src = k[0, 0, lo : lo + 32]
        assert (blk - src).abs().amax(0).le((src.amax(0) - src.amin(0)) / 15 * 0.5 + 1e-2).all()
    # the same as the value quantizer along tokens
    expect = ref.fake_quant_values(k[..., :64, :].transpose(-1, -2), 4, 32).transpose(-1, -2)
    assert torch.equal(kq[..., :64, :], expect)


def test_grouped_key_bytes(tiny_llama):
    from kvcompress.models.base import Geometry

    geo = Geometry(n_layers=1, n_heads=2, n_kv_heads=1, head_dim=64, hidden_size=128, vocab_size=10, max_position=64, rope_theta=1e4, architecture="x")
    from kvcompress.spec import KVSpec

    spec = KVSpec(name="kivi", key={"bits": 4, "symmetric": False, "group_tokens": 32}, value={"bits": 4, "group_size": 32}, window=128, sink_tokens=0)
    b = ref.spec_cache_nbytes(spec, geo, 128 + 320)
    assert b["key_meta"] == 10 * 64 * 2 * 2 and b["static"] == 0  # 10 groups of 32 compressed tokens x D channels x (scale, min) fp16
    assert b["key_payload"] == 10 * 32 * 64 // 2  # whole groups (a group is written when its first token leaves the window)
    b = ref.spec_cache_nbytes(spec, geo, 128 + 300)  # 300 compressed tokens: the 10th group is written, 20 of its tokens still in the window
    assert b["key_payload"] == 10 * 32 * 64 // 2 and b["value_payload"] == 300 * 64 // 2


def test_group_tokens_needs_a_window_at_least_one_group():
    from pydantic import ValidationError

    from kvcompress.spec import KVSpec

    with pytest.raises(ValidationError, match="kv.window >= group_tokens"):
        KVSpec(name="x", key={"bits": 4, "group_tokens": 64}, window=32)


def test_eval_compare_validates_presets_beside_the_run_without_shipping_them(tmp_path):
    import json

    from conftest import run_cli

    run_dir = tmp_path / "run"
    r = run_cli("model=tiny_llama", "calib=smoke", "eval=smoke", "eval.compare=[kivi_int4,native_nvfp4,native_int8]", f"hydra.run.dir={run_dir}",
                cache_dir=tmp_path / "c")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads((run_dir / "report.json").read_text())
    roles = {f["name"]: f["role"] for f in rep["fallbacks"]}
    assert roles == {"native_int8": "trtllm", "native_fp8": "hf", "kivi_int4": "compare:kivi_int4", "native_nvfp4": "compare:native_nvfp4"}
    kivi = next(f for f in rep["fallbacks"] if f["name"] == "kivi_int4")
    assert kivi["quality"]["tokens"] == rep["quality"]["tokens"] and kivi["quality"]["ppl_baseline"] == rep["quality"]["ppl_baseline"]  # same windows, same baseline
    assert kivi["memory"]["breakdown_per_token"]["key_meta"] > 0 and kivi["quality"]["key_clip_rate"] == 0
    assert set(rep["export"]["artifacts"]) == {"trtllm_ckpt", "hf_ckpt", "plugin_bundle"}  # compared formats are not shipped
    assert "Compared (eval.compare, not shipped)" in (run_dir / "report.md").read_text()
