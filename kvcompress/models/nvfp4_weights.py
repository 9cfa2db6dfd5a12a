"""NVFP4 weights (NVIDIA Model Optimizer's `quant_algo: NVFP4` checkpoints, e.g. the `*-FP4` releases TensorRT-LLM serves on
Blackwell) dequantized: w = e2m1[code] * (block scale * global scale), in float32.

Standalone (torch only). ModelOpt's unified HF layout, as its export writes it and its NVFP4QTensor reads it back: a
Linear's weight [out, in] is stored under its own name as uint8 [out, in / 2] (two e2m1 codes a byte along the input
columns, the even column in the low nibble), beside `<m>.weight_scale` float8_e4m3fn [out, in / 16] (one scale per row
and block of 16 columns), `<m>.weight_scale_2` float32 (one global scale for the tensor) and `<m>.input_scale` (the
activations' global scale: an inference input, not part of the weight). The block scale and the global scale are
multiplied in float32 first, then the code's value (ModelOpt's dequantize, `nvfp4_tensor.py`, read in
nvidia-modelopt 0.47's sources; tests/test_nvfp4_weights.py checks this module against that class bit for bit).
"""
from __future__ import annotations

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 16  # input columns per block scale (ModelOpt's NVFP4 group_size)
PARTS = ("weight_scale", "weight_scale_2", "input_scale")  # the tensors beside an NVFP4 weight that are not model parameters


def _dtype(entry) -> str | None:
    """The safetensors dtype string of a streaming Checkpoint entry (path, header, start), a bare header, or a tensor."""
    if entry is None:
        return None
    if isinstance(entry, torch.Tensor):
        return {torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3"}.get(entry.dtype)
    header = entry[1] if isinstance(entry, tuple) else entry
    return header.get("dtype")


def packed_names(entries: dict) -> dict[str, list[str]]:
    """{`<m>.weight`: its stored parts (weight_scale, weight_scale_2, input_scale where stored)} for every weight stored as NVFP4
    codes: uint8, with a float8 weight_scale and a weight_scale_2 beside it. entries: stored name -> Checkpoint entry,
    safetensors header entry or tensor."""
    out = {}
    for k, e in entries.items():
        m = k.removesuffix("weight")
        if k.endswith(".weight") and _dtype(e) == "U8" and m + "weight_scale_2" in entries and _dtype(entries.get(m + "weight_scale")) == "F8_E4M3":
            out[k] = [m + p for p in PARTS if m + p in entries]
    return out


def shape(stored_shape: list[int]) -> list[int]:
    """The [out, in] shape of a weight stored as codes of `stored_shape` [out, in / 2]."""
    return [*stored_shape[:-1], stored_shape[-1] * 2]


def dequantize(codes: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """float32 [rows, in] from codes uint8 [rows, in / 2], block scales float8_e4m3fn [rows, in / 16] (the same rows) and
    the global scale (a float32 scalar)."""
    rows, half = codes.shape[-2:]
    if codes.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn or (half * 2) % BLOCK or tuple(scale.shape[-2:]) != (rows, half * 2 // BLOCK):
        raise ValueError(f"NVFP4 codes {codes.dtype} {list(codes.shape)} and block scales {scale.dtype} {list(scale.shape)} do not fit "
                         f"(uint8 [out, in / 2] and float8_e4m3fn [out, in / {BLOCK}])")
    if scale_2.numel() != 1:
        raise ValueError(f"NVFP4 weight_scale_2 has {scale_2.numel()} elements, not one global scale")
    lut = torch.tensor(E2M1, dtype=torch.float32)
    vals = lut[torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(*codes.shape[:-1], -1).long()]  # [rows, in]
    block = scale.to(torch.float32) * scale_2.to(torch.float32).reshape(())
    return (vals.reshape(*vals.shape[:-1], -1, BLOCK) * block[..., None]).reshape(vals.shape)
