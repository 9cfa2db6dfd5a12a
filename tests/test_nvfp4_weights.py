"""NVFP4 weight sources (NVIDIA Model Optimizer's `quant_algo: NVFP4` checkpoints): read dequantized by kvcompress's own
reader (kvcompress/models/nvfp4_weights.py), checked against Model Optimizer's NVFP4QTensor (the format's reference, in the
dev extra), streamed end to end, and exported: hf_ckpt keeps them as stored, the TensorRT-LLM checkpoint dequantizes them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import (loader_reads_as, modelopt_trtllm_layout, plain_copy, quantized_tiny_dir, refuses_weight_configs, run_cli, tensor_kind,
                      tiny_llama_dir, trtllm_writer_refuses_changed_weights)
from kvcompress.errors import UserError
from kvcompress.models import nvfp4_weights as nv
from kvcompress.models.quantized import weight_quantization
from kvcompress.models.checkpoint import Checkpoint


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


def _reads_as(tmp_path: Path, ckpt: Path, expect: dict, parts: tuple[str, ...]) -> None:
    """The streaming reader (whole and rows) and the custom tier's loader (conftest.loader_reads_as) read `expect` at the
    weights' [out, in] shape, none of `parts` left."""
    c = Checkpoint(ckpt)
    for k, w in expect.items():
        assert k in c and c.shape(k) == list(w.shape) and torch.equal(c.read(k), w) and torch.equal(c.read(k, 3, 11), w[3:11])
    out = loader_reads_as(tmp_path, ckpt, expect, ["models/nvfp4_weights.py"], "dequantize_nvfp4")
    assert not any(k.rsplit(".", 1)[-1] in parts for k in out)


def test_an_nvfp4_checkpoint_is_read_dequantized(tmp_path):
    """The streaming reader and the custom tier's loader (network_weights.dequantize_nvfp4, as the bundle ships it: without
    kvcompress installed) read Model Optimizer's values at the weight's [out, in] shape, the scales dropped; the engine's
    memory counts the fp16 weight the loader makes; another block size is refused in one line."""

    ckpt, expect = _nvfp4_dir(tmp_path)
    assert weight_quantization(ckpt) == "nvfp4"
    _reads_as(tmp_path, ckpt, expect, nv.PARTS)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(cfg | {"quantization_config": cfg["quantization_config"] | {"group_size": 32}}))
    with pytest.raises(UserError, match="quant_algo='NVFP4'"):
        weight_quantization(ckpt)


def test_an_nvfp4_checkpoint_runs_streamed_and_exports_its_weights_as_stored(tmp_path):
    """End to end, streamed: the run's perplexity and KL are those of the same weights written unquantized and loaded in
    memory; the export (the default kv: custom and native tiers, tp 1 and 2) passes every check that runs; hf_ckpt keeps
    the NVFP4 codes and scales the fold leaves alone as stored (the folded attention in float16, in exclude_modules;
    config.json's quantization_config is what Model Optimizer's own converter derives from the written
    hf_quant_config.json), and so does the TensorRT-LLM checkpoint, in the layout Model Optimizer's own TensorRT-LLM
    exporter writes (names, dtypes, shapes, quantization block); both say so with the activations caveat (their NVFP4
    servers quantize the kept layers' inputs to FP4, which validate does not); export.fp8_weights=dequantize writes them
    dequantized; model.streaming=false is one line."""
    ckpt, expect = _nvfp4_dir(tmp_path)
    common = ("model=llama3_8b", "model.name=q", "model.device=cpu", "model.dtype=float32", "calib=smoke", "eval=smoke", "eval.tasks.names=[]")
    p = run_cli(*common, f"model.path={ckpt}", "export.tp_sizes=[1,2]", f"hydra.run.dir={tmp_path / 'run'}", cache_dir=tmp_path / "cache")
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
    for name in ("trtllm_ckpt", "hf_ckpt"):  # both keep them, both served W4A4: not what validate ran; the custom tier serves it as validated
        assert "kept as stored" in arts[name]["source_nvfp4_weights"]
        caveat = arts[name]["served_otherwise"]
        assert caveat.startswith("served as quant_algo NVFP4") and "quantizes its input to FP4" in caveat and "(as the custom tier serves them)" in caveat
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
    # trtllm_ckpt: the MLP's codes and block scales as stored (split at tp 2: rows of fc / gate, column blocks of proj), the global
    # and input scales as float32 scalars, quant_algo NVFP4: the layout Model Optimizer's own TensorRT-LLM exporter writes
    trt = tmp_path / "run" / "export" / "trtllm_ckpt"
    t1 = load_file(str(trt / "tp1" / "rank0.safetensors"))
    t2 = [load_file(str(trt / "tp2" / f"rank{r}.safetensors")) for r in range(2)]
    for hf, name, dim in (("gate_proj", "fc", 0), ("up_proj", "gate", 0), ("down_proj", "proj", 1)):
        k, n = f"model.layers.1.mlp.{hf}.", f"transformer.layers.1.mlp.{name}."
        assert torch.equal(t1[n + "weight"], src[k + "weight"]) and torch.equal(_bytes(t1[n + "weights_scaling_factor"]), _bytes(src[k + "weight_scale"]))
        assert torch.equal(torch.cat([r[n + "weight"] for r in t2], dim), src[k + "weight"])
        assert torch.equal(torch.cat([_bytes(r[n + "weights_scaling_factor"]) for r in t2], dim), _bytes(src[k + "weight_scale"]))
        for ours, theirs in (("weights_scaling_factor_2", "weight_scale_2"), ("activation_scaling_factor", "input_scale")):
            assert all(r[n + ours].dtype == torch.float32 and r[n + ours].shape == () and r[n + ours] == src[k + theirs] for r in (t1, *t2))
    assert "quant_algo NVFP4: 6 e2m1 weights" in arts["trtllm_ckpt"]["weights"] and "Blackwell" in arts["trtllm_ckpt"]["weights"]
    q_trt = json.loads((trt / "tp1" / "config.json").read_text())["quantization"]
    assert q_trt["quant_algo"] == "NVFP4" and q_trt["group_size"] == 16
    mo_q, mo = modelopt_trtllm_layout(plain, tmp_path / "modelopt", "NVFP4_DEFAULT_CFG")
    extra = {k for k in mo if k.endswith((".k_cache_scaling_factor", ".v_cache_scaling_factor"))}  # ModelOpt's per-K/V copies of the KV scale
    assert {k: (tensor_kind(v), tuple(v.shape)) for k, v in t1.items()} == {k: v for k, v in mo.items() if k not in extra}
    assert (mo_q["quant_algo"], mo_q["group_size"], sorted(mo_q["exclude_modules"])) == ("NVFP4", 16, sorted(q_trt["exclude_modules"]))
    assert [c["status"] for c in manifest["checks"] if c["check"].startswith(("trtllm_ckpt/tp1 re-measured", "trtllm_ckpt/tp2 shards merge"))] == ["passed"] * 2
    assert (tmp_path / "run" / "export" / "plugin_bundle" / "nvfp4_weights.py").is_file()
    # export.fp8_weights=dequantize: hf_ckpt dequantized too (served as validated), and the note says so
    p4 = run_cli(*common, f"model.path={ckpt}", "kv=native_fp8", "export.fp8_weights=dequantize", f"hydra.run.dir={tmp_path / 'run4'}",
                 cache_dir=tmp_path / "cache")
    assert p4.returncode == 0, p4.stderr[-3000:]
    m4 = json.loads((tmp_path / "run4" / "export" / "manifest.json").read_text())
    assert "written dequantized" in m4["artifacts"]["hf_ckpt"]["source_nvfp4_weights"] and not m4["artifacts"]["hf_ckpt"]["fp8_weights_kept"]
    assert not any("served_otherwise" in a for a in m4["artifacts"].values())  # dequantized: served as validated
    hf4 = {k: v for f in sorted((tmp_path / "run4" / "export" / "hf_ckpt").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert hf4["model.layers.1.mlp.down_proj.weight"].dtype == torch.float16 and not any(k.endswith("weight_scale_2") for k in hf4)
    p3 = run_cli(*common, f"model.path={ckpt}", "model.streaming=false", "export=none", f"hydra.run.dir={tmp_path / 'run3'}")
    assert p3.returncode != 0 and "model.streaming=false" in p3.stderr and "NVFP4 weights" in p3.stderr and "Traceback" not in p3.stderr


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_an_nvfp4_mixture_of_experts_reads_its_experts_through_the_models_conversion(tmp_path, layout):
    """An NVFP4 Mixtral (each expert's w1/w2/w3 stored as its own NVFP4 Linear, the router unquantized; Model Optimizer's or
    compressed-tensors' layout): the streaming reader builds transformers' fused expert tensors from the dequantized
    per-expert weights (their scales are not taken for experts), so a streamed run measures the perplexity of the same
    weights written plain."""
    ckpt = tmp_path / "mixtral_nvfp4"
    sd = tiny_llama_dir(ckpt, "mixtral")
    new, expect = {}, {}
    for k, v in sd.items():
        if v.dim() == 2 and k.startswith("model.layers.") and (k.endswith("proj.weight") or ".experts." in k):
            mod = k.removesuffix("weight")
            if layout == "modelopt":
                codes, s, s2, expect[k] = _quantize(v)
                new |= {k: codes, mod + "weight_scale": s, mod + "weight_scale_2": s2, mod + "input_scale": torch.tensor(0.02)}
            else:
                c, _ = _ct_quantize(v, "NVFP4A16")
                new |= {mod + n: t for n, t in c.items()}
                expect[k] = nv.dequantize(c["weight_packed"], c["weight_scale"], c["weight_global_scale"], reciprocal=True)
        else:
            new[k] = v
    assert any(".experts.0.w1.weight" in k for k in expect), sorted(sd)[:20]
    save_file(new, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head", "*block_sparse_moe.gate"]}
                                  if layout == "modelopt" else _ct_config("NVFP4A16", ["lm_head", "re:.*block_sparse_moe.gate$"]))
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


# --- compressed-tensors' nvfp4-pack-quantized layout (llm-compressor's NVFP4 / NVFP4A16 exports) ---

def _ct_quantize(w: torch.Tensor, scheme_name: str):
    """compressed-tensors' own NVFP4 tensors of w (its global scale and fp8 block scales from its qparams helpers, codes from
    its compressor) and its own decompression (bfloat16)."""
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = preset_name_to_scheme(scheme_name, ["Linear"])
    gs = generate_gparam(w.min(), w.max()).reshape(1)
    blocks = w.float().reshape(w.shape[0], -1, nv.BLOCK)
    s, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights, global_scale=gs)
    c = NVFP4PackedCompressor.compress({"weight": w.float(), "weight_scale": s, "weight_global_scale": gs}, scheme)
    return c, NVFP4PackedCompressor.decompress(dict(c), scheme)["weight"]


def _ct_nvfp4_dir(tmp_path: Path, scheme_name: str = "NVFP4") -> tuple[Path, dict]:
    """A tiny Llama whose q/k/v/o and MLP projections are NVFP4 as compressed-tensors stores them (weight_packed,
    weight_scale, weight_global_scale; input_global_scale under the NVFP4 scheme), config.json's quantization_config the
    library's own QuantizationConfig of the preset scheme; and the float32 weights kvcompress's reader gives."""
    def quantize(k, v):
        m = k.removesuffix("weight")
        c, _ = _ct_quantize(v, scheme_name)
        stored = {m + n: t for n, t in c.items()} | ({m + "input_global_scale": torch.tensor([1234.5])} if scheme_name == "NVFP4" else {})
        return stored, nv.dequantize(c["weight_packed"], c["weight_scale"], c["weight_global_scale"], reciprocal=True)

    return quantized_tiny_dir(tmp_path / f"ct_{scheme_name}", quantize, _ct_config(scheme_name, ["lm_head"]))


def _ct_config(scheme_name: str, ignore: list[str]) -> dict:
    """config.json's quantization_config as compressed-tensors' own QuantizationConfig gives it for a preset NVFP4 scheme."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    return QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(scheme_name, ["Linear"])}, format="nvfp4-pack-quantized",
                              ignore=ignore, quantization_status="compressed").model_dump(mode="json")


@pytest.mark.parametrize("scheme_name", ["NVFP4", "NVFP4A16"])
def test_compressed_tensors_nvfp4_is_read_as_the_library_decompresses_it(tmp_path, scheme_name):
    """compressed-tensors' layout (codes in weight_packed, the global scale stored inverted): kvcompress's float32 values round
    to the library's own bfloat16 decompression bit for bit; the streaming reader, the integer reader (which leaves these
    uint8 weight_packed alone), the custom tier's loader as the bundle ships it and the engine's memory all see the [out, in]
    weight; an asymmetric or other-block config is refused in one line."""
    from kvcompress.models import int_weights

    torch.manual_seed(0)
    w = torch.randn(40, 96) * 0.05
    c, ref = _ct_quantize(w, scheme_name)
    ours = nv.dequantize(c["weight_packed"], c["weight_scale"], c["weight_global_scale"], reciprocal=True)
    assert torch.equal(ours.to(ref.dtype), ref) and float((ours - w).abs().max()) < 0.25 * float(w.abs().max())
    assert not torch.equal(nv.dequantize(c["weight_packed"], c["weight_scale"], c["weight_global_scale"]).to(ref.dtype), ref)  # multiplied: wrong
    ckpt, expect = _ct_nvfp4_dir(tmp_path, scheme_name)
    assert weight_quantization(ckpt) == "nvfp4"
    c = Checkpoint(ckpt)
    assert not c.packed and set(c.nvfp4) == set(expect) and all(p["layout"] == "compressed-tensors" for p in c.nvfp4.values())
    assert not int_weights.packed_names(load_file(str(ckpt / "model.safetensors")))
    _reads_as(tmp_path, ckpt, expect, nv.CT_PARTS)
    refuses_weight_configs(ckpt, [{"symmetric": False}, {"group_size": 32}])


def test_a_compressed_tensors_nvfp4_checkpoint_exports_its_weights_as_stored(tmp_path):
    """End to end, streamed (the NVFP4 scheme: W4A4): hf_ckpt keeps the codes and scales the fold leaves alone as stored, its
    config the source's with the folded attention added to `ignore` and the FP8 KV cache scheme; transformers with
    compressed-tensors loads it (decompressed) to the validated weights (to its bfloat16 rounding); the TensorRT-LLM checkpoint has them
    dequantized; the notes say so, hf_ckpt's with the activations caveat."""
    ckpt, expect = _ct_nvfp4_dir(tmp_path)
    common = ("model=llama3_8b", "model.name=q", "model.device=cpu", "model.dtype=float32", "calib=smoke", "eval=smoke", "eval.tasks.names=[]")
    p = run_cli(*common, f"model.path={ckpt}", f"hydra.run.dir={tmp_path / 'run'}", cache_dir=tmp_path / "cache")
    assert p.returncode == 0, p.stderr[-3000:]
    log = (tmp_path / "run" / "__main__.log").read_text()
    assert "WARNING" in log and "compressed-tensors NVFP4 (input_activations)" in log  # the served W4A4 model is not what validate ran
    assert "- **hf_ckpt activations**: served as compressed-tensors NVFP4" in (tmp_path / "run" / "report.md").read_text()  # the reviewer's report too
    manifest = json.loads((tmp_path / "run" / "export" / "manifest.json").read_text())
    assert all(c["status"] in ("passed", "skipped") for c in manifest["checks"]), manifest["checks"]
    arts = manifest["artifacts"]
    assert "kept as stored" in arts["hf_ckpt"]["source_nvfp4_weights"] and "its ignore list" in arts["hf_ckpt"]["source_nvfp4_weights"]
    assert "input_global_scale" in arts["hf_ckpt"]["served_otherwise"] and "served_otherwise" not in arts["trtllm_ckpt"]
    assert "/ global scale" in arts["trtllm_ckpt"]["source_nvfp4_weights"]
    hf_dir = tmp_path / "run" / "export" / "hf_ckpt"
    hf = {k: v for f in sorted(hf_dir.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    src = load_file(str(ckpt / "model.safetensors"))
    for part in nv.CT_PARTS:
        k = f"model.layers.1.mlp.down_proj.{part}"
        assert hf[k].dtype == src[k].dtype and torch.equal(_bytes(hf[k]), _bytes(src[k])), k
    assert hf["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float16 and "model.layers.0.self_attn.q_proj.weight_packed" not in hf
    q_src = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    q = json.loads((hf_dir / "config.json").read_text())["quantization_config"]
    attn = {f"model.layers.{i}.self_attn.{n}_proj" for i in range(2) for n in "qkvo"}
    assert q["config_groups"] == q_src["config_groups"] and q["format"] == "nvfp4-pack-quantized" and attn | {"lm_head"} <= set(q["ignore"])
    assert q["kv_cache_scheme"]["num_bits"] == 8 and q["kv_cache_scheme"]["type"] == "float"
    assert not (hf_dir / "hf_quant_config.json").exists()
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    m = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.bfloat16, quantization_config=CompressedTensorsConfig(run_compressed=False))
    for k in ("model.layers.1.mlp.down_proj.weight", "model.layers.0.mlp.gate_proj.weight"):
        assert torch.equal(m.get_parameter(k).detach(), expect[k].to(torch.bfloat16)), k
    t = load_file(str(next((tmp_path / "run" / "export" / "trtllm_ckpt" / "tp1").glob("*.safetensors"))))
    assert t["transformer.layers.1.mlp.proj.weight"].dtype == torch.float16


def test_tensorrt_llm_takes_nvfp4_mlps_only_where_its_layout_defines_the_validated_weights(tmp_path):
    """trtllm_ckpt keeps a Model Optimizer NVFP4 source's MLP (quant_algo NVFP4) at any tp whose rank holds whole 16-column
    blocks of down_proj; a weight-only W4A16_NVFP4 source (no such TensorRT-LLM quant_algo), compressed-tensors' inverted
    global scale and a tp splitting a block get them dequantized, each with its reason; the writer copies a kept weight
    only if it still defines the validated value."""
    from transformers import AutoConfig

    from kvcompress.models.base import Geometry
    from kvcompress.targets.trtllm_ckpt import fp8_mlp

    ckpt, expect = _nvfp4_dir(tmp_path)
    hf_cfg = AutoConfig.from_pretrained(str(ckpt))
    geom = Geometry.from_hf_config(hf_cfg)
    c = Checkpoint(ckpt)
    inter = c.shape("model.layers.0.mlp.down_proj.weight")[1]
    assert fp8_mlp(c, geom, hf_cfg, 1) == ("NVFP4", "", [0, 1]) and fp8_mlp(c, geom, hf_cfg, inter // 16)[0] == "NVFP4"
    algo, why, _ = fp8_mlp(c, geom, hf_cfg, inter // 8)  # 8 columns a rank: half a block
    assert algo is None and "whole blocks of 16" in why
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(cfg | {"quantization_config": cfg["quantization_config"] | {"quant_algo": "W4A16_NVFP4"}}))
    assert fp8_mlp(Checkpoint(ckpt), geom, hf_cfg)[1].startswith("TensorRT-LLM has no weight-only NVFP4 quant_algo")
    (ckpt / "config.json").write_text(json.dumps(cfg))
    ct, _ = _ct_nvfp4_dir(tmp_path)
    assert "reciprocal of the global scale" in fp8_mlp(Checkpoint(ct), geom, hf_cfg)[1]
    state = {k: c.read(k) for k in c.entries if k.rsplit(".", 1)[-1] not in nv.PARTS}
    trtllm_writer_refuses_changed_weights(c, state, hf_cfg, tmp_path / "w", "float16", "INT8")
