"""kv=native_nvfp4: TensorRT-LLM's NVFP4 KV cache simulated with Model Optimizer's semantics."""
import json

import pytest
import torch

from conftest import run_cli
from kvcompress import reference as ref


def test_e2m1_rounding_is_round_half_to_even_and_saturates():
    y = torch.tensor([0.0, 0.2, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.0, -0.75, -9.0])
    assert ref.e2m1_round(y).tolist() == [0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -1.0, -6.0]


def test_nvfp4_matches_model_optimizer_quantize_dequantize():
    """Bit-exact against NVIDIA Model Optimizer's own NVFP4QTensor (block 16, FP8 e4m3 block scales,
    global scale = amax / (6 * 448)), the tool that calibrates TensorRT-LLM's NVFP4 KV cache."""
    pytest.importorskip("modelopt")
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 128, generator=g) * torch.logspace(-2, 1, 128)  # channels of very different ranges
    x[3, 1, :16] = 0  # an all-zero block
    amax = x.abs().max()
    scale = amax / 448  # what the checkpoint stores per layer
    qt, sb, s2 = NVFP4QTensor.quantize(x.clone(), 16, weights_scaling_factor_2=scale / 6)
    theirs = qt.dequantize(dtype=torch.float32, scale=sb, double_scale=s2, block_sizes={-1: 16})
    ours = ref.nvfp4_fake_quant(x, scale)
    assert torch.equal(ours, theirs)
    assert (ours - x).abs().max() > 0  # it quantizes
    assert ref.native_fake_quant(x, scale, "native_nvfp4").equal(ours)


def test_nvfp4_bytes_are_four_and_a_half_bits():
    from kvcompress.models.base import Geometry
    from kvcompress.spec import native_spec

    g = Geometry(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, hidden_size=256, vocab_size=10, max_position=64, rope_theta=1e4, architecture="x")
    b = ref.spec_cache_nbytes(native_spec("native_nvfp4"), g, 1000)
    per_elem_bits = 8 * (b["key_payload"] + b["value_payload"] + b["block_scales"]) / (2 * 2 * 2 * 64 * 1000)
    assert per_elem_bits == 4.5


def test_native_nvfp4_end_to_end_exports_an_nvfp4_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    r = run_cli("model=tiny_llama", "calib=smoke", "eval=smoke", "kv=native_nvfp4", f"hydra.run.dir={run_dir}", cache_dir=tmp_path / "c")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads((run_dir / "report.json").read_text())
    assert rep["memory"]["bits_per_element"] == pytest.approx(4.5, abs=0.01) and rep["quality"]["kl_mean"] > 0
    cfg = json.loads((run_dir / "export" / "trtllm_ckpt" / "tp1" / "config.json").read_text())
    assert cfg["quantization"]["kv_cache_quant_algo"] == "NVFP4"
    art = rep["export"]["artifacts"]["trtllm_ckpt"]
    assert art["validated_as"] == "native_nvfp4" and "Blackwell" in art["pre_blackwell_fallback"]
    assert all(c["status"] == "passed" for c in rep["export"]["checks"])
    assert any("NVFP4" in c["check"] and "re-measured" in c["check"] for c in rep["export"]["checks"])
