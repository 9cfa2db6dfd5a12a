"""Checkpoints whose weights are stored quantized (models.quantized): FP8 weights read dequantized by the streaming reader
(before, their float8 values were read as weights: every key clipped, perplexity off), other formats refused in one line."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import bundle_loader, modelopt_trtllm_layout, plain_copy, quantized_tiny_dir, run_cli, tensor_kind, trtllm_writer_refuses_changed_weights
from kvcompress.errors import UserError
from kvcompress.models.quantized import weight_quantization
from kvcompress.models.checkpoint import Checkpoint


def _quantized_dir(tmp_path: Path, qcfg: dict, block: tuple[int, int] | str | None, name: str = "fp8", scale_suffix: str = "_scale_inv",
                   input_scale: bool = False) -> tuple[Path, dict]:
    """A tiny Llama saved as an HF directory whose q/k/v/o/MLP weights are float8 e4m3 with stored scales: per block of
    `block` (rows and columns not multiples of it: ceil blocks), "row": one per output row ([rows, 1]), or None: one per
    tensor; input_scale: a static activation scale beside each (ModelOpt FP8). Returns the directory and the float32
    weights those float8 values and scales define, computed here independently of the reader."""
    seen = []

    def quantize(k, v):
        o, i = v.shape
        new = {}
        seen.append(k)
        if input_scale:
            new[k.removesuffix("weight") + "input_scale"] = torch.tensor(0.02 + 0.001 * len(seen))
        if block is None:
            s = v.abs().max() / 448.0
            q = (v / s).to(torch.float8_e4m3fn)
            new[k], new[k + scale_suffix] = q, s.reshape(1).float()
            return new, q.float() * s
        if block == "row":
            s = v.abs().amax(1, keepdim=True) / 448.0
            q = (v / s).to(torch.float8_e4m3fn)
            new[k], new[k + scale_suffix] = q, s.float()
            return new, q.float() * s
        b0, b1 = block
        s = torch.zeros(math.ceil(o / b0), math.ceil(i / b1))
        for r in range(s.shape[0]):
            for c in range(s.shape[1]):
                s[r, c] = v[r * b0 : (r + 1) * b0, c * b1 : (c + 1) * b1].abs().max() / 448.0
        full = s.repeat_interleave(b0, 0)[:o].repeat_interleave(b1, 1)[:, :i]
        q = (v / full).to(torch.float8_e4m3fn)
        new[k], new[k + scale_suffix] = q, s
        return new, q.float() * full

    return quantized_tiny_dir(tmp_path / name, quantize, qcfg)


BLOCK_FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [64, 64]}


@pytest.mark.parametrize("qcfg,block,suffix", [
    (BLOCK_FP8, (64, 64), "_scale_inv"),  # DeepSeek / transformers fine-grained FP8, blocks that do not divide 96 or 256
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, (32, 64), "_scale_inv"),  # no block size stated: implied by the shapes
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": None}, None, "_scale"),  # Model Optimizer: one scale per tensor
    ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}, "row", "_scale"),  # Meta's FP8: one scale per output row ([rows, 1])
])
def test_fp8_weights_are_read_dequantized(tmp_path, qcfg, block, suffix):
    ckpt, expect = _quantized_dir(tmp_path, qcfg, block, scale_suffix=suffix)
    assert weight_quantization(ckpt) == "fp8"
    c = Checkpoint(ckpt)
    for k, w in expect.items():
        torch.testing.assert_close(c.read(k), w, atol=0, rtol=0)
        hi = min(90, w.shape[0])
        torch.testing.assert_close(c.read(k, 37, hi), w[37:hi], atol=0, rtol=0)  # a row range across block edges
    assert c.read("model.norm.weight").dtype == torch.float32  # unquantized tensors as stored


def test_an_fp8_checkpoint_runs_streamed_and_model_streaming_false_is_one_line(tmp_path):
    """End to end, streamed whatever model.streaming=auto decides; the run's perplexity is the dequantized model's, which
    an in-memory run of the same weights written unquantized reproduces (before: ~10% off, every key clipped)."""
    ckpt, expect = _quantized_dir(tmp_path, BLOCK_FP8, (64, 64))
    sd = {k: v for k, v in load_file(str(ckpt / "model.safetensors")).items() if not k.endswith("_scale_inv")}
    plain = plain_copy(ckpt, tmp_path / "plain", {**sd, **expect})

    def run(path, name, *extra):
        p = run_cli("model=llama3_8b", f"model.path={path}", "model.name=q", "model.device=cpu", "model.dtype=float32", "calib=smoke", "eval=smoke",
                    "export=none", "eval.tasks.names=[]", *extra, f"hydra.run.dir={tmp_path / name}", cache_dir=tmp_path / "cache")
        return p, tmp_path / name

    p, r = run(ckpt, "run_fp8")
    assert p.returncode == 0, p.stderr[-3000:]
    p2, r2 = run(plain, "run_plain", "model.streaming=false")
    assert p2.returncode == 0, p2.stderr[-3000:]
    a, b = (json.loads((d / "report.json").read_text()) for d in (r, r2))
    assert a["model"].get("streamed") and not b["model"].get("streamed")
    assert a["quality"]["ppl_baseline"] == pytest.approx(b["quality"]["ppl_baseline"], rel=1e-6)
    assert a["quality"]["kl_mean"] == pytest.approx(b["quality"]["kl_mean"], rel=1e-3)
    p3, r3 = run(ckpt, "forced", "model.streaming=false")
    assert p3.returncode != 0 and "stores FP8 weights" in p3.stderr and "Traceback" not in p3.stderr and not r3.exists()
    p4, r4 = run(ckpt, "spread", "model.device=auto")  # llama70b's default: the whole model over the GPUs, never streamed
    assert p4.returncode != 0 and "model.device=auto: model.path=" in p4.stderr and "allowed for it: model.device=cpu or cuda:N" in p4.stderr
    assert "Traceback" not in p4.stderr and not r4.exists()


@pytest.mark.parametrize("qcfg,name", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "'awq'"),  # AWQ's GEMV layout (GEMM is read: test_int_weights)
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}, "quant_algo='NVFP4'"),  # 16-column blocks are read (test_nvfp4_weights)
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4}}}}, "'compressed-tensors'"),
])
def test_other_weight_formats_are_one_line(tmp_path, qcfg, name):
    ckpt, _ = _quantized_dir(tmp_path, qcfg, None)
    with pytest.raises(UserError) as e:
        weight_quantization(ckpt)
    assert name in str(e.value) and "point it at the unquantized checkpoint" in str(e.value) and "\n" not in str(e.value)
    p = run_cli("model=llama3_8b", f"model.path={ckpt}", "model.name=q", "calib=smoke", "eval=smoke", "export=none",
                f"hydra.run.dir={tmp_path / 'r'}", cache_dir=tmp_path / "cache")
    assert p.returncode != 0 and "stores its weights quantized" in p.stderr and "Traceback" not in p.stderr and not (tmp_path / "r").exists()


def test_kv_only_quantization_and_unscaled_float8(tmp_path):
    """This project's own FP8 HF checkpoint quantizes only the KV cache: its weights read as stored. A float8 weight
    without a stored scale is one line."""
    d = tmp_path
    (d / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "modelopt", "kv_cache_scheme": {"type": "float"}}}))
    assert weight_quantization(d) is None
    save_file({"w": torch.ones(4, 4).to(torch.float8_e4m3fn)}, str(d / "model.safetensors"))
    with pytest.raises(UserError, match="without a w_scale_inv or w_scale"):
        Checkpoint(d).read("w")


def test_the_custom_tier_weight_loader_dequantizes_as_the_bundle_ships_it(tmp_path):
    """build_engine.py --tier custom reads the model's own HF directory (network_weights.load_hf_weights): FP8 weights come
    out as the values their scales define, the scale tensors dropped; in the bundle, without kvcompress installed,
    through the fp8_weights.py copied beside trtllm_network.py."""

    from kvcompress.targets.network_weights import dequantize_fp8

    ckpt, expect = _quantized_dir(tmp_path, BLOCK_FP8, (64, 64))
    raw = load_file(str(ckpt / "model.safetensors"))
    out = dequantize_fp8(raw, ckpt)
    assert set(out) == {k for k in raw if not k.endswith("_scale_inv")}
    for k, w in expect.items():
        torch.testing.assert_close(out[k], w, atol=0, rtol=0)
    # the engine's memory counts each FP8 weight as the fp16 constant the loader makes of it, and no scale tensor
    from kvcompress.targets.trtllm_network import engine_memory

    spec = {"variant": {"n_sink": 0, "window": 0, "key_bits": 8, "value_bits": 4, "group": 16, "n_out": 0},
            "arch": {"n_layers": 0, "n_kv_heads": 1, "head_dim": 64}}
    assert engine_memory(spec, ckpt, 1, 8)["weights_bytes"] == 2 * sum(t.numel() for t in out.values())
    assert bundle_loader(tmp_path, ["models/fp8_weights.py"], ckpt, "dequantize_fp8", "model.layers.0.self_attn.k_proj.weight") == pytest.approx(
        float(expect["model.layers.0.self_attn.k_proj.weight"].double().sum()), rel=1e-12)


FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An expert weight [E, A, B] as GPT-OSS stores it in MXFP4 (OpenAI's layout, which transformers reads): the transposed
    rows [E, B, A] in groups of 32 along A, e2m1 codes two per byte (even element in the low nibble), one e8m0 exponent
    byte per group; returns (blocks [E, B, A/32, 16], scales [E, B, A/32], the values they define [E, A, B]), written here."""
    m = w.transpose(1, 2).float()
    E, B, A = m.shape
    g = m.reshape(E, B, A // 32, 32)
    e = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=1e-30) / 6.0))
    idx = ((g / torch.exp2(e)[..., None])[..., None] - FP4).abs().argmin(-1)
    values = (FP4[idx] * torch.exp2(e)[..., None]).reshape(E, B, A).transpose(1, 2).contiguous()
    return (idx[..., 0::2] | (idx[..., 1::2] << 4)).to(torch.uint8), (e + 127).to(torch.uint8), values


def _gpt_oss_dir(tmp_path: Path) -> tuple[Path, dict]:
    """A tiny GPT-OSS saved as OpenAI ships it: experts in MXFP4 (written here by _mxfp4), the rest unquantized; returns the
    directory and the expert weights the codes define."""
    from kvcompress.models.synthetic import byte_tokenizer
    from test_architectures import tiny

    m = tiny("gpt_oss").model
    m.config.architectures = ["GptOssForCausalLM"]
    ckpt = tmp_path / "gpt_oss"
    m.save_pretrained(str(ckpt))
    byte_tokenizer().save_pretrained(str(ckpt))
    sd, new, expect = load_file(str(ckpt / "model.safetensors")), {}, {}
    for k, v in sd.items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            new[k + "_blocks"], new[k + "_scales"], expect[k] = _mxfp4(v)
        else:
            new[k] = v
    save_file(new, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                                       "model.embed_tokens", "lm_head"]}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    return ckpt, expect


def test_gpt_oss_mxfp4_experts_load_dequantized_streamed_and_in_memory(tmp_path):
    """GPT-OSS ships its experts in MXFP4: kvcompress reads them layer by layer, dequantized by its reader (model.streaming=auto or
    true), or loads them in memory, transformers dequantizing them (model.streaming=false; before: a traceback or a GPU
    requirement); either way the experts' weights are the values the codes define (computed by the test), and a streamed run
    validates with the in-memory run's perplexity; model.device=auto with streaming is one line."""
    from kvcompress.config import ModelConfig
    from kvcompress.models import load_model

    ckpt, expect = _gpt_oss_dir(tmp_path)
    assert weight_quantization(ckpt) == "mxfp4"
    lm = load_model(ModelConfig(name="gpt_oss", source="hf_dir", path=str(ckpt), device="cpu", dtype="float32", streaming=False), tmp_path / "cache")
    assert lm.streamer is None
    params = dict(lm.model.named_parameters())
    assert len(expect) == 2 * lm.model.config.num_hidden_layers
    c = Checkpoint(ckpt)
    for k, w in expect.items():
        torch.testing.assert_close(params[k], w, atol=0, rtol=0)
        torch.testing.assert_close(c.read(k), w, atol=0, rtol=0)  # the streaming reader
        torch.testing.assert_close(c.read(k, 1, 3), w[1:3], atol=0, rtol=0)  # experts 1..2 alone
        assert c.shape(k) == list(w.shape) and k in c

    def run(name, *extra):
        p = run_cli("model=llama3_8b", f"model.path={ckpt}", "model.name=q", "model.device=cpu", "model.dtype=float32", "calib=smoke", "eval=smoke",
                    "export=none", "eval.tasks.names=[]", *extra, f"hydra.run.dir={tmp_path / name}", cache_dir=tmp_path / "cache")
        return p, tmp_path / name

    (p, r), (p2, r2) = run("streamed"), run("memory", "model.streaming=false")
    assert p.returncode == 0 and p2.returncode == 0, (p.stderr + p2.stderr)[-3000:]
    a, b = (json.loads((d / "report.json").read_text()) for d in (r, r2))
    assert a["model"].get("streamed") and not b["model"].get("streamed")
    assert a["quality"]["ppl_baseline"] == pytest.approx(b["quality"]["ppl_baseline"], rel=1e-5)
    p3, r3 = run("spread", "model.device=auto")
    assert p3.returncode != 0 and "stores MXFP4 experts" in p3.stderr and "Traceback" not in p3.stderr and not r3.exists()


CT_FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "strategy": "channel", "dynamic": False},
                                        "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True}}}}
FBGEMM = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]}
MODELOPT = {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": None}


def _export(tmp_path, ckpt, name, *extra):
    run = tmp_path / name
    p = run_cli("model=llama3_8b", f"model.path={ckpt}", "model.name=q", "model.device=cpu", "calib=smoke", "eval=smoke", "kv=native_fp8",
                "eval.tasks.names=[]", "export.dtype=bfloat16", *extra, f"hydra.run.dir={run}", cache_dir=tmp_path / "cache")
    assert p.returncode == 0, p.stderr[-3000:]
    return run / "export"


def _tensors(d: Path) -> dict:
    return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.mark.parametrize("qcfg,block,suffix,input_scale", [
    (BLOCK_FP8 | {"weight_block_size": [32, 32]}, (32, 32), "_scale_inv", False),  # DeepSeek / Qwen3 fine-grained FP8
    (MODELOPT, None, "_scale", True),  # Model Optimizer FP8: one weight scale per tensor, static input scales
    (CT_FP8, "row", "_scale", False),  # compressed-tensors (llm-compressor FP8-dynamic): one scale per output channel
    (FBGEMM, "row", "_scale", False),  # Meta's Llama 3.1 405B FP8
])
def test_an_fp8_source_exports_its_fp8_weights_as_stored(tmp_path, qcfg, block, suffix, input_scale):
    """export.fp8_weights=keep (the default): hf_ckpt/ holds the source's float8 weights and scale tensors byte for byte, the attention
    projections the fold changes in export.dtype, listed as unquantized in the source's own format; the export's re-measurement
    (its own check) passed; smaller than the dequantized export."""
    ckpt, _ = _quantized_dir(tmp_path, qcfg, block, scale_suffix=suffix, input_scale=input_scale)
    if qcfg is FBGEMM:  # a per-module tensor compressed-tensors has no place for (transformers' FbgemmFp8Linear's input_scale_ub)
        sd = load_file(str(ckpt / "model.safetensors"))
        save_file(sd | {k.removesuffix("weight") + "input_scale_ub": torch.tensor([1200.0]) for k in sd if k.endswith("mlp.up_proj.weight")},
                  str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    src = load_file(str(ckpt / "model.safetensors"))
    out = _export(tmp_path, ckpt, "run")
    hf = out / "hf_ckpt"
    got = _tensors(hf)
    attn = {k.removesuffix(".weight") for k in src if k.split(".")[-2] in ATTN and k.endswith(".weight")}
    for k, v in src.items():
        module = k.rsplit(".", 1)[0]
        if module in attn:  # folded: written in export.dtype, no scales
            assert k not in got or (k.endswith(".weight") and got[k].dtype == torch.bfloat16), k
        elif v.dtype == torch.float8_e4m3fn or k.endswith(("_scale", "_scale_inv")):
            assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8) if v.dtype == torch.float8_e4m3fn else got[k], v.view(torch.uint8)
                                                            if v.dtype == torch.float8_e4m3fn else v), k
    assert sum(1 for v in got.values() if v.dtype == torch.float8_e4m3fn) == 6  # 2 layers x gate/up/down
    cfg = json.loads((hf / "config.json").read_text())["quantization_config"]
    listed = cfg.get("modules_to_not_convert") or cfg.get("ignore")
    assert attn | set(qcfg.get("modules_to_not_convert") or qcfg.get("ignore") or []) <= set(listed)  # the source's own entries kept
    if qcfg is MODELOPT:
        hq = json.loads((hf / "hf_quant_config.json").read_text())["quantization"]
        assert hq["quant_algo"] == "FP8" and hq["kv_cache_quant_algo"] == "FP8" and set(attn) <= set(hq["exclude_modules"])
        convert = pytest.importorskip("modelopt.torch.export.convert_hf_config").convert_hf_quant_config_format
        assert convert(json.loads((hf / "hf_quant_config.json").read_text())) == cfg  # ModelOpt's own converter gives config.json's
    elif qcfg is FBGEMM:  # written as compressed-tensors (the same tensors), whose KV-cache scheme vLLM reads (its fbgemm_fp8 config has none)
        from kvcompress.targets.hf_ckpt import CT_FROM_FBGEMM

        assert {k: v for k, v in cfg.items() if k not in ("ignore", "kv_cache_scheme")} == CT_FROM_FBGEMM
        assert cfg["kv_cache_scheme"]["strategy"] == "tensor" and not cfg["kv_cache_scheme"]["dynamic"]
        assert not any(k.endswith("input_scale_ub") for k in got) and not (hf / "hf_quant_config.json").exists()
    else:
        assert cfg["quant_method"] == qcfg["quant_method"] and not (hf / "hf_quant_config.json").exists()
        assert all(cfg[k] == v for k, v in qcfg.items() if k not in ("modules_to_not_convert", "ignore"))
    if qcfg is CT_FP8:
        assert cfg["kv_cache_scheme"]["type"] == "float" and cfg["kv_cache_scheme"]["num_bits"] == 8 and not cfg["kv_cache_scheme"]["dynamic"]
    m = json.loads((out / "manifest.json").read_text())
    assert m["artifacts"]["hf_ckpt"]["fp8_weights_kept"] is True
    assert "- hf_ckpt weights: the source's quantized weights kept as stored (6 FP8" in (out.parent / "report.md").read_text()
    assert [c["status"] for c in m["checks"] if c["check"].startswith("hf_ckpt re-measured")] == ["passed"]
    w = Checkpoint(hf)
    for k in src:  # what the written checkpoint defines == the validated model's weights (the source's, folded where listed)
        if k.endswith(".weight") and k.split(".")[-2] in ("gate_proj", "up_proj", "down_proj"):
            torch.testing.assert_close(w.read(k), Checkpoint(ckpt).read(k), atol=0, rtol=0)
    if qcfg is FBGEMM:  # the dequantizing export, for the size
        dq = _tensors(_export(tmp_path, ckpt, "dq", "export.fp8_weights=dequantize") / "hf_ckpt")
        assert not any(v.dtype == torch.float8_e4m3fn for v in dq.values())
        size = lambda t: sum(v.numel() * v.element_size() for k, v in t.items() if ".layers." in k)  # noqa: E731
        assert size(got) < 0.8 * size(dq)


def test_transformers_reads_the_kept_fp8_export_as_kvcompress_does(tmp_path):
    """An independent reader of the format: transformers' fine-grained FP8 loader (dequantize=True, on CPU) reads the exported
    checkpoint's weights exactly as kvcompress's re-measurement did, modules_to_not_convert included."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    ckpt, _ = _quantized_dir(tmp_path, BLOCK_FP8 | {"weight_block_size": [32, 32]}, (32, 32))
    hf = _export(tmp_path, ckpt, "run") / "hf_ckpt"
    m = AutoModelForCausalLM.from_pretrained(str(hf), quantization_config=FineGrainedFP8Config(dequantize=True, weight_block_size=(32, 32)),
                                             dtype=torch.float32)
    ours, n = Checkpoint(hf), 0
    for k, v in m.named_parameters():
        if k in ours:
            torch.testing.assert_close(v.detach(), ours.read(k).float(), atol=0, rtol=0)
            n += 1
    assert n >= 20


def test_a_kept_fp8_weight_is_checked_against_what_was_validated(tmp_path):
    """The writer copies a kept FP8 weight only if its stored bytes define exactly the value it is handed (the validated model's):
    a changed one is refused and nothing is left behind. Where a key norm takes the fold's key factors (Qwen3), q/k_proj keep FP8."""
    from transformers import AutoConfig

    from kvcompress.targets.hf_ckpt import HFWriter, folded_by_export

    ckpt, _ = _quantized_dir(tmp_path, BLOCK_FP8 | {"weight_block_size": [32, 32]}, (32, 32))
    c = Checkpoint(ckpt)
    state = {k: c.read(k) for k in c.entries if not k.endswith("_scale_inv")}
    w = HFWriter({k: torch.empty_like(v, device="meta") for k, v in state.items()}, AutoConfig.from_pretrained(str(ckpt)), None, tmp_path / "out",
                 torch.ones(2), torch.bfloat16, 100, fp8_source=c)
    k = "model.layers.0.mlp.up_proj.weight"
    assert k in w.kept and "model.layers.0.self_attn.q_proj" in w.unquantized and "model.layers.0.mlp.up_proj" not in w.unquantized
    w.write(k, state[k])  # unchanged: copied
    with pytest.raises(RuntimeError, match="changed before writing"):
        w.write("model.layers.1.mlp.up_proj.weight", state["model.layers.1.mlp.up_proj.weight"] * 1.01)
    w.abort()
    assert not list((tmp_path / "out").glob("*.safetensors*")) and not list((tmp_path / "out").glob(".*.tmp"))
    names = {"model.layers.3.self_attn.k_norm.weight"}
    assert not folded_by_export("model.layers.3.self_attn.q_proj.weight", names) and folded_by_export("model.layers.3.self_attn.o_proj.weight", names)
    assert folded_by_export("model.layers.3.self_attn.k_proj.weight", set()) and not folded_by_export("model.layers.3.mlp.down_proj.weight", set())


def test_gpt_oss_exports_with_its_mxfp4_experts_as_stored(tmp_path):
    """GPT-OSS (sinks, biases: the fold is exact) exports as the FP8-KV HF checkpoint with its MXFP4 experts copied as stored (blocks
    and scales byte for byte, the source's quantization_config), the folded attention in bfloat16; re-measured as validated;
    transformers' own MXFP4 loader reads the export as kvcompress's reader does. In bfloat16 the self-check fails (transformers'
    GPT-OSS attention takes its softmax in bfloat16): one line that points at model.dtype=float32."""
    from kvcompress.config import ModelConfig
    from kvcompress.models import load_model

    ckpt, _ = _gpt_oss_dir(tmp_path)
    out = _export(tmp_path, ckpt, "run", "model.dtype=float32")
    hf = out / "hf_ckpt"
    src, got = load_file(str(ckpt / "model.safetensors")), _tensors(hf)
    packed = [k for k in src if k.endswith(("_blocks", "_scales"))]
    assert len(packed) == 4 * 3 and all(torch.equal(got[k], src[k]) for k in packed)
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in got)
    assert got["model.layers.0.self_attn.k_proj.weight"].dtype == torch.bfloat16 and "model.layers.0.self_attn.sinks" in got
    assert json.loads((hf / "config.json").read_text())["quantization_config"] == json.loads((ckpt / "config.json").read_text())["quantization_config"]
    m = json.loads((out / "manifest.json").read_text())
    assert m["artifacts"]["hf_ckpt"]["fp8_weights_kept"] and "6 MXFP4" in m["artifacts"]["hf_ckpt"]["weights"]
    assert "the source's MXFP4 weights kept" in m["artifacts"]["hf_ckpt"]["what"]
    # vLLM's mxfp4 config reads no KV scales (it quantizes at 1.0): each layer's scale is folded into the weights, the stored ones are 1.0
    art = m["artifacts"]["hf_ckpt"]
    assert "reads no k_scale / v_scale" in art["kv_scale_absorbed"] and "kv_scales_unread" not in art
    assert all(float(v) == 1.0 for k, v in got.items() if k.endswith(("k_scale", "v_scale")) and ".self_attn." in k)
    assert "- hf_ckpt FP8 KV scales: vLLM's mxfp4 config" in (out.parent / "report.md").read_text()
    assert [c["status"] for c in m["checks"] if c["check"].startswith("hf_ckpt re-measured")] == ["passed"]
    mem = load_model(ModelConfig(name="x", source="hf_dir", path=str(hf), device="cpu", dtype="float32", streaming=False), tmp_path / "cache")
    ours = Checkpoint(hf)
    for k, v in mem.model.named_parameters():
        torch.testing.assert_close(v.detach(), ours.read(k).float(), atol=0, rtol=0)
    p = run_cli("model=llama3_8b", f"model.path={ckpt}", "model.name=q", "model.device=cpu", "model.dtype=bfloat16", "calib=smoke", "eval=smoke",
                "export=none", "eval.tasks.names=[]", f"hydra.run.dir={tmp_path / 'bf16'}", cache_dir=tmp_path / "cache")
    assert p.returncode != 0 and "try model.dtype=float32" in p.stderr and "Traceback" not in p.stderr


def _block_fp8(v: torch.Tensor, b: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight whose sides are multiples of b as block-scaled float8 e4m3: (codes, scale_inv [rows / b, cols / b])."""
    s = v.reshape(v.shape[0] // b, b, v.shape[1] // b, b).abs().amax((1, 3)) / 448.0
    return (v / s.repeat_interleave(b, 0).repeat_interleave(b, 1)).to(torch.float8_e4m3fn), s


def test_a_block_fp8_qwen3_moe_keeps_its_experts_and_its_qk_projections(tmp_path):
    """Qwen3-MoE FP8 (per-expert block-scaled weights, which transformers fuses into one tensor per layer on loading; q/k norms
    before RoPE): the export writes the experts back under their stored names as stored, and q/k_proj stay FP8 too (the key
    factors live in the norms), only v/o_proj in export.dtype; the re-measurement passed."""
    from transformers import AutoModelForCausalLM

    from kvcompress.models.synthetic import byte_tokenizer
    from kvcompress.models.tiny import tiny_hf_config

    cfg = tiny_hf_config("qwen3_moe", 2, 64, 4, 2, 32, 4096)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(0)
    ckpt = tmp_path / "qwen3_moe"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(ckpt))
    byte_tokenizer().save_pretrained(str(ckpt))
    sd, new = load_file(str(ckpt / "model.safetensors")), {}
    for k, v in sd.items():
        if k.endswith("proj.weight") and v.dim() == 2:
            new[k], new[k + "_scale_inv"] = _block_fp8(v)
        else:
            new[k] = v
    save_file(new, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    c = json.loads((ckpt / "config.json").read_text())
    c["quantization_config"] = BLOCK_FP8 | {"weight_block_size": [32, 32]}
    (ckpt / "config.json").write_text(json.dumps(c))
    out = _export(tmp_path, ckpt, "run")
    got = _tensors(out / "hf_ckpt")
    fp8 = {k for k, v in new.items() if v.dtype == torch.float8_e4m3fn}
    kept = {k for k in fp8 if not k.endswith(("v_proj.weight", "o_proj.weight"))}
    assert any(".experts.3.down_proj" in k for k in kept) and "model.layers.1.self_attn.k_proj.weight" in kept
    assert all(torch.equal(got[k].view(torch.uint8), new[k].view(torch.uint8)) and torch.equal(got[k + "_scale_inv"], new[k + "_scale_inv"]) for k in kept)
    assert all(got[k].dtype == torch.bfloat16 and k + "_scale_inv" not in got for k in fp8 - kept)
    listed = json.loads((out / "hf_ckpt" / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert sorted(listed) == sorted(k.removesuffix(".weight") for k in fp8 - kept)
    m = json.loads((out / "manifest.json").read_text())
    assert all(c["status"] == "passed" for c in m["checks"]), m["checks"]


def test_a_multimodal_fp8_source_lists_its_unconverted_modules_under_the_text_names(tmp_path):
    """An FP8 Gemma3ForConditionalGeneration (decoder under a wrapper's prefix, one MLP left unquantized and named in
    modules_to_not_convert as the wrapper names it): the text-only export keeps the FP8 weights and names that module as
    the text model does, so a server does not expect FP8 where bfloat16 is stored; the re-measurement passed."""
    from test_multimodal import gemma3_dir

    d = gemma3_dir(tmp_path)
    f = next(d.glob("*.safetensors"))
    sd, new = load_file(str(f)), {}
    prefix = next(p for p in ("model.language_model.", "language_model.model.") if any(k.startswith(p) for k in sd))  # as transformers saves it
    plain = prefix + "layers.0.mlp.down_proj"
    for k, v in sd.items():
        if k.startswith(prefix) and k.endswith("proj.weight") and not k.startswith(plain):
            new[k], new[k + "_scale_inv"] = _block_fp8(v)
        else:
            new[k] = v
    save_file(new, str(f), metadata={"format": "pt"})
    c = json.loads((d / "config.json").read_text())
    c["quantization_config"] = BLOCK_FP8 | {"weight_block_size": [32, 32], "modules_to_not_convert": [plain, "re:.*vision_tower.*"]}
    (d / "config.json").write_text(json.dumps(c))
    out = _export(tmp_path, d, "run")
    got = _tensors(out / "hf_ckpt")
    assert got["model.layers.1.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn and got["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    listed = json.loads((out / "hf_ckpt" / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.0.mlp.down_proj" in listed and "model.layers.0.self_attn.v_proj" in listed and "model.layers.0.self_attn.k_proj" not in listed
    assert all(c["status"] == "passed" for c in json.loads((out / "manifest.json").read_text())["checks"])


MLP_TRT = (("gate_proj", "fc", 0), ("up_proj", "gate", 0), ("down_proj", "proj", 1))


@pytest.mark.parametrize("qcfg,block,input_scale,algo,preset", [
    (MODELOPT, None, True, "FP8", "FP8_DEFAULT_CFG"),  # one weight scale per tensor, static input scales
    (CT_FP8, "row", False, "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PER_CHANNEL_PER_TOKEN_CFG"),  # llm-compressor FP8-dynamic: per row, per token
    (FBGEMM, "row", False, "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PER_CHANNEL_PER_TOKEN_CFG"),  # Meta's Llama 3.1 405B FP8
])
def test_an_fp8_source_keeps_its_fp8_mlp_in_the_tensorrt_llm_checkpoint(tmp_path, qcfg, block, input_scale, algo, preset):
    """trtllm_ckpt/ holds the source's float8 MLP weights byte for byte at tp 1 and split at tp 2; per-tensor scales with static
    input scales become weights_scaling_factor / activation_scaling_factor (quant_algo FP8), per-row scales per_channel_scale
    (FP8_PER_CHANNEL_PER_TOKEN); the folded attention is in exclude_modules: the layout Model Optimizer's own exporter writes for
    the same model (names, float8/fp32 dtypes, shapes, quantization block). The re-measurement (the reader dequantizing them) passed."""
    from kvcompress.targets.trtllm_reader import TrtllmAsHF

    ckpt, _ = _quantized_dir(tmp_path, qcfg, block, scale_suffix="_scale", input_scale=input_scale)
    src = load_file(str(ckpt / "model.safetensors"))
    out = _export(tmp_path, ckpt, "run", "export.tp_sizes=[1,2]")
    r1 = load_file(str(out / "trtllm_ckpt" / "tp1" / "rank0.safetensors"))
    r2 = [load_file(str(out / "trtllm_ckpt" / "tp2" / f"rank{r}.safetensors")) for r in range(2)]
    for i in range(2):
        for hf, t, dim in MLP_TRT:
            k, n = f"model.layers.{i}.mlp.{hf}.", f"transformer.layers.{i}.mlp.{t}."
            assert r1[n + "weight"].dtype == torch.float8_e4m3fn and torch.equal(r1[n + "weight"].view(torch.uint8), src[k + "weight"].view(torch.uint8))
            both = torch.cat([r[n + "weight"].view(torch.uint8) for r in r2], dim=dim)
            assert torch.equal(both, src[k + "weight"].view(torch.uint8))
            if algo == "FP8":
                for r in (r1, *r2):
                    assert torch.equal(r[n + "weights_scaling_factor"], src[k + "weight_scale"].float().reshape(1))
                    assert torch.equal(r[n + "activation_scaling_factor"], src[k + "input_scale"].float().reshape(1))
            else:
                assert torch.equal(r1[n + "per_channel_scale"], src[k + "weight_scale"].float().reshape(-1))
                parts = [r[n + "per_channel_scale"] for r in r2]
                assert torch.equal(torch.cat(parts) if dim == 0 else parts[0], r1[n + "per_channel_scale"]) and (dim == 0 or torch.equal(*parts))
        assert r1[f"transformer.layers.{i}.attention.qkv.weight"].dtype == torch.bfloat16
        keys = [f"model.layers.{i}.mlp.{hf}.weight" for hf, _, _ in MLP_TRT]
        for tp in (1, 2):  # the re-measurement's reader: the values the source's bytes and scales define, at either tp
            got = TrtllmAsHF(out / "trtllm_ckpt" / f"tp{tp}").load(keys, torch.float32, "cpu")
            assert all(torch.equal(got[k], Checkpoint(ckpt).read(k)) for k in keys)
    q = json.loads((out / "trtllm_ckpt" / "tp1" / "config.json").read_text())["quantization"]
    # per token: TensorRT-LLM's fp8_rowwise_quantize turns every norm it does not exclude into a quantizing norm; the input norms feed the
    # unquantized attention (its Meta recipe excludes '*input_layernorm' with '*attention')
    norms = ["transformer.layers.0.input_layernorm", "transformer.layers.1.input_layernorm"] if algo != "FP8" else []
    assert q["quant_algo"] == algo and q["exclude_modules"] == ["transformer.layers.0.attention*", "transformer.layers.1.attention*", *norms, "lm_head"]
    # Meta's activation_scale_ub as TensorRT-LLM's clamp_val (its Llama converter's update_quant_config_from_hf does the same)
    assert q.get("clamp_val") == ([-1200.0, 1200.0] if qcfg is FBGEMM else None)
    mo_q, mo = modelopt_trtllm_layout(ckpt, tmp_path / "modelopt", preset)
    ours = {k: (tensor_kind(v), tuple(v.shape)) for k, v in r1.items()}
    extra = {k for k in mo if k.endswith((".k_cache_scaling_factor", ".v_cache_scaling_factor"))}  # ModelOpt's per-K/V copies of the KV scale
    assert ours == {k: v for k, v in mo.items() if k not in extra}
    assert (mo_q["quant_algo"], sorted(mo_q["exclude_modules"] + norms)) == (q["quant_algo"], sorted(q["exclude_modules"]))
    m = json.loads((out / "manifest.json").read_text())
    art = m["artifacts"]["trtllm_ckpt"]
    assert art["fp8_weights_kept"] is True and f"quant_algo {algo}: 6 float8 e4m3 weights" in art["weights"]
    assert [c["status"] for c in m["checks"] if c["check"].startswith("trtllm_ckpt/tp1 re-measured")] == ["passed"]
    assert [c["status"] for c in m["checks"] if c["check"].startswith("trtllm_ckpt/tp2 shards merge")] == ["passed"]
    assert "- trtllm_ckpt weights: the source's FP8 MLP weights kept as stored" in (out.parent / "report.md").read_text()
    # both checkpoints keep the FP8 weights, and their servers quantize the MLP's inputs to FP8, which validate ran unquantized
    to = "FP8 at the stored static input_scale" if algo == "FP8" else "FP8 per token at run time"
    for name in ("trtllm_ckpt", "hf_ckpt"):
        assert f"also quantizes its input to {to}" in m["artifacts"][name]["served_otherwise"], name
        assert f"- **{name} activations**: served as" in (out.parent / "report.md").read_text()
        # an fbgemm_fp8 source is written under the names each server reads, and the caveat says so (not "served as fbgemm_fp8")
        assert ("served as per-channel FP8 (the fbgemm_fp8 source as trtllm_ckpt's quant_algo FP8_PER_CHANNEL_PER_TOKEN and hf_ckpt's "
                "compressed-tensors FP8)" in m["artifacts"][name]["served_otherwise"]) == (qcfg is FBGEMM), name


def test_fp8_sources_tensorrt_llm_cannot_take_as_stored_are_dequantized_and_say_why(tmp_path):
    """Block scales (DeepSeek / Qwen3 FP8): trtllm_ckpt/ holds export.dtype weights and the manifest and report say why; per-tensor
    scales without input scales go per token; the writer copies a kept weight only if it still defines the validated value."""
    from transformers import AutoConfig

    from kvcompress.models.base import Geometry
    from kvcompress.targets.trtllm_ckpt import fp8_mlp

    ckpt, _ = _quantized_dir(tmp_path, BLOCK_FP8 | {"weight_block_size": [32, 32]}, (32, 32))
    out = _export(tmp_path, ckpt, "run")
    r1 = load_file(str(out / "trtllm_ckpt" / "tp1" / "rank0.safetensors"))
    assert not any(v.dtype == torch.float8_e4m3fn for v in r1.values())
    art = json.loads((out / "manifest.json").read_text())["artifacts"]["trtllm_ckpt"]
    assert art["fp8_weights_kept"] is False and "block scales" in art["fp8_dequantized_why"]
    assert "- trtllm_ckpt weights: bfloat16: the source's FP8 weights dequantized, because" in (out.parent / "report.md").read_text()
    pt, _ = _quantized_dir(tmp_path, MODELOPT, None, name="pt", scale_suffix="_scale")  # per tensor, no input scales
    hf_cfg = AutoConfig.from_pretrained(str(pt))
    assert fp8_mlp(Checkpoint(pt), Geometry.from_hf_config(hf_cfg), hf_cfg) == ("FP8_PER_CHANNEL_PER_TOKEN", "", [0, 1])
    ok, _ = _quantized_dir(tmp_path, MODELOPT, None, name="ok", scale_suffix="_scale", input_scale=True)
    c = Checkpoint(ok)
    state = {k: c.read(k) for k in c.entries if not k.endswith(("_scale", "input_scale"))}
    assert fp8_mlp(c, Geometry.from_hf_config(hf_cfg), hf_cfg) == ("FP8", "", [0, 1])
    trtllm_writer_refuses_changed_weights(c, state, hf_cfg, tmp_path / "w", "bfloat16", "FP8")


def test_the_export_reads_each_stored_fp8_weight_once(tmp_path, monkeypatch):
    """The export of an FP8 source to trtllm_ckpt/ at two tp sizes and hf_ckpt/ reads each stored tensor of a layer from disk
    once (Checkpoint.remember): once for the folded state and for every copy (before: once per writer, plus once)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from conftest import ROOT
    from kvcompress.config import to_run_config
    from kvcompress.pipeline import run
    from kvcompress.stages import export as export_stage

    ckpt, _ = _quantized_dir(tmp_path, MODELOPT, None, scale_suffix="_scale", input_scale=True)
    reads: dict[str, int] = {}
    real_read, real_write = Checkpoint._read_stored, export_stage.write_native_checkpoints

    def counting(self, key, lo, hi):
        reads[key] = reads.get(key, 0) + 1
        return real_read(self, key, lo, hi)

    def write(*a, **kw):  # count the export's reads only (profile and validate stream the layers many times)
        monkeypatch.setattr(Checkpoint, "_read_stored", counting)
        try:
            return real_write(*a, **kw)
        finally:
            monkeypatch.setattr(Checkpoint, "_read_stored", real_read)

    monkeypatch.setattr(export_stage, "write_native_checkpoints", write)
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["model=llama3_8b", f"model.path={ckpt}", "model.name=q", "model.device=cpu", "calib=smoke", "eval=smoke",
                                           "kv=native_fp8", "eval.tasks.names=[]", "export.dtype=bfloat16", "export.tp_sizes=[1,2]",
                                           f"cache_dir={tmp_path / 'cache'}"])
    run(to_run_config(OmegaConf.to_container(cfg, resolve=True)), tmp_path / "r", progress=False)
    mlp = {k: n for k, n in reads.items() if ".mlp." in k}
    assert len(mlp) == 2 * 3 * 3 and set(mlp.values()) == {1}, mlp  # 2 layers x gate/up/down x weight, weight_scale, input_scale
    assert (tmp_path / "r" / "export" / "trtllm_ckpt" / "tp2" / "rank1.safetensors").is_file()


def test_a_kv_scale_absorbed_into_the_fold_caches_what_scale_s_cached():
    """fold.absorb_kv_scale: folding each layer's FP8 KV scale s into the fold factors and quantizing at 1.0 gives the values
    the validated native_fp8 (fold, scale s) gives, to FP8's rounding of one float32 division in a million; scale 1.0
    without the absorption does not (subnormals)."""
    from kvcompress import reference as ref
    from kvcompress.fold import absorb_kv_scale

    g = torch.Generator().manual_seed(0)
    L, H, T, D = 3, 2, 64, 32
    x = torch.randn(L, H, T, D, generator=g) * torch.rand(1, H, 1, D, generator=g) * 0.01  # small: below FP8's normal range at scale 1.0
    sigma, tau = 0.5 + 0.5 * torch.rand(L, H, D, generator=g), 0.5 + 0.5 * torch.rand(L, H, D, generator=g)
    scale = x.abs().amax((1, 2, 3)) / sigma.amin((1, 2)) / 448.0
    sk, sv = absorb_kv_scale(sigma, tau, scale)
    for side, f, fa in (("keys", sigma, sk), ("values", tau, sv)):
        for i in range(L):
            want = ref.native_folded_quant(x[i], f[i].unsqueeze(-2), float(scale[i]), "native_fp8")
            got = ref.native_folded_quant(x[i], fa[i].unsqueeze(-2), 1.0, "native_fp8")
            flips = (got - want).abs() > 1e-5 * want.abs()  # else: the same FP8 code, products rounded in another order
            assert flips.float().mean() < 1e-3, side
            torch.testing.assert_close(got, want, rtol=0.07, atol=0)  # a flip moves one FP8 step (1/8 relative at most)
            plain = ref.native_folded_quant(x[i], f[i].unsqueeze(-2), 1.0, "native_fp8")
            assert (plain - x[i]).pow(2).mean() > 4 * (got - x[i]).pow(2).mean()


def test_kv_scales_a_server_would_not_read_are_flagged_where_a_fold_obstacle_keeps_them_out_of_the_fold(tmp_path, monkeypatch):
    """GPT-OSS with a (pretended) fold obstacle on its keys: the KV scale cannot move into the fold, so the stored scales stay
    the validated ones and the manifest, its next step and report.md say that vLLM's mxfp4 config would not read them."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from conftest import ROOT
    from kvcompress.config import to_run_config
    from kvcompress.pipeline import run
    from kvcompress.stages import export as export_stage

    ckpt, _ = _gpt_oss_dir(tmp_path)
    real = export_stage.write_native_checkpoints

    def blocked(lm, geom, trt_book, hf_book, *a, **kw):
        import dataclasses

        return real(lm, geom, trt_book, dataclasses.replace(hf_book, fit_info={**hf_book.fit_info, "fold_keys_off": "a test's obstacle"}), *a, **kw)

    monkeypatch.setattr(export_stage, "write_native_checkpoints", blocked)
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["model=llama3_8b", f"model.path={ckpt}", "model.name=q", "model.device=cpu", "model.dtype=float32",
                                           "calib=smoke", "eval=smoke", "kv=native_fp8", "eval.tasks.names=[]", "export.dtype=bfloat16",
                                           f"cache_dir={tmp_path / 'cache'}"])
    run(to_run_config(OmegaConf.to_container(cfg, resolve=True)), tmp_path / "r", progress=False)
    m = json.loads((tmp_path / "r" / "export" / "manifest.json").read_text())
    art = m["artifacts"]["hf_ckpt"]
    assert "reads no k_scale / v_scale" in art["kv_scales_unread"] and "kv_scale_absorbed" not in art
    assert m["next_step_on_gpu_host"].startswith("python export/check_hf_ckpt.py")
    assert "- **hf_ckpt FP8 KV scales**: vLLM's mxfp4 config" in (tmp_path / "r" / "report.md").read_text()
    got = _tensors(tmp_path / "r" / "export" / "hf_ckpt")
    assert any(float(v) != 1.0 for k, v in got.items() if k.endswith("k_proj.k_scale"))


def test_an_fp8_source_with_unquantized_mlps_keeps_the_others_fp8_in_the_tensorrt_llm_checkpoint(tmp_path):
    """Meta's FP8 Llama 3.1 405B keeps the first and last layers' MLPs unquantized (modules_to_not_convert): trtllm_ckpt/ writes
    those in export.dtype and excludes them (with the norm that feeds them, for FP8_PER_CHANNEL_PER_TOKEN), the other layers' MLPs
    FP8 as stored; re-measured as validated, and the reader's values are the source's."""
    from kvcompress.targets.trtllm_reader import TrtllmAsHF

    ckpt, _ = _quantized_dir(tmp_path, FBGEMM | {"modules_to_not_convert": ["lm_head", "model.layers.0.mlp"]}, "row", scale_suffix="_scale")
    sd = load_file(str(ckpt / "model.safetensors"))
    c = Checkpoint(ckpt)
    for hf in ("gate_proj", "up_proj", "down_proj"):  # layer 0's MLP stored unquantized (bfloat16, no scale)
        k = f"model.layers.0.mlp.{hf}.weight"
        sd[k] = c.read(k).to(torch.bfloat16)
        del sd[k + "_scale"]
    save_file(sd, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    out = _export(tmp_path, ckpt, "run")
    r1 = load_file(str(out / "trtllm_ckpt" / "tp1" / "rank0.safetensors"))
    assert r1["transformer.layers.0.mlp.fc.weight"].dtype == torch.bfloat16 and "transformer.layers.0.mlp.fc.per_channel_scale" not in r1
    assert r1["transformer.layers.1.mlp.fc.weight"].dtype == torch.float8_e4m3fn and "transformer.layers.1.mlp.fc.per_channel_scale" in r1
    q = json.loads((out / "trtllm_ckpt" / "tp1" / "config.json").read_text())["quantization"]
    assert q["quant_algo"] == "FP8_PER_CHANNEL_PER_TOKEN"
    assert {"transformer.layers.0.mlp*", "transformer.layers.0.post_layernorm"} <= set(q["exclude_modules"])
    assert not any(e.startswith(("transformer.layers.1.mlp", "transformer.layers.1.post")) for e in q["exclude_modules"])
    keys = [f"model.layers.{i}.mlp.{hf}.weight" for i in (0, 1) for hf in ("gate_proj", "up_proj", "down_proj")]
    got = TrtllmAsHF(out / "trtllm_ckpt" / "tp1").load(keys, torch.float32, "cpu")
    assert all(torch.equal(got[k], Checkpoint(ckpt).read(k).float()) for k in keys)
    ignore = json.loads((out / "hf_ckpt" / "config.json").read_text())["quantization_config"]["ignore"]
    pat = next(e for e in ignore if e.startswith("re:") and "layers" in e)[3:]  # compressed-tensors matches exact names or "re:" patterns
    assert re.match(pat, "model.layers.0.mlp.gate_proj") and not re.match(pat, "model.layers.1.mlp.gate_proj")
    m = json.loads((out / "manifest.json").read_text())
    assert "3 float8 e4m3 weights" in m["artifacts"]["trtllm_ckpt"]["weights"] and "the MLPs the source keeps unquantized" in m["artifacts"]["trtllm_ckpt"]["weights"]
    assert all(c["status"] == "passed" for c in m["checks"]), m["checks"]
