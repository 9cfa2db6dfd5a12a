"""Values: per token in groups of channels, asymmetric (fp16 scale and min rounded outward, or the coded min)."""
from __future__ import annotations

import torch

from kvcompress.reference.codes import pack_codes, round_half_even, round_outward_fp16, unpack_codes, value_levels


def value_meta(v: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-group (scale, min) in float16, rounded outward. v: [..., T, D] -> [..., T, D//G] each."""
    vg = v.float().unflatten(-1, (-1, group))  # [..., T, D//G, G]
    vmin = round_outward_fp16(vg.amin(-1), float("-inf"))
    vmax = vg.amax(-1)
    scale = round_outward_fp16((vmax - vmin.float()) / value_levels(bits), float("inf"))
    return scale, vmin


def min_code_step(bits: int) -> int:
    """F of the coded min (kv.value.min=code): the min is -w * scale / F, w a uint8; F = 2**(8 - bits):
    16 for 4-bit values, 8 for 5-bit, 1 for 8-bit (the largest power of two with F * (levels - 1/F) <= 255)."""
    return 2 ** (8 - bits)


def value_meta_coded(v: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Values with a coded min (kv.value.min=code): per token, per group an fp16 scale and a uint8 w,
    the group's min being -w * scale / F (min_code_step): 3 bytes per group instead of 4. The range
    is widened to include 0 (so w >= 0 fits a byte) and the scale is (max - min) / (levels - 1/F),
    fp16 rounded up, so the min rounded down to a multiple of scale / F still reaches the max.
    v: [..., T, D] -> (scale fp16, w uint8), [..., T, D//G] each."""
    F = min_code_step(bits)
    vg = v.float().unflatten(-1, (-1, group))
    lo, hi = vg.amin(-1).clamp(max=0.0), vg.amax(-1).clamp(min=0.0)
    scale = round_outward_fp16((hi - lo) / (value_levels(bits) - 1.0 / F), float("inf"))
    s = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    w = torch.floor(-lo * float(F) / s).clamp_(0, 255)  # -w s / F <= lo: the min rounded down
    w = torch.where(-w * s > lo * F, w + 1, w).clamp_(0, 255)  # guard the division's rounding
    return scale, w.to(torch.uint8)


def coded_min(w: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """A coded min, float32: -w * scale / F (exact: a byte times an fp16 times a power of two)."""
    return -(w.float() * scale.float()) * (1.0 / min_code_step(bits))


def _min_f32(vmin: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """The min as float32: fp16 as stored, or a uint8 code (value_meta_coded)."""
    return coded_min(vmin, scale, bits) if vmin.dtype == torch.uint8 else vmin.float()


def quantize_values(v: torch.Tensor, bits: int, group: int, coded_min: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """v: [..., T, D] -> (codes uint8 [..., T, D] in [0, 2**bits-1], scale fp16, min [..., T, D//G]):
    the min fp16 (value_meta), or with coded_min a uint8 code (value_meta_coded)."""
    scale, vmin = (value_meta_coded if coded_min else value_meta)(v, bits, group)
    s = torch.where(scale == 0, torch.ones_like(scale), scale).float().unsqueeze(-1)
    vg = v.float().unflatten(-1, (-1, group))
    q = round_half_even((vg - _min_f32(vmin, scale, bits).unsqueeze(-1)) / s).clamp_(0, value_levels(bits))
    return q.flatten(-2).to(torch.uint8), scale, vmin


def dequantize_values(codes: torch.Tensor, scale: torch.Tensor, vmin: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """codes uint8 [..., T, D], meta [..., T, D//G] -> float32 [..., T, D]:  q * scale + min
    (a uint8 min is a code: value_meta_coded, which needs the value bits)."""
    q = codes.float().unflatten(-1, (-1, group))
    return (q * scale.float().unsqueeze(-1) + _min_f32(vmin, scale, bits).unsqueeze(-1)).flatten(-2)


def encode_values(v: torch.Tensor, bits: int, group: int, coded_min: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Storage form of values: (payload uint8 [.., D * bits / 8] (pack_codes), scale fp16, min fp16 or uint8 code)."""
    codes, scale, vmin = quantize_values(v, bits, group, coded_min)
    return pack_codes(codes, bits), scale, vmin


def decode_values(payload: torch.Tensor, scale: torch.Tensor, vmin: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    return dequantize_values(unpack_codes(payload, bits), scale, vmin, group, bits)


def fake_quant_values(v: torch.Tensor, bits: int, group: int, coded_min: bool = False) -> torch.Tensor:
    """decode(encode(v)) in v's dtype."""
    return decode_values(*encode_values(v, bits, group, coded_min), bits, group).to(v.dtype)
