"""FP8 weights stored with their scales, dequantized: w = w_fp8 * scale (models.quantized says which checkpoints).

Standalone (torch only): the custom-tier export copies this file beside trtllm_network.py, whose weight loader reads the
model's own HF directory with it on a TensorRT-LLM host.
"""
from __future__ import annotations

import math

import torch

FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def scale_name(entries, key: str) -> str | None:
    """The stored scale of float8 weight `key`: `<name>_scale_inv` (block-scaled) or `<name>_scale`, else None."""
    for s in (key + "_scale_inv", key + "_scale"):
        if s in entries:
            return s
    return None


def dequantize(w: torch.Tensor, scale: torch.Tensor, shape: list[int], lo: int = 0, block: list[int] | None = None) -> torch.Tensor:
    """float32 values of the float8 rows lo:lo+len(w) of a weight of `shape` [rows, cols]: w * scale, where the (whole)
    scale is one value, one per output row ([rows] or [rows, 1]), or one per block ([ceil(rows / b0), ceil(cols / b1)]:
    `block` = config.json's weight_block_size, else the powers of two the shapes imply; DeepSeek's and transformers'
    fine-grained FP8 use 128 x 128)."""
    x, s = w.float(), scale.float()
    rows = shape[0]
    if s.numel() == 1:
        return x * s.reshape(())
    if x.dim() != 2:
        raise ValueError(f"a float8 tensor of shape {shape} with a scale of shape {list(s.shape)}: kvcompress reads float8 matrices only")
    r = torch.arange(lo, lo + x.shape[0])
    if s.dim() == 1 or (s.shape[0] == rows and s.shape[1] == 1):
        if s.numel() != rows:
            raise ValueError(f"a float8 weight of shape {shape} with {s.numel()} per-row scales")
        return x * s.reshape(-1)[r][:, None]
    b0, b1 = block or (_block(rows, s.shape[0]), _block(shape[1], s.shape[1]))
    if math.ceil(rows / b0) != s.shape[0] or math.ceil(shape[1] / b1) != s.shape[1]:
        raise ValueError(f"a float8 weight of shape {shape} with block scales of shape {list(s.shape)} does not fit blocks of {b0} x {b1}")
    return x * s[r // b0][:, torch.arange(shape[1]) // b1]


def _block(n: int, n_blocks: int) -> int:
    """The smallest power of two b with ceil(n / b) <= n_blocks (a block size the scale's shape implies)."""
    b = 1
    while math.ceil(n / b) > n_blocks:
        b *= 2
    return b
