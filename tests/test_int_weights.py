"""Integer weight-only checkpoints (compressed-tensors' pack-quantized format, llm-compressor's W4A16 / W8A16 models):
read dequantized by kvcompress's own reader (kvcompress/models/int_weights.py), checked here against the compressed-tensors
library's own compressor and decompressor (the format's reference), and against transformers loading the same directory."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import bundle_loader, loader_reads_as, plain_copy, quantized_tiny_dir, refuses_weight_configs, run_cli, tiny_llama_dir
from kvcompress.errors import UserError
from kvcompress.models import int_weights as iw
from kvcompress.models.quantized import weight_quantization
from kvcompress.models.checkpoint import Checkpoint

import compressed_tensors  # noqa: E402,F401  (the dev extra: the format's reference; the reader itself needs no library)


def _scheme(bits: int, strategy: str, group: int | None, symmetric: bool):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group))


def _compress(w: torch.Tensor, scheme, dtype=torch.bfloat16) -> tuple[dict, torch.Tensor]:
    """The library's packed tensors of w (min-max scales per group / row), and the weight its decompressor gives back."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor as PQ

    a = scheme.weights
    g = w.shape[1] // (a.group_size or w.shape[1])
    wg = w.float().reshape(w.shape[0], g, -1)
    qmax = 2 ** (a.num_bits - 1) - 1
    if a.symmetric:
        sd = {"weight_scale": (wg.abs().amax(-1) / qmax).clamp_min(1e-6).to(dtype)}
    else:
        lo, hi = wg.amin(-1), wg.amax(-1)
        s = ((hi - lo) / (2 ** a.num_bits - 1)).clamp_min(1e-6).to(dtype)
        sd = {"weight_scale": s, "weight_zero_point": (-(qmax + 1) - torch.round(lo / s.float())).clamp(-(qmax + 1), qmax).to(torch.int8)}
    packed = PQ.compress({"weight": w.to(dtype), **sd}, scheme)
    return packed, PQ.decompress(dict(packed), scheme)["weight"].float()


def _int_dir(tmp_path: Path, bits=4, strategy="group", group=32, symmetric=True, name="w4a16") -> tuple[Path, dict]:
    """A tiny Llama saved as an HF directory whose q/k/v/o and MLP weights are pack-quantized by the compressed-tensors
    library (lm_head and embeddings as they are), with the quantization_config llm-compressor writes. Returns the
    directory and the float32 weights the library's decompressor gives for it."""
    scheme = _scheme(bits, strategy, group, symmetric)

    def quantize(k, v):
        packed, w = _compress(v, scheme)
        return {k.removesuffix("weight") + p: t.contiguous() for p, t in packed.items()}, w

    return quantized_tiny_dir(tmp_path / name, quantize, {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme.weights.model_dump(mode="json"), "input_activations": None,
                                      "output_activations": None, "format": "pack-quantized"}},
        "ignore": ["lm_head"]})


@pytest.mark.parametrize("bits,strategy,group,symmetric,dtype", [
    (4, "group", 32, True, torch.bfloat16), (4, "group", 16, False, torch.float16), (8, "channel", None, True, torch.bfloat16),
    (8, "group", 16, False, torch.float32), (3, "group", 16, True, torch.float16)])  # 3 bits: codes straddle words
def test_dequantize_is_the_librarys_decompression(bits, strategy, group, symmetric, dtype):
    torch.manual_seed(0)
    w = torch.randn(40, 96)
    packed, ref = _compress(w, _scheme(bits, strategy, group, symmetric), dtype)
    got = iw.dequantize(packed["weight_packed"], packed["weight_scale"], packed["weight_shape"], packed.get("weight_zero_point"))
    assert torch.equal(got, ref)
    assert torch.equal(iw.dequantize(packed["weight_packed"], packed["weight_scale"], packed["weight_shape"], packed.get("weight_zero_point"),
                                     lo=7, hi=29), ref[7:29])
    assert float((got - w).abs().max()) < 0.2 * float(w.abs().max())  # and it is the weight, quantized


def test_activation_ordered_groups_read_their_own_scale():
    """weight_g_idx (GPTQ's activation order: column j belongs to group g_idx[j]) reads, for each column, its group's scale
    and zero point: the same weight as its columns stored in group order without one. Negative: ignoring g_idx differs."""
    torch.manual_seed(1)
    w = torch.randn(24, 64)
    perm = torch.randperm(64)
    packed, ref = _compress(w[:, perm], _scheme(4, "group", 16, False))  # groups of 16 consecutive permuted columns
    inv = torch.argsort(perm)
    codes = iw.unpack(packed["weight_packed"], 4, 64)[:, inv] + 8  # the codes back in the columns' own order, offset-binary
    words = (codes.to(torch.int64).reshape(24, 8, 8) << (4 * torch.arange(8))).sum(-1)
    repacked = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    g_idx = (torch.arange(64) // 16)[inv].to(torch.int32)
    got = iw.dequantize(repacked, packed["weight_scale"], packed["weight_shape"], packed["weight_zero_point"], g_idx)
    assert torch.equal(got, ref[:, inv])
    assert not torch.equal(iw.dequantize(repacked, packed["weight_scale"], packed["weight_shape"], packed["weight_zero_point"]), ref[:, inv])


def test_an_int4_checkpoint_is_read_dequantized_as_transformers_loads_it(tmp_path):
    """The streaming reader's weights are the library's decompression (asymmetric and symmetric), and, for the symmetric
    checkpoint, what transformers (with compressed-tensors) loads from the same directory (transformers 5.25 with
    compressed-tensors 0.20 refuses the asymmetric one's packed zero points: a size mismatch of its own)."""
    from transformers import AutoModelForCausalLM

    for sym in (False, True):
        ckpt, expect = _int_dir(tmp_path, 4, "group", 32, sym, name=f"w4a16_{sym}")
        assert weight_quantization(ckpt) == "int"
        c = Checkpoint(ckpt)
        for k, w in expect.items():
            assert k in c and c.shape(k) == list(w.shape)
            assert torch.equal(c.read(k), w)
            assert torch.equal(c.read(k, 5, 17), w[5:17])
    from transformers import CompressedTensorsConfig

    ref = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False)).state_dict()
    for k, w in expect.items():
        assert torch.equal(ref[k].float(), w), k


def _plain_copy(tmp_path: Path, ckpt: Path, expect: dict) -> Path:
    """The same model written unquantized: the int checkpoint's dequantized weights as plain tensors, no quantization_config."""
    sd = {k: v for k, v in load_file(str(ckpt / "model.safetensors")).items() if not iw.is_part(k) and not iw.is_qweight_part(k)}
    return plain_copy(ckpt, tmp_path / "plain", {**sd, **expect})


def _run(tmp_path, path, name, *extra):
    p = run_cli("model=llama3_8b", f"model.path={path}", "model.name=q", "model.device=cpu", "model.dtype=float32", "calib=smoke", "eval=smoke",
                "eval.tasks.names=[]", *extra, f"hydra.run.dir={tmp_path / name}", cache_dir=tmp_path / "cache")
    return p, tmp_path / name


def test_an_int4_checkpoint_runs_streamed_as_its_dequantized_model(tmp_path):
    """End to end, streamed: the run's perplexity and KL are those of the same weights written unquantized and loaded in
    memory; model.streaming=false is one line (the reader dequantizes layer by layer)."""
    ckpt, expect = _int_dir(tmp_path)
    p, r = _run(tmp_path, ckpt, "run_int", "export=none")
    assert p.returncode == 0, p.stderr[-3000:]
    p2, r2 = _run(tmp_path, _plain_copy(tmp_path, ckpt, expect), "run_plain", "export=none", "model.streaming=false")
    assert p2.returncode == 0, p2.stderr[-3000:]
    a, b = (json.loads((d / "report.json").read_text()) for d in (r, r2))
    assert a["model"].get("streamed") and not b["model"].get("streamed")
    assert a["quality"]["ppl_baseline"] == pytest.approx(b["quality"]["ppl_baseline"], rel=1e-6)
    assert a["quality"]["kl_mean"] == pytest.approx(b["quality"]["kl_mean"], rel=1e-3)
    p3, r3 = _run(tmp_path, ckpt, "forced", "export=none", "model.streaming=false")
    assert p3.returncode != 0 and "stores integer-quantized weights" in p3.stderr and "Traceback" not in p3.stderr and not r3.exists()


def test_an_int4_checkpoint_exports_its_integer_weights_as_stored(tmp_path):
    """The export of a W4A16 source (the default kv: the custom tier, and the native tier's checkpoints): hf_ckpt/ keeps the
    source's pack-quantized weights the fold leaves alone (the MLP) byte for byte, writes the attention projections the
    fold changes in export.dtype and lists them in the compressed-tensors config's ignore list, beside the FP8 KV-cache
    scheme; transformers (with compressed-tensors) loads it to the weights the export validated. The TensorRT-LLM checkpoint
    gets them dequantized (source_int_weights says which); every check that runs passes (the network graph's CPU check is
    skipped for a streamed model, as for FP8 sources); the bundle ships int_weights.py for the engine builder."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    ckpt, expect = _int_dir(tmp_path)
    p, run = _run(tmp_path, ckpt, "run")
    assert p.returncode == 0, p.stderr[-3000:]
    manifest = json.loads((run / "export" / "manifest.json").read_text())
    assert all(c["status"] in ("passed", "skipped") for c in manifest["checks"]), manifest["checks"]
    assert [c["check"] for c in manifest["checks"] if c["status"] == "skipped"] == [
        "custom-tier network graph (CPU oracle, reference plugins) decodes like CompressedCache"]
    src = load_file(str(ckpt / "model.safetensors"))
    hf = {k: v for f in sorted((run / "export" / "hf_ckpt").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    for part in ("weight_packed", "weight_scale", "weight_shape"):
        assert torch.equal(hf[f"model.layers.1.mlp.down_proj.{part}"], src[f"model.layers.1.mlp.down_proj.{part}"])
    assert "model.layers.0.self_attn.q_proj.weight" in hf and "model.layers.0.self_attn.q_proj.weight_packed" not in hf
    q = json.loads((run / "export" / "hf_ckpt" / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "pack-quantized" and q["kv_cache_scheme"]["type"] == "float"
    assert {f"model.layers.{i}.self_attn.{n}_proj" for i in range(2) for n in "qkvo"} <= set(q["ignore"]) and "lm_head" in q["ignore"]
    art = manifest["artifacts"]
    assert art["hf_ckpt"]["fp8_weights_kept"] and "kept as stored" in art["hf_ckpt"]["source_int_weights"]
    assert "written dequantized" in art["trtllm_ckpt"]["source_int_weights"]
    loaded = AutoModelForCausalLM.from_pretrained(str(run / "export" / "hf_ckpt"), dtype=torch.float32,
                                                  quantization_config=CompressedTensorsConfig(run_compressed=False)).state_dict()
    assert torch.equal(loaded["model.layers.1.mlp.down_proj.weight"], expect["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(loaded["model.layers.0.self_attn.q_proj.weight"], hf["model.layers.0.self_attn.q_proj.weight"].float())
    assert (run / "export" / "plugin_bundle" / "int_weights.py").is_file()
    p, run2 = _run(tmp_path, ckpt, "run_deq", "export.fp8_weights=dequantize", "kv=native_int8")  # the native tier alone: no kernels
    assert p.returncode == 0, p.stderr[-3000:]
    hf2 = {k for f in sorted((run2 / "export" / "hf_ckpt").glob("*.safetensors")) for k in load_file(str(f))}
    assert not any(iw.is_part(k) for k in hf2) and "written dequantized" in json.loads((run2 / "export" / "manifest.json").read_text())["artifacts"]["hf_ckpt"]["source_int_weights"]


def test_the_custom_tier_weight_loader_dequantizes_packed_weights_as_the_bundle_ships_it(tmp_path):
    """build_engine.py --tier custom reads the model's own HF directory (network_weights.load_hf_weights): pack-quantized
    weights come out as the library's decompression, their parts dropped, and engine_memory counts them as the fp16
    weights the loader makes; in the bundle, without kvcompress installed, through the int_weights.py copied beside
    trtllm_network.py."""

    from kvcompress.targets.network_weights import dequantize_packed
    from kvcompress.targets.trtllm_network import engine_memory

    ckpt, expect = _int_dir(tmp_path, 4, "group", 32, False)
    raw = load_file(str(ckpt / "model.safetensors"))
    out = dequantize_packed(raw, ckpt)
    assert set(out) == {k for k in raw if not iw.is_part(k)} | set(expect)
    for k, w in expect.items():
        assert torch.equal(out[k], w)
    spec = {"variant": {"n_sink": 0, "window": 0, "key_bits": 8, "value_bits": 4, "group": 16, "n_out": 0},
            "arch": {"n_layers": 0, "n_kv_heads": 1, "head_dim": 64}}
    assert engine_memory(spec, ckpt, 1, 8)["weights_bytes"] == 2 * sum(t.numel() for t in out.values())
    assert bundle_loader(tmp_path, ["models/fp8_weights.py", "models/int_weights.py"], ckpt, "dequantize_packed",
                         "model.layers.0.self_attn.k_proj.weight") == float(expect["model.layers.0.self_attn.k_proj.weight"].double().sum())


def test_integer_formats_it_does_not_read_are_one_line(tmp_path):
    """Packed integer weights with quantized activations (pack-quantized W8A8 is not what llm-compressor writes) and
    int-quantized codes of other widths are refused in one line before anything loads."""
    ckpt, _ = _int_dir(tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    for change, what in ((lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}), "W8A8"),
                         (lambda q: (q.update(format="int-quantized"), q["config_groups"]["group_0"].update(format="int-quantized")), "int-quantized")):
        q = json.loads(json.dumps(cfg["quantization_config"]))
        change(q)
        (ckpt / "config.json").write_text(json.dumps(cfg | {"quantization_config": q}))
        with pytest.raises(UserError) as e:
            weight_quantization(ckpt)
        assert "'compressed-tensors'" in str(e.value) and "point it at the unquantized checkpoint" in str(e.value) and "\n" not in str(e.value), what


# ------------------------------------------------------------------------------- compressed-tensors int-quantized (W8A8)
# llm-compressor's W8A8 int8 exports: int8 codes unpacked under the weight's name beside weight_scale (weight_zero_point if
# asymmetric); the reference is the library's own IntQuantizationCompressor.

def _int8_compress(w: torch.Tensor, scheme) -> tuple[dict, torch.Tensor]:
    """The library's int-quantized tensors of w (min-max scales per row or group, bf16) and its decompression (float32)."""
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor as IQ

    a = scheme.weights
    wg = w.float().reshape(w.shape[0], w.shape[1] // (a.group_size or w.shape[1]), -1)
    if a.symmetric:
        sd = {"weight_scale": (wg.abs().amax(-1) / 127).clamp_min(1e-6).to(torch.bfloat16)}
    else:
        lo, hi = wg.amin(-1), wg.amax(-1)
        sc = ((hi - lo) / 255).clamp_min(1e-6).to(torch.bfloat16)
        sd = {"weight_scale": sc, "weight_zero_point": (-128 - torch.round(lo / sc.float())).clamp(-128, 127).to(torch.int8)}
    c = IQ.compress({"weight": w.to(torch.bfloat16), **sd}, scheme)
    return c, IQ.decompress(dict(c), scheme)["weight"].float()


def _w8a8_dir(tmp_path: Path, scheme=None, name="w8a8", static_inputs: bool = False) -> tuple[Path, dict]:
    """A tiny Llama whose q/k/v/o and MLP weights are int-quantized by the compressed-tensors library (the W8A8 preset unless
    `scheme`; static_inputs: its activations per tensor with a stored input_scale), config.json's quantization_config the
    library's own QuantizationConfig; and the weights its decompressor gives."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, preset_name_to_scheme

    scheme = scheme or preset_name_to_scheme("W8A8", ["Linear"])
    if static_inputs:
        scheme = scheme.model_copy(update={"input_activations": QuantizationArgs(num_bits=8, type="int", strategy="tensor", dynamic=False)})

    def quantize(k, v):
        c, w = _int8_compress(v, scheme)
        extra = {"input_scale": torch.tensor([0.02], dtype=torch.bfloat16)} if static_inputs else {}
        return {k.removesuffix("weight") + n: t.contiguous() for n, t in (c | extra).items()}, w

    q = QuantizationConfig(config_groups={"group_0": scheme}, format="int-quantized", ignore=["lm_head"], quantization_status="compressed")
    return quantized_tiny_dir(tmp_path / name, quantize, q.model_dump(mode="json"))


def test_int_quantized_int8_weights_are_read_as_the_library_decompresses_them(tmp_path):
    """W8A8 (per-row scales) and an asymmetric per-group int8 weight-only config: the streaming reader (whole and rows) and
    the custom tier's loader (its whole dequantize chain, and as the bundle ships it) give the library's decompression bit
    for bit at [out, in], the scales and zero points dropped; the engine's memory counts the fp16 weights. int8 codes under
    other configs and int-quantized at other widths stay refused in one line."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    asym = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy="group", group_size=16))
    for scheme, name in ((None, "w8a8"), (asym, "w8a16_asym")):
        ckpt, expect = _w8a8_dir(tmp_path, scheme, name)
        assert weight_quantization(ckpt) == "int"
        c = Checkpoint(ckpt)
        assert set(c.int8) == set(expect) and not c.packed
        for k, w in expect.items():
            assert k in c and c.shape(k) == list(w.shape) and torch.equal(c.read(k), w) and torch.equal(c.read(k, 5, 17), w[5:17])
        (tmp_path / f"loader_{name}").mkdir()
        out = loader_reads_as(tmp_path / f"loader_{name}", ckpt, expect, ["models/fp8_weights.py", "models/int_weights.py"], "dequantize_packed")
        assert set(out) == {k for k in load_file(str(ckpt / "model.safetensors")) if not k.endswith(("weight_scale", "weight_zero_point"))}
    refuses_weight_configs(ckpt, [{"num_bits": 4}, {"strategy": "block"}])


def test_a_w8a8_checkpoint_runs_streamed_and_exports_its_int8_weights_as_stored(tmp_path):
    """End to end, streamed: the run's perplexity is that of the same weights written plain; hf_ckpt keeps the int8 codes and
    scales the fold leaves alone as stored, the source's config with the folded attention in `ignore` and the FP8
    kv_cache_scheme, and transformers with compressed-tensors loads it (decompressed) to the validated weights; trtllm_ckpt
    has them dequantized; hf_ckpt's note and the log carry the W8A8 caveat (its server quantizes the kept layers' inputs to
    int8 per token, which validate does not)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    ckpt, expect = _w8a8_dir(tmp_path, static_inputs=True)
    p, run = _run(tmp_path, ckpt, "run", "kv=native_int8")
    assert p.returncode == 0, p.stderr[-3000:]
    plain = plain_copy(ckpt, tmp_path / "plain", {k: v for k, v in load_file(str(ckpt / "model.safetensors")).items()
                                                  if k not in expect and not k.endswith(("weight_scale", "input_scale"))} | expect)
    p2, run2 = _run(tmp_path, plain, "run_plain", "kv=native_int8", "export=none", "model.streaming=false")
    assert p2.returncode == 0, p2.stderr[-3000:]
    a, b = (json.loads((d / "report.json").read_text()) for d in (run, run2))
    assert a["model"].get("streamed") and a["quality"]["ppl_baseline"] == pytest.approx(b["quality"]["ppl_baseline"], rel=1e-6)
    manifest = json.loads((run / "export" / "manifest.json").read_text())
    assert all(c["status"] in ("passed", "skipped") for c in manifest["checks"]), manifest["checks"]
    art = manifest["artifacts"]
    assert "int-quantized int8 codes" in art["hf_ckpt"]["source_int_weights"] and "written dequantized" in art["trtllm_ckpt"]["source_int_weights"]
    # hf_ckpt's server quantizes the kept layers' inputs (static int8 here), which validate did not; trtllm_ckpt serves as validated
    caveat = art["hf_ckpt"]["served_otherwise"]
    assert caveat.startswith("served as compressed-tensors W8A8 (input_activations)") and "int8 at the stored input_scale" in caveat
    assert "(as trtllm_ckpt serves them)" in caveat and "served_otherwise" not in art["trtllm_ckpt"]  # kv=native_int8: no custom tier
    assert caveat in (run / "__main__.log").read_text()
    # the reviewer's report and the run's summary say it loudly for hf_ckpt; the source-weights notes plainly
    md, page = (run / "report.md").read_text(), (run / "report.html").read_text()
    assert f"- **hf_ckpt activations**: {caveat}" in md and "- hf_ckpt source weights: the source's compressed-tensors integer weights kept as stored" in md
    assert "- trtllm_ckpt source weights: the source's integer weights are written dequantized" in md and "trtllm_ckpt activations" not in md
    assert "<li><b>hf_ckpt activations</b>: " in page and "<li>trtllm_ckpt source weights: " in page
    summary = (p.stdout + p.stderr).split("kvcompress run")[-1]
    assert "NOTE hf_ckpt activations: served as" in summary and "NOTE trtllm_ckpt" not in summary
    src = load_file(str(ckpt / "model.safetensors"))
    hf_dir = run / "export" / "hf_ckpt"
    hf = {k: v for f in sorted(hf_dir.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    for part in ("weight", "weight_scale", "input_scale"):  # the static activation scale travels with the weight
        k = f"model.layers.1.mlp.down_proj.{part}"
        assert hf[k].dtype == src[k].dtype and torch.equal(hf[k], src[k]), k
    assert hf["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float16 and "model.layers.0.self_attn.q_proj.weight_scale" not in hf
    q_src, q = (json.loads((d / "config.json").read_text())["quantization_config"] for d in (ckpt, hf_dir))
    assert q["config_groups"] == q_src["config_groups"] and q["format"] == "int-quantized" and q["kv_cache_scheme"]["type"] == "float"
    assert {f"model.layers.{i}.self_attn.{n}_proj" for i in range(2) for n in "qkvo"} | {"lm_head"} <= set(q["ignore"])
    loaded = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False))
    assert torch.equal(loaded.get_parameter("model.layers.1.mlp.down_proj.weight").detach(), expect["model.layers.1.mlp.down_proj.weight"])
    t = load_file(str(next((run / "export" / "trtllm_ckpt" / "tp1").glob("*.safetensors"))))
    assert t["transformer.layers.1.mlp.proj.weight"].dtype == torch.float16


# ------------------------------------------------------------------------------------------------ GPTQ and AWQ
# The reference: auto-round 0.16.1 (dev extra), whose torch GPTQ QuantLinear packs and runs the GPTQ layout and whose AWQ
# exporter packs and dequantizes AutoAWQ's GEMM layout.

def _gptq_layer(out_f: int, in_f: int, bits: int, group: int, act_order: bool, seed: int = 0, sym: bool = False):
    """auto-round's GPTQ layer (checkpoint format "gptq": zero points stored minus one) of random scales and zero points
    (sym: every zero point the midpoint 2^(b-1), as GPTQ's sym=True writes), and the weight [out, in] its own forward
    computes (the identity through it)."""
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear

    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(in_f, out_f, bias=False)
    torch.nn.init.normal_(lin.weight, std=0.05, generator=g)
    groups = in_f // group
    scales = torch.rand(out_f, groups, generator=g) * 0.02 + 0.005
    zeros = torch.full((out_f, groups), 2 ** (bits - 1)) if sym else torch.randint(1, 2**bits, (out_f, groups), generator=g)
    ql = QuantLinear(bits, group, in_f, out_f, bias=False, g_idx=act_order)
    if act_order:
        ql.g_idx = (torch.arange(in_f) // group)[torch.randperm(in_f, generator=g)].to(torch.int32)
    ql.pack(lin, scales, zeros, g_idx=ql.g_idx if act_order else None)
    with torch.no_grad():
        ref = ql(torch.eye(in_f, dtype=torch.float16)).float().T.contiguous()
    parts = {"qweight": ql.qweight, "qzeros": ql.qzeros, "scales": ql.scales}
    return parts | ({"g_idx": ql.g_idx} if act_order else {}), ref


def _awq_layer(out_f: int, in_f: int, group: int, seed: int = 0):
    from auto_round.export.export_to_awq.utils import WQLinear_GEMM, dequantize_gemm

    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(in_f, out_f, bias=False)
    torch.nn.init.normal_(lin.weight, std=0.05, generator=g)
    scales = (torch.rand(in_f // group, out_f, generator=g) * 0.02 + 0.005).half()
    awq = WQLinear_GEMM.from_linear(lin, 4, group, scales=scales, zeros=torch.randint(0, 16, (in_f // group, out_f), generator=g))
    parts = {"qweight": awq.qweight, "qzeros": awq.qzeros, "scales": awq.scales}
    return parts, dequantize_gemm(awq.qweight, awq.qzeros, awq.scales, 4, group).float().T.contiguous()


@pytest.mark.parametrize("bits,act_order", [(4, False), (4, True), (8, False), (3, False), (2, False)])
def test_gptq_dequantization_is_the_reference_layers(bits, act_order):
    """GPTQ's layout (codes down the input rows, zero points along the outputs stored minus one, g_idx) gives the weight
    auto-round's GPTQ layer computes, bit for bit; the gptq_v2 format (zero points stored as they are) gives it from zero
    points one higher; reading a v1 layer as v2 is off by one step."""
    parts, ref = _gptq_layer(64, 96, bits, 32, act_order)
    got = iw.gptq_dequantize(parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"), bits)
    assert torch.equal(got, ref)
    z = iw._unsigned(parts["qzeros"], bits, 64) + 1  # the true zero points, packed again as v2 stores them
    words = -(-64 * bits // 32)
    bitpos = torch.arange(64) * bits
    v2 = torch.zeros(z.shape[0], words + 1, dtype=torch.int64)
    for c in range(64):
        v2[:, bitpos[c] // 32] |= (z[:, c].to(torch.int64) << (bitpos[c] % 32)) & 0xFFFFFFFF
        v2[:, bitpos[c] // 32 + 1] |= z[:, c].to(torch.int64) >> (32 - bitpos[c] % 32)
    v2 = v2[:, :words]
    v2 = torch.where(v2 >= 2**31, v2 - 2**32, v2).to(torch.int32)
    assert torch.equal(iw.gptq_dequantize(parts["qweight"], v2, parts["scales"], parts.get("g_idx"), bits, v1=False), ref)
    assert not torch.equal(iw.gptq_dequantize(parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"), bits, v1=False), ref)


def test_awq_dequantization_is_the_reference_layers():
    """AWQ's GEMM layout (eight output columns a word in AutoAWQ's nibble order) gives auto-round's dequantize_gemm,
    bit for bit; the columns read in plain nibble order would not."""
    parts, ref = _awq_layer(64, 96, 32)
    assert torch.equal(iw.awq_dequantize(parts["qweight"], parts["qzeros"], parts["scales"]), ref)
    q, z = iw._unsigned(parts["qweight"], 4, 64), iw._unsigned(parts["qzeros"], 4, 64).repeat_interleave(32, 0)
    plain = ((q - z).float() * parts["scales"].float().repeat_interleave(32, 0)).half().float().T
    assert not torch.equal(plain, ref)


def _qweight_dir(tmp_path: Path, fmt: str, sym: bool = False) -> tuple[Path, dict]:
    """A tiny Llama whose projections are GPTQ (4-bit, groups of 32, act order in some; sym: symmetric, no act order) or AWQ
    (GEMM) layers packed by auto-round, with the quantization_config their quantizers write; the weights auto-round's layers compute."""
    out = tmp_path / (fmt + ("_sym" if sym else ""))
    sd = tiny_llama_dir(out)
    new, expect = {}, {}
    for j, (k, v) in enumerate(sd.items()):
        if not k.endswith("proj.weight"):
            new[k] = v
            continue
        # act order where the reference's forward takes it (its g_idx path keeps only in_features outputs: out <= in)
        parts, expect[k] = (_gptq_layer(*v.shape, 4, 32, v.shape[0] <= v.shape[1] and not sym, seed=j, sym=sym) if fmt == "gptq" else
                            _awq_layer(*v.shape, 32, seed=j))
        new |= {k.removesuffix("weight") + p: t.contiguous() for p, t in parts.items()}
    save_file(new, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": not sym, "sym": sym, "checkpoint_format": "gptq"}
                                  if fmt == "gptq" else {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"})
    (out / "config.json").write_text(json.dumps(cfg))
    return out, expect


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_gptq_and_awq_checkpoints_are_read_and_run_as_their_dequantized_model(tmp_path, fmt):
    """A GPTQ / AWQ checkpoint: the streaming reader's weights and the custom tier's loader give the reference layers'
    weights; a streamed run measures the perplexity of those weights written plain, and exports them dequantized with its
    checks passing. AWQ's GEMV layout is one line."""
    from kvcompress.targets.network_weights import dequantize_packed

    ckpt, expect = _qweight_dir(tmp_path, fmt)
    assert weight_quantization(ckpt) == "int"
    c = Checkpoint(ckpt)
    loaded = dequantize_packed(load_file(str(ckpt / "model.safetensors")), ckpt)
    for k, w in expect.items():
        assert k in c and c.shape(k) == list(w.shape) and torch.equal(c.read(k), w) and torch.equal(c.read(k, 3, 11), w[3:11])
        assert torch.equal(loaded[k], w)
    assert not any(iw.is_qweight_part(k) for k in loaded)
    p, r = _run(tmp_path, ckpt, "run_q")  # with the export: every check that runs passes
    assert p.returncode == 0, p.stderr[-3000:]
    manifest = json.loads((r / "export" / "manifest.json").read_text())
    assert all(c["status"] in ("passed", "skipped") for c in manifest["checks"]), manifest["checks"]
    hf_note = manifest["artifacts"]["hf_ckpt"]["source_int_weights"]
    hf = {k: v for f in sorted((r / "export" / "hf_ckpt").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    if fmt == "gptq":  # activation order: hf_ckpt has them dequantized, and says why
        assert "written dequantized" in hf_note and "activation order" in hf_note and not any(iw.is_part(k) for k in hf)
    else:  # AWQ: written as compressed-tensors pack-quantized with zero points, the attention the fold changes in export.dtype
        assert "written as compressed-tensors pack-quantized" in hf_note, hf_note
        q = json.loads((r / "export" / "hf_ckpt" / "config.json").read_text())["quantization_config"]
        assert q["quant_method"] == "compressed-tensors" and q["kv_cache_scheme"]["type"] == "float"
        assert {"num_bits": 4, "symmetric": False, "strategy": "group", "group_size": 32}.items() <= q["config_groups"]["group_0"]["weights"].items()
        assert {f"model.layers.{i}.self_attn.{n}_proj" for i in range(2) for n in "qkvo"} | {"lm_head"} == set(q["ignore"])
        assert "model.layers.1.mlp.down_proj.weight_zero_point" in hf and "model.layers.0.self_attn.q_proj.weight" in hf
        from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor as PQ
        from compressed_tensors.quantization import QuantizationScheme

        scheme = QuantizationScheme(targets=["Linear"], weights=q["config_groups"]["group_0"]["weights"])
        out = Checkpoint(r / "export" / "hf_ckpt")  # kvcompress's reader and the library's decompressor: the source's weights
        for k in [k for k in expect if ".mlp." in k]:
            m = k.removesuffix("weight")
            assert torch.equal(out.read(k), expect[k]) and torch.equal(PQ.decompress({p: hf[m + p] for p in iw.PARTS[:4]}, scheme)["weight"].float(), expect[k])
    p2, r2 = _run(tmp_path, _plain_copy(tmp_path, ckpt, expect), "run_plain", "export=none", "model.streaming=false")
    assert p2.returncode == 0, p2.stderr[-3000:]
    a, b = (json.loads((d / "report.json").read_text()) for d in (r, r2))
    assert a["quality"]["ppl_baseline"] == pytest.approx(b["quality"]["ppl_baseline"], rel=1e-6)
    if fmt == "awq":
        cfg = json.loads((ckpt / "config.json").read_text())
        (ckpt / "config.json").write_text(json.dumps(cfg | {"quantization_config": cfg["quantization_config"] | {"version": "gemv"}}))
        with pytest.raises(UserError, match="quant_method='awq'"):
            weight_quantization(ckpt)


def test_an_int4_mixture_of_experts_reads_its_experts_through_the_models_conversion(tmp_path):
    """A W4A16 Mixtral (llm-compressor packs each expert's w1/w2/w3 as its own Linear; the router stays unquantized): the
    streaming reader builds transformers' fused expert tensors from the dequantized per-expert weights, so a streamed run
    measures the perplexity of the same weights written plain."""
    ckpt = tmp_path / "mixtral_w4a16"
    sd = tiny_llama_dir(ckpt, "mixtral")
    scheme = _scheme(4, "group", 32, True)
    new, expect = {}, {}
    for k, v in sd.items():
        if v.dim() == 2 and k.startswith("model.layers.") and (k.endswith("proj.weight") or ".experts." in k):
            packed, expect[k] = _compress(v, scheme)
            new |= {k.removesuffix("weight") + p: t.contiguous() for p, t in packed.items()}
        else:
            new[k] = v
    assert any(".experts.0.w1.weight" in k for k in expect), sorted(sd)[:20]
    save_file(new, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme.weights.model_dump(mode="json"),
                                                                "input_activations": None, "output_activations": None, "format": "pack-quantized"}},
                                  "ignore": ["lm_head", "re:.*block_sparse_moe.gate$"]}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    p, r = _run(tmp_path, ckpt, "run_moe", "export=none")
    assert p.returncode == 0, p.stderr[-3000:]
    p2, r2 = _run(tmp_path, _plain_copy(tmp_path, ckpt, expect), "run_plain", "export=none", "model.streaming=false")
    assert p2.returncode == 0, p2.stderr[-3000:]
    a, b = (json.loads((d / "report.json").read_text()) for d in (r, r2))
    assert a["model"].get("streamed") and a["quality"]["ppl_baseline"] == pytest.approx(b["quality"]["ppl_baseline"], rel=1e-6)


def test_the_engine_memory_counts_a_gptq_weight_at_its_dense_shape(tmp_path):
    """engine_memory's shapes from the safetensors headers alone: a 3-bit GPTQ qweight [in * 3 / 32, out] (its words hold
    a non-integral count of codes) is the weight [out, in]; AWQ's [in, out / 8] too; their parts are not counted."""
    from kvcompress.targets.network_weights import dense_shapes

    for q, shapes, want in (({"quant_method": "gptq", "bits": 3}, {"m.qweight": [9, 64], "m.qzeros": [3, 6], "m.scales": [3, 64], "m.g_idx": [96]}, [64, 96]),
                            ({"quant_method": "awq", "bits": 4}, {"m.qweight": [96, 8], "m.qzeros": [3, 8], "m.scales": [3, 64]}, [64, 96])):
        (tmp_path / "config.json").write_text(json.dumps({"quantization_config": q}))
        assert dense_shapes(shapes | {"n.weight": [4]}, tmp_path) == {"m.weight": want, "n.weight": [4]}


def test_pack_is_unpacks_inverse():
    """pack writes the bitstream unpack reads (codes straddling words at 3 and 5 bits) and refuses codes wider than the width."""
    g = torch.Generator().manual_seed(0)
    for bits in (2, 3, 4, 5, 8):
        codes = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (7, 45), generator=g).to(torch.int8)
        assert torch.equal(iw.unpack(iw.pack(codes, bits), bits, 45), codes)
    with pytest.raises(ValueError, match="outside -8..7"):
        iw.pack(torch.tensor([[8]]), 4)


@pytest.mark.parametrize("fmt,bits", [("gptq", 4), ("gptq", 8), ("gptq_v2", 4), ("awq", 4)])
def test_gptq_and_awq_layers_repack_as_pack_quantized_bit_for_bit(fmt, bits):
    """repack: a GPTQ / AWQ layer as compressed-tensors pack-quantized tensors whose decompression (the compressed-tensors
    library's own, and int_weights.dequantize) is the source layer's weight bit for bit; AWQ's are the tensors the
    library's own AutoAWQ converter writes. A symmetric GPTQ layer (zero points all at the midpoint) needs no zero points;
    activation order and a non-midpoint zero point in a layer called symmetric are refused."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor as PQ

    parts, ref = _gptq_layer(64, 96, bits, 32, False) if fmt != "awq" else _awq_layer(64, 96, 32)
    if fmt == "gptq_v2":  # the v2 format stores the zero points themselves: write them so
        z = iw._unsigned(parts["qzeros"], bits, 64) + 1
        parts = parts | {"qzeros": iw.pack(z - (1 << (bits - 1)), bits)}
    names = {p: p for p in parts}
    got = iw.repack(fmt, names, parts.__getitem__, bits, symmetric=False)
    assert torch.equal(iw.dequantize(got["weight_packed"], got["weight_scale"], got["weight_shape"], got["weight_zero_point"]), ref)
    scheme = _scheme(bits, "group", 32, False)
    assert torch.equal(PQ.decompress(dict(got), scheme)["weight"].float(), ref)
    shapes = iw.repacked_shapes(64, 96, 3, bits, False, parts["scales"].dtype)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in got.items()} == shapes
    if fmt == "awq":
        from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

        lib = AutoAWQConverter(bits=4, group_size=32).process({f"m.{k}": v for k, v in parts.items()})
        assert set(lib) == {f"m.{k}" for k in got} and all(torch.equal(lib[f"m.{k}"], v) for k, v in got.items())
    with pytest.raises(ValueError, match="zero points other than"):
        iw.repack(fmt, names, parts.__getitem__, bits, symmetric=True)
    if fmt == "gptq":
        mid = torch.full((3, 64 * bits // 32), 0, dtype=torch.int32)  # v1 stores zero - 1: the midpoint minus one, packed
        sym = parts | {"qzeros": iw.pack(torch.full((3, 64), (1 << (bits - 1)) - 1 - (1 << (bits - 1)), dtype=torch.int8), bits)}
        assert sym["qzeros"].shape == mid.shape
        s = iw.repack(fmt, names, sym.__getitem__, bits, symmetric=True)
        assert "weight_zero_point" not in s and torch.equal(
            iw.dequantize(s["weight_packed"], s["weight_scale"], s["weight_shape"]), iw.gptq_dequantize(sym["qweight"], sym["qzeros"], sym["scales"], None, bits))
        assert torch.equal(PQ.decompress(dict(s), _scheme(bits, "group", 32, True))["weight"].float(), iw.dequantize(s["weight_packed"], s["weight_scale"], s["weight_shape"]))
        ordered = parts | {"g_idx": (torch.arange(96) // 32)[torch.randperm(96, generator=torch.Generator().manual_seed(0))].to(torch.int32)}
        with pytest.raises(ValueError, match="activation order"):
            iw.repack(fmt, {p: p for p in ordered}, ordered.__getitem__, bits, symmetric=False)
        in_order = parts | {"g_idx": (torch.arange(96) // 32).to(torch.int32)}  # a g_idx that keeps group order is no obstacle
        assert torch.equal(iw.repack(fmt, {p: p for p in in_order}, in_order.__getitem__, bits, symmetric=False)["weight_packed"], got["weight_packed"])


def test_a_symmetric_gptq_checkpoint_exports_pack_quantized_as_transformers_loads_it(tmp_path):
    """GPTQ (sym, no activation order): hf_ckpt writes its MLP layers as compressed-tensors pack-quantized, symmetric (no
    zero points), the same codes and scales, beside the FP8 KV-cache scheme; transformers with compressed-tensors loads it
    to the source's weights (the MLP) and the folded attention the export validated."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    ckpt, expect = _qweight_dir(tmp_path, "gptq", sym=True)
    p, run = _run(tmp_path, ckpt, "run", "kv=native_fp8")
    assert p.returncode == 0, p.stderr[-3000:]
    manifest = json.loads((run / "export" / "manifest.json").read_text())
    assert all(c["status"] in ("passed", "skipped") for c in manifest["checks"]), manifest["checks"]
    art = manifest["artifacts"]["hf_ckpt"]
    assert "gptq repacked as pack-quantized" in art["weights"] and "written as compressed-tensors pack-quantized" in art["source_int_weights"]
    out = run / "export" / "hf_ckpt"
    hf = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert "model.layers.1.mlp.up_proj.weight_packed" in hf and not any(k.endswith(("weight_zero_point", "qweight")) for k in hf)
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q["config_groups"]["group_0"]["weights"]["symmetric"] is True and q["kv_cache_scheme"]["type"] == "float"
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False)).state_dict()
    for k in [k for k in expect if ".mlp." in k]:
        assert torch.equal(loaded[k], expect[k]), k
    assert torch.equal(loaded["model.layers.0.self_attn.k_proj.weight"], hf["model.layers.0.self_attn.k_proj.weight"].float())
