"""NVFP4 weights (NVIDIA Model Optimizer's `quant_algo: NVFP4` checkpoints, e.g. the `*-FP4` releases TensorRT-LLM serves on
Blackwell) dequantized: w = e2m1[code] * (block scale * global scale), in float32.

Standalone (torch only). ModelOpt's unified HF layout, as its export writes it and its NVFP4QTensor reads it back: a
Linear's weight [out, in] is stored under its own name as uint8 [out, in / 2] (two e2m1 codes a byte along the input
columns, the even column in the low nibble), beside `<m>.weight_scale` float8_e4m3fn [out, in / 16] (one scale per row
and block of 16 columns), `<m>.weight_scale_2` float32 (one global scale for the tensor) and `<m>.input_scale` (the
activations' global scale: an inference input, not part of the weight). The block scale and the global scale are
multiplied in float32 first, then the code's value (ModelOpt's dequantize, `nvfp4_tensor.py`, read in
nvidia-modelopt 0.47's sources; tests/test_nvfp4_weights.py checks this module against that class bit for bit).

compressed-tensors' `nvfp4-pack-quantized` format (llm-compressor's NVFP4 and NVFP4A16 exports) stores the same codes and
block scales under other names and inverts the global scale: `<m>.weight_packed` uint8 [out, in / 2] (the same nibble
order), `<m>.weight_scale` float8_e4m3fn [out, in / 16], `<m>.weight_global_scale` float32 [1], the RECIPROCAL of
ModelOpt's weight_scale_2 (w = e2m1 x block scale / global scale), and `<m>.input_global_scale` where activations are
quantized too. Its decompressor divides the block scale by the global scale in float32, multiplies the code's value in
float32 and rounds the product to bfloat16 (compressed-tensors 0.20's `compressors/nvfp4` and `_dequantize`); this module
gives the float32 product, which rounds to the library's result bit for bit (tested).
"""
from __future__ import annotations

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 16  # input columns per block scale (ModelOpt's NVFP4 group_size)
PARTS = ("weight_scale", "weight_scale_2", "input_scale")  # the tensors beside an NVFP4 weight that are not model parameters
CT_PARTS = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")  # compressed-tensors' names of the same
ROLES = ("codes", "scale", "global", "input")  # what packed_names maps to stored names (input: the activations' scale, if stored)


def _dtype(entry) -> str | None:
    """The safetensors dtype string of a Checkpoint entry (models.checkpoint) (path, header, start), a bare header, or a tensor.
    Not models.st_dtypes.entry_dtype: this module is copied into the bundle alone (targets.bundle.WEIGHT_READERS)."""
    if entry is None:
        return None
    if isinstance(entry, torch.Tensor):
        return {torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3"}.get(entry.dtype)
    header = entry[1] if isinstance(entry, tuple) else entry
    return header.get("dtype")


def packed_names(entries: dict) -> dict[str, dict[str, str]]:
    """{`<m>.weight`: {role: stored name}} for every weight stored as NVFP4 codes (uint8 beside a float8 block scale and a
    global scale), roles as ROLES (input only where stored), plus "layout": "modelopt" (codes under the weight's own name,
    weight_scale_2 multiplies) or "compressed-tensors" (codes in weight_packed, weight_global_scale divides). entries: stored
    name -> Checkpoint entry, safetensors header entry or tensor."""
    out = {}
    for k, e in entries.items():
        for suffix, names, layout in ((".weight", PARTS, "modelopt"), (".weight_packed", CT_PARTS[1:], "compressed-tensors")):
            m = k.removesuffix(suffix[1:])
            if k.endswith(suffix) and _dtype(e) == "U8" and m + names[1] in entries and _dtype(entries.get(m + "weight_scale")) == "F8_E4M3":
                out[m + "weight"] = {"codes": k, **{r: m + n for r, n in zip(ROLES[1:], names) if m + n in entries}, "layout": layout}
    return out


def stored(parts: dict[str, str]) -> list[str]:
    """The stored tensors of one NVFP4 weight (packed_names' value): codes, block scale, global scale, input scale if any."""
    return [parts[r] for r in ROLES if r in parts]


def read(parts: dict[str, str], read_stored, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
    """float32 rows lo:hi (all if None) of one NVFP4 weight (packed_names' value); read_stored(name, lo, hi) gives a stored
    tensor's rows (name alone: the whole tensor)."""
    return dequantize(read_stored(parts["codes"], lo, hi), read_stored(parts["scale"], lo, hi), read_stored(parts["global"]),
                      reciprocal=parts["layout"] == "compressed-tensors")


def shape(stored_shape: list[int]) -> list[int]:
    """The [out, in] shape of a weight stored as codes of `stored_shape` [out, in / 2]."""
    return [*stored_shape[:-1], stored_shape[-1] * 2]


def dequantize(codes: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor, reciprocal: bool = False) -> torch.Tensor:
    """float32 [rows, in] from codes uint8 [rows, in / 2], block scales float8_e4m3fn [rows, in / 16] (the same rows) and
    the global scale (a float32 scalar; reciprocal: compressed-tensors' weight_global_scale, which divides)."""
    rows, half = codes.shape[-2:]
    if codes.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn or (half * 2) % BLOCK or tuple(scale.shape[-2:]) != (rows, half * 2 // BLOCK):
        raise ValueError(f"NVFP4 codes {codes.dtype} {list(codes.shape)} and block scales {scale.dtype} {list(scale.shape)} do not fit "
                         f"(uint8 [out, in / 2] and float8_e4m3fn [out, in / {BLOCK}])")
    if scale_2.numel() != 1:
        raise ValueError(f"NVFP4 global scale has {scale_2.numel()} elements, not one")
    lut = torch.tensor(E2M1, dtype=torch.float32)
    vals = lut[torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(*codes.shape[:-1], -1).long()]  # [rows, in]
    g = scale_2.to(torch.float32).reshape(())
    block = scale.to(torch.float32) / g if reciprocal else scale.to(torch.float32) * g
    return (vals.reshape(*vals.shape[:-1], -1, BLOCK) * block[..., None]).reshape(vals.shape)
