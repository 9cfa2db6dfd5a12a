"""NVFP4 weight sources (NVIDIA Model Optimizer's `quant_algo: NVFP4` checkpoints): read dequantized by kvcompress's own
reader (kvcompress/models/nvfp4_weights.py), checked against Model Optimizer's NVFP4QTensor (the format's reference, in the
dev extra), streamed end to end, and exported: hf_ckpt keeps them as stored, the TensorRT-LLM checkpoint dequantizes them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import bundle_loader, plain_copy, quantized_tiny_dir, run_cli, tiny_llama_dir
from kvcompress.errors import UserError
from kvcompress.models import nvfp4_weights as nv
from kvcompress.models.quantized import weight_quantization
from kvcompress.models.streaming import Checkpoint


def _quantize(w: torch.Tensor):
    """Model Optimizer's NVFP4 tensors of w (codes, fp8 block scales, global scale) and its own dequantization (float32)."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    q, s, s2 = NVFP4QTensor.quantize(w.float(), nv.BLOCK)
    return q._quantized_data, s, s2, q.dequantize(dtype=torch.float32, scale=s, double_scale=s2, block_sizes={-1: nv.BLOCK})


def _nvfp4_dir(tmp_path: Path) -> tuple[Path, dict]:
    """A tiny Llama whose q/k/v/o and MLP projections are NVFP4 as Model Optimizer's export stores them (codes under the
    weight's name, weight_scale, weight_scale_2, input_scale), with its config.json and hf_quant_config.json; and the
    float32 weights Model Optimizer's dequantization gives."""
    def quantize(k, v):
        m = k.removesuffix("weight")
        codes, s, s2, w = _quantize(v)
        return {k: codes, m + "weight_scale": s, m + "weight_scale_2": s2, m + "input_scale": torch.tensor(0.02)}, w

    q = {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}
    out, expect = quantized_tiny_dir(tmp_path / "nvfp4", quantize, {"quant_method": "modelopt", **q})
    (out / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt", "version": "0.47.0"}, "quantization": q}))
    return out, expect


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as its bytes (torch.equal has no float8 kernel on CPU); any other as it is."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_dequantize_is_model_optimizers():
    """e2m1 codes (even column in the low nibble) times the fp8 block scale times the global scale, the scales multiplied
    first in float32: Model Optimizer's own dequantization bit for bit, for any rows; a wrong block scale shape is refused."""
    torch.manual_seed(0)
    w = torch.randn(40, 96) * 0.05
    codes, s, s2, ref = _quantize(w)
    assert torch.equal(nv.dequantize(codes, s, s2), ref)
    assert torch.equal(nv.dequantize(codes[7:29], s[7:29], s2), ref[7:29])
    assert float((ref - w).abs().max()) < 0.25 * float(w.abs().max())  # and it is the weight, quantized
    assert not torch.equal(nv.dequantize((codes >> 4) | (codes << 4), s, s2), ref)  # the nibbles the other way round: another weight
    with pytest.raises(ValueError, match="do not fit"):
        nv.dequantize(codes, s[:, :3], s2)


def test_an_nvfp4_checkpoint_is_read_dequantized(tmp_path):
    """The streaming reader and the custom tier's loader (trtllm_network.dequantize_nvfp4, as the bundle ships it: without
    kvcompress installed) read Model Optimizer's values at the weight's [out, in] shape, the scales dropped; the engine's
    memory counts the fp16 weight the loader makes; another block size is refused in one line."""
    from kvcompress.targets import trtllm_network as tn

    ckpt, expect = _nvfp4_dir(tmp_path)
    assert weight_quantization(ckpt) == "nvfp4"
    c = Checkpoint(ckpt)
    for k, w in expect.items():
        assert c.shape(k) == list(w.shape) and torch.equal(c.read(k), w) and torch.equal(c.read(k, 3, 11), w[3:11])
    out = tn.dequantize_nvfp4(load_file(str(ckpt / "model.safetensors")), ckpt)
    assert not any(k.rsplit(".", 1)[-1] in nv.PARTS for k in out)
    for k, w in expect.items():
        assert torch.equal(out[k], w)
    spec = {"variant": {"n_sink": 0, "window": 0, "key_bits": 8, "value_bits": 4, "group": 16, "n_out": 0},
            "arch": {"n_layers": 0, "n_kv_heads": 1, "head_dim": 64}}
    assert tn.engine_memory(spec, ckpt, 1, 8)["weights_bytes"] == 2 * sum(t.numel() for t in out.values())
    assert bundle_loader(tmp_path, ["models/nvfp4_weights.py"], ckpt, "dequantize_nvfp4", "model.layers.0.self_attn.k_proj.weight") == float(
        expect["model.layers.0.self_attn.k_proj.weight"].double().sum())
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(cfg | {"quantization_config": cfg["quantization_config"] | {"group_size": 32}}))
    with pytest.raises(UserError, match="quant_algo='NVFP4'"):
        weight_quantization(ckpt)


def test_an_nvfp4_checkpoint_runs_streamed_and_exports_its_weights_as_stored(tmp_path):
    """End to end, streamed: the run's perplexity and KL are those of the same weights written unquantized and loaded in
    memory; the export (the default kv: custom and native tiers) passes every check that runs; hf_ckpt keeps the NVFP4
    codes and scales the fold leaves alone as stored (the folded attention in float16, in exclude_modules; config.json's
    quantization_config is what Model Optimizer's own converter derives from the written hf_quant_config.json), the
    TensorRT-LLM checkpoint has them dequantized; each says so, hf_ckpt with the activations caveat (its NVFP4 server
    quantizes the kept layers' inputs to FP4, which validate does not); export.fp8_weights=dequantize writes hf_ckpt
    dequantized; model.streaming=false is one line."""
    ckpt, expect = _nvfp4_dir(tmp_path)
    common = ("model=llama3_8b", "model.name=q", "model.device=cpu", "model.dtype=float32", "calib=smoke", "eval=smoke", "eval.tasks.names=[]")
    p = run_cli(*common, f"model.path={ckpt}", f"hydra.run.dir={tmp_path / 'run'}", cache_dir=tmp_path / "cache")
    assert p.returncode == 0, p.stderr[-3000:]
    sd = {k: v for k, v in load_file(str(ckpt / "model.safetensors")).items() if k not in expect and k.rsplit(".", 1)[-1] not in nv.PARTS}
    plain = plain_copy(ckpt, tmp_path / "plain", {**sd, **expect})
    (plain / "hf_quant_config.json").unlink()
    p2 = run_cli(*common, f"model.path={plain}", "export=none", "model.streaming=false", f"hydra.run.dir={tmp_path / 'run_plain'}",
                 cache_dir=tmp_path / "cache")
    assert p2.returncode == 0, p2.stderr[-3000:]
    a, b = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("run", "run_plain"))
    assert a["quality"]["ppl_baseline"] == pytest.approx(b["quality"]["ppl_baseline"], rel=1e-6)
    assert a["quality"]["kl_mean"] == pytest.approx(b["quality"]["kl_mean"], rel=1e-4)
    manifest = json.loads((tmp_path / "run" / "export" / "manifest.json").read_text())
    assert all(c["status"] in ("passed", "skipped") for c in manifest["checks"]), manifest["checks"]
    arts = manifest["artifacts"]
    assert "written dequantized" in arts["trtllm_ckpt"]["source_nvfp4_weights"] and "kept as stored" in arts["hf_ckpt"]["source_nvfp4_weights"]
    assert "quantizes its input to FP4" in arts["hf_ckpt"]["source_nvfp4_weights"]  # the served W4A4 model: not what validate ran
    assert "activations unquantized as validate ran them" in arts["trtllm_ckpt"]["source_nvfp4_weights"]
    # hf_ckpt: the MLP's codes and scales as stored, the folded attention in float16 and excluded, ModelOpt's NVFP4 config
    hf_dir = tmp_path / "run" / "export" / "hf_ckpt"
    hf = {k: v for f in sorted(hf_dir.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    src = load_file(str(ckpt / "model.safetensors"))
    for part in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
        k = f"model.layers.1.mlp.down_proj.{part}"
        assert hf[k].dtype == src[k].dtype and torch.equal(_bytes(hf[k]), _bytes(src[k])), k
    assert hf["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float16 and "model.layers.0.self_attn.q_proj.weight_scale" not in hf
    attn = {f"model.layers.{i}.self_attn.{n}_proj" for i in range(2) for n in "qkvo"}
    hq = json.loads((hf_dir / "hf_quant_config.json").read_text())
    assert hq["quantization"]["quant_algo"] == "NVFP4" and hq["quantization"]["group_size"] == 16 and attn <= set(hq["quantization"]["exclude_modules"])
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format

    assert convert_hf_quant_config_format(hq) == json.loads((hf_dir / "config.json").read_text())["quantization_config"]
    assert Checkpoint(hf_dir).read("model.layers.1.mlp.down_proj.weight").equal(expect["model.layers.1.mlp.down_proj.weight"])
    t = load_file(str(next((tmp_path / "run" / "export" / "trtllm_ckpt" / "tp1").glob("*.safetensors"))))
    assert t["transformer.layers.1.mlp.proj.weight"].dtype == torch.float16
    assert (tmp_path / "run" / "export" / "plugin_bundle" / "nvfp4_weights.py").is_file()
    # export.fp8_weights=dequantize: hf_ckpt dequantized too (served as validated), and the note says so
    p4 = run_cli(*common, f"model.path={ckpt}", "kv=native_fp8", "export.fp8_weights=dequantize", f"hydra.run.dir={tmp_path / 'run4'}",
                 cache_dir=tmp_path / "cache")
    assert p4.returncode == 0, p4.stderr[-3000:]
    m4 = json.loads((tmp_path / "run4" / "export" / "manifest.json").read_text())
    assert "written dequantized" in m4["artifacts"]["hf_ckpt"]["source_nvfp4_weights"] and not m4["artifacts"]["hf_ckpt"]["fp8_weights_kept"]
    hf4 = {k: v for f in sorted((tmp_path / "run4" / "export" / "hf_ckpt").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert hf4["model.layers.1.mlp.down_proj.weight"].dtype == torch.float16 and not any(k.endswith("weight_scale_2") for k in hf4)
    p3 = run_cli(*common, f"model.path={ckpt}", "model.streaming=false", "export=none", f"hydra.run.dir={tmp_path / 'run3'}")
    assert p3.returncode != 0 and "model.streaming=false" in p3.stderr and "NVFP4 weights" in p3.stderr and "Traceback" not in p3.stderr


def test_an_nvfp4_mixture_of_experts_reads_its_experts_through_the_models_conversion(tmp_path):
    """An NVFP4 Mixtral (each expert's w1/w2/w3 stored as its own NVFP4 Linear, the router unquantized): the streaming
    reader builds transformers' fused expert tensors from the dequantized per-expert weights (their scales are not taken
    for experts), so a streamed run measures the perplexity of the same weights written plain."""
    ckpt = tmp_path / "mixtral_nvfp4"
    sd = tiny_llama_dir(ckpt, "mixtral")
    new, expect = {}, {}
    for k, v in sd.items():
        if v.dim() == 2 and k.startswith("model.layers.") and (k.endswith("proj.weight") or ".experts." in k):
            mod = k.removesuffix("weight")
            codes, s, s2, expect[k] = _quantize(v)
            new |= {k: codes, mod + "weight_scale": s, mod + "weight_scale_2": s2, mod + "input_scale": torch.tensor(0.02)}
        else:
            new[k] = v
    assert any(".experts.0.w1.weight" in k for k in expect), sorted(sd)[:20]
    save_file(new, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head", "*block_sparse_moe.gate"]}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    common = ("model=llama3_8b", "model.name=q", "model.device=cpu", "model.dtype=float32", "calib=smoke", "eval=smoke", "eval.tasks.names=[]", "export=none")
    p = run_cli(*common, f"model.path={ckpt}", f"hydra.run.dir={tmp_path / 'run'}", cache_dir=tmp_path / "cache")
    assert p.returncode == 0, p.stderr[-3000:]
    plain_sd = {k: v for k, v in sd.items() if k not in expect} | expect
    plain = plain_copy(ckpt, tmp_path / "plain", plain_sd)
    p2 = run_cli(*common, f"model.path={plain}", "model.streaming=false", f"hydra.run.dir={tmp_path / 'run_plain'}", cache_dir=tmp_path / "cache")
    assert p2.returncode == 0, p2.stderr[-3000:]
    a, b = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("run", "run_plain"))
    assert a["model"].get("streamed") and a["quality"]["ppl_baseline"] == pytest.approx(b["quality"]["ppl_baseline"], rel=1e-6)


@pytest.mark.parametrize("algo", ["NVFP4", "W4A16_NVFP4"])
def test_the_kept_nvfp4_config_is_model_optimizers(algo):
    """hf_ckpt's config.json quantization_config for a kept NVFP4 source (weights and activations, or weights only) is what
    Model Optimizer's own converter derives from the hf_quant_config.json written beside it."""
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format

    from kvcompress.targets.hf_ckpt import fp8_weight_configs

    src = {"quant_method": "modelopt", "quant_algo": algo, "group_size": 16, "exclude_modules": ["lm_head"]}
    cfg, hq = fp8_weight_configs(src, {"producer": {"name": "modelopt"}, "quantization": {k: v for k, v in src.items() if k != "quant_method"}},
                                 ["model.layers.0.self_attn.q_proj"])
    assert hq["quantization"]["quant_algo"] == algo and hq["quantization"]["exclude_modules"] == ["lm_head", "model.layers.0.self_attn.q_proj"]
    assert convert_hf_quant_config_format(hq) == cfg
    assert ("input_activations" in cfg["config_groups"]["group_0"]) == (algo == "NVFP4")
