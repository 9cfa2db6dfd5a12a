"""Checkpoints whose weights are stored quantized (config.json `quantization_config`).

kvcompress calibrates and validates the model's K/V at full weight precision as stored: FP8 weight checkpoints (the
common form of large open models: DeepSeek-style block-scaled `fp8`, Meta's `fbgemm_fp8` (per output row), NVIDIA Model
Optimizer `FP8`, compressed-tensors 8-bit float) are read through the streaming reader, which dequantizes each float8 weight with its stored scale
(`<name>_scale_inv`: block-scaled; `<name>_scale`: per tensor or per output channel) into the compute dtype, so every
stage sees w = w_fp8 * scale, exactly as the checkpoint defines it. GPT-OSS's MXFP4 experts are read the same way,
dequantized by the streaming reader (mxfp4_weights), or with model.streaming=false loaded in memory by transformers, which
dequantizes them (its Mxfp4Config(dequantize=True), on any device). Integer weight-only compressed-tensors checkpoints in the
`pack-quantized` format (llm-compressor's W4A16 / W8A16 models: int4 or int8 codes packed in int32 words, a scale per
output row and group, zero points if asymmetric), GPTQ's (AutoGPTQ / GPTQModel, 2..8 bits, either checkpoint format) and
AWQ's (AutoAWQ's 4-bit GEMM layout) are streamed too, dequantized by the reader (int_weights) to w = (q - z) * s in the
scale's dtype, and so are compressed-tensors' `int-quantized` int8 weights (llm-compressor's W8A8: unpacked int8 codes, a
scale per row; their servers quantize activations to int8 per token, which validate does not); so are Model Optimizer's NVFP4 checkpoints (nvfp4_weights: e2m1 codes times fp8 block scales times a global
scale), and compressed-tensors' NVFP4 (`nvfp4-pack-quantized`, llm-compressor's NVFP4 and NVFP4A16 exports: the same codes
and block scales, the global scale stored inverted), their activations then computed unquantized, as for FP8. Any other weight format (AWQ's GEMV layout, bitsandbytes,
NVFP4 in other layouts or block sizes, compressed-tensors with activations quantized other than as above, or other
formats, ...) is refused in one line: transformers' CPU path for them either needs a GPU
kernel or silently differs, and the streaming reader would read packed integers as values. A quantization_config that
quantizes only the KV cache (this project's own FP8 HF checkpoint: `quant_method: modelopt` without `quant_algo`)
leaves the weights as they are.
"""
from __future__ import annotations

import json
from pathlib import Path

from kvcompress.errors import UserError

READ = ("fp8 (block-scaled), fbgemm_fp8, modelopt FP8 and NVFP4, compressed-tensors 8-bit float and nvfp4-pack-quantized, mxfp4, integer "
        "weights (GPTQ, AWQ GEMM 4-bit, compressed-tensors pack-quantized and int8 int-quantized, W8A8 included)")


def quantization_config(model_dir: Path) -> dict | None:
    """config.json's quantization_config (a multimodal checkpoint's may sit in its text_config), or None."""
    p = Path(model_dir) / "config.json"
    cfg = json.loads(p.read_text()) if p.is_file() else {}
    q = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config")
    return q if isinstance(q, dict) else None


def weight_block_size(model_dir: Path) -> list[int] | None:
    """The block size [rows, cols] of block-scaled FP8 weights, where quantization_config states one (else the shapes imply it)."""
    b = (quantization_config(model_dir) or {}).get("weight_block_size")
    return [int(x) for x in b] if isinstance(b, list) and len(b) == 2 else None


def ct_integer(q: dict) -> bool:
    """A compressed-tensors config whose every group quantizes weights to integers per group, output channel or tensor:
    1..8 bits in the pack-quantized format, activations unquantized (W4A16, W8A16), or int8 in the int-quantized format,
    activations unquantized or int8 (llm-compressor's W8A8): what int_weights reads."""
    groups = list((q.get("config_groups") or {}).values())
    fmt = lambda g: g.get("format") or q.get("format")  # noqa: E731  (a group's own format, else the checkpoint's)

    def ok(g: dict) -> bool:
        w, a = g.get("weights") or {}, g.get("input_activations")
        if w.get("type") != "int" or w.get("strategy") not in ("group", "channel", "tensor") or g.get("output_activations"):
            return False
        bits = int(w.get("num_bits", 0))
        if fmt(g) == "pack-quantized":
            return 1 <= bits <= 8 and not a
        return fmt(g) == "int-quantized" and bits == 8 and (not a or (a.get("type") == "int" and int(a.get("num_bits", 0)) == 8))

    return bool(groups) and all(ok(g) for g in groups)


def ct_nvfp4(q: dict) -> bool:
    """A compressed-tensors config whose every group stores weights as symmetric NVFP4 in the nvfp4-pack-quantized format (4-bit
    floats, blocks of 16), activations unquantized or NVFP4 too (llm-compressor's NVFP4A16 and NVFP4 schemes): what
    nvfp4_weights reads."""
    groups = list((q.get("config_groups") or {}).values())

    def fp4(a: dict | None) -> bool:
        return (a or {}).get("type") == "float" and int((a or {}).get("num_bits", 0)) == 4 and int((a or {}).get("group_size") or 0) == 16

    return bool(groups) and all(
        fp4(g.get("weights")) and (g.get("weights") or {}).get("symmetric", True) and (g.get("format") or q.get("format")) == "nvfp4-pack-quantized"
        and (not g.get("input_activations") or fp4(g["input_activations"])) and not g.get("output_activations") for g in groups)


def served_activations(model_dir: Path) -> tuple[str, str] | None:
    """(how the checkpoint tells its server, what each quantized layer's input becomes) where a server of the checkpoint as
    stored also quantizes the quantized layers' inputs, which validate runs unquantized; None where it does not (weight-only
    formats: W4A16 / W8A16 integers, W4A16_NVFP4, NVFP4A16, GPT-OSS's MXFP4 experts, FP8 weights without input quantization)."""
    q = quantization_config(model_dir) or {}
    method = str(q.get("quant_method", "")).lower()
    if method == "modelopt":
        algo = str(q.get("quant_algo")).upper()
        return {"NVFP4": ("quant_algo NVFP4", "FP4 (block scales over the stored input_scale)"),
                "FP8": ("quant_algo FP8", "FP8 at the stored static input_scale")}.get(algo)
    if method == "fbgemm_fp8":  # neither checkpoint is written as fbgemm_fp8: the same tensors under the names their servers read
        return ("per-channel FP8 (the fbgemm_fp8 source as trtllm_ckpt's quant_algo FP8_PER_CHANNEL_PER_TOKEN and hf_ckpt's "
                "compressed-tensors FP8)"), "FP8 per token at run time"
    if method == "fp8":
        dynamic = str(q.get("activation_scheme", "dynamic")).lower() == "dynamic"  # block-scaled FP8: per token and block of columns
        return "quant_method fp8", ("FP8 per token and block of columns at run time" if dynamic else "FP8 at its stored input scales")
    for g in (q.get("config_groups") or {}).values():
        a = g.get("input_activations") or {}
        if not a:
            continue
        kind = {("float", 4): "FP4", ("float", 8): "FP8", ("int", 8): "int8"}.get((a.get("type"), int(a.get("num_bits", 0))), "the configured format")
        scheme = {"FP4": "NVFP4", "FP8": "FP8", "int8": "W8A8"}.get(kind, "quantized")
        how = ("(block scales over the stored input_global_scale)" if kind == "FP4" else
               "per token at run time" if a.get("dynamic") is True or a.get("strategy") == "token" else "at the stored input_scale")
        return f"compressed-tensors {scheme} (input_activations)", f"{kind} {how}"
    return None


def stated_bits(model_dir: Path) -> int | None:
    """The code width of an integer checkpoint: GPTQ's and AWQ's `bits`; compressed-tensors' when all its config groups
    state the same one."""
    from kvcompress.models.int_weights import config_bits

    return config_bits(quantization_config(model_dir))


def weight_quantization(model_dir: Path) -> str | None:
    """None when the checkpoint's weights are stored unquantized (or only its KV cache is quantized); "fp8" when they are
    float8 with stored scales (read dequantized by the streaming reader); "mxfp4" for GPT-OSS's MXFP4 experts (streamed, or loaded in
    memory, transformers dequantizing them: Mxfp4Config(dequantize=True)); "int" for integer weights (compressed-tensors
    pack-quantized and int-quantized int8, GPTQ, AWQ GEMM: streamed, dequantized by int_weights); "nvfp4" for Model
    Optimizer's and compressed-tensors' NVFP4 weights in blocks of 16 (streamed, dequantized by nvfp4_weights); any other weight
    format: one-line UserError."""
    q = quantization_config(model_dir)
    if q is None:
        return None
    method = str(q.get("quant_method", "")).lower()
    if method == "modelopt":
        algo = q.get("quant_algo")
        if algo in (None, "", "NONE"):
            return None  # KV cache only (kvcompress's own hf_ckpt, ModelOpt's KV-only export)
        if str(algo).upper() == "FP8":
            return "fp8"
        if str(algo).upper() in ("NVFP4", "W4A16_NVFP4") and int(q.get("group_size") or 16) == 16:  # 16-column blocks (models.nvfp4_weights)
            return "nvfp4"
    elif method in ("fp8", "fbgemm_fp8"):  # fbgemm_fp8: Meta's Llama 3.1 405B FP8 (one scale per output row)
        return "fp8"
    elif method == "mxfp4":
        return "mxfp4"
    elif method in ("gptq", "awq"):
        from kvcompress.models.int_weights import layout

        if layout(q) is not None:  # GPTQ (either checkpoint format), AWQ's 4-bit GEMM layout
            return "int"
    elif method == "compressed-tensors":
        groups = (q.get("config_groups") or {}).values()
        weights = [g.get("weights") or {} for g in groups]
        if weights and all(w.get("type") == "float" and int(w.get("num_bits", 0)) == 8 for w in weights):
            return "fp8"
        if weights and ct_integer(q):
            return "int"
        if weights and ct_nvfp4(q):
            return "nvfp4"
    raise UserError(f"model.path={str(model_dir)!r} stores its weights quantized (quantization_config quant_method={method or '?'!r}"
                    f"{', quant_algo=' + repr(q.get('quant_algo')) if q.get('quant_algo') else ''}); kvcompress reads unquantized weights "
                    f"and FP8 ones ({READ}): point it at the unquantized checkpoint")
