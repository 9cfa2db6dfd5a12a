"""MXFP4 weights (GPT-OSS's experts, OCP microscaling FP4) dequantized: values = e2m1[code] * 2^(exponent - 127).

Standalone (torch only). OpenAI's layout, which transformers reads: an expert weight the model holds as [E, A, B]
(gate_up_proj: [experts, hidden, 2 * intermediate]) is stored transposed, `<name>_blocks` uint8 [E, B, A / 32, 16]
(32 e2m1 codes per group along A, two per byte, the even element in the low nibble) and `<name>_scales` uint8
[E, B, A / 32] (one e8m0 exponent per group, bias 127).
"""
from __future__ import annotations

import torch

from kvcompress.models.nvfp4_weights import E2M1  # the e2m1 code values, shared with NVFP4


def blocks_name(entries, key: str) -> tuple[str, str] | None:
    """(`<key>_blocks`, `<key>_scales`) where both are stored, else None."""
    b, s = key + "_blocks", key + "_scales"
    return (b, s) if b in entries and s in entries else None


def shape(blocks_shape: list[int]) -> list[int]:
    """The [E, A, B] shape of the weight stored as blocks of `blocks_shape` [E, B, A / 32, 16]."""
    E, B, G, n = blocks_shape
    return [E, G * 2 * n, B]


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [E, A, B] from blocks [E, B, G, 16] and scales [E, B, G] (rows of E may be any slice of the experts)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.dtype} {list(blocks.shape)} and scales {scales.dtype} {list(scales.shape)} do not fit "
                         "(uint8 [E, B, G, 16] and [E, B, G])")
    lut = torch.tensor(E2M1, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(*blocks.shape[:-1], -1).long()  # [E, B, G, 32]
    vals = lut[codes] * torch.exp2(scales.float() - 127.0)[..., None]
    E, B = blocks.shape[:2]
    return vals.reshape(E, B, -1).transpose(1, 2).contiguous()
