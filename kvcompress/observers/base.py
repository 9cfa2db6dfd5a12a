"""Shared pieces of the key observers: per-channel ranges and the outlier / RoPE-pair rules."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.reference import pair_halves, pair_spread


@dataclass(frozen=True)
class KeyRanges:
    """Per-channel key range to fit: k in [center - half, center + half]. Tensors [L, H, D]."""

    center: torch.Tensor
    half: torch.Tensor


def channel_ranges(lo: torch.Tensor, hi: torch.Tensor, absmax: torch.Tensor, symmetric: bool) -> KeyRanges:
    if symmetric:
        return KeyRanges(torch.zeros_like(absmax), absmax.clone())
    return KeyRanges((hi + lo) / 2, (hi - lo) / 2)


def pick_outliers(half: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k channels by range per layer x head: [L, H, D] -> int64 [L, H, k] (sorted by channel)."""
    if k == 0:
        return torch.zeros(*half.shape[:2], 0, dtype=torch.int64)
    return half.topk(k, dim=-1).indices.sort(dim=-1).values


def tie_rope_pairs(r: KeyRanges, outliers: torch.Tensor, pair_norm: torch.Tensor | None = None, pairs: torch.Tensor | None = None) -> KeyRanges:
    """Make the two channels of each RoPE pair share one range, ignoring channels kept in fp16. `pairs`
    (reference.rope_pairs, [2, D/2]; None: (d, d + D/2)) names them: a partial-rotary model's pairs are its own.

    With `pair_norm` ([L, H, D/2], the largest post-RoPE norm of each pair; symmetric ranges only)
    the shared half-range is that norm: RoPE rotates a pair's energy between its two channels as
    the position grows, so at positions the calibration never reached either channel can reach
    the pair's norm but never exceed it (position-invariant, no clipping from rotation). Without
    it, the union of the two observed ranges (which a later rotation can exceed by up to sqrt(2)).
    A pair whose one member is an outlier takes the other member's range (or the pair norm); the
    outlier's own scale is then unused (it is stored in fp16) but still equal to its partner's.
    """
    if pair_norm is not None:
        half = pair_spread(pair_norm, pairs).to(r.half)
        return KeyRanges(torch.zeros_like(half), half)
    lo, hi = r.center - r.half, r.center + r.half
    is_out = torch.zeros_like(r.half, dtype=torch.bool).scatter_(-1, outliers, True)
    big = torch.finfo(lo.dtype).max
    lo_m = torch.where(is_out, torch.full_like(lo, big), lo)
    hi_m = torch.where(is_out, torch.full_like(hi, -big), hi)
    h = lambda x: pair_halves(x, pairs)  # noqa: E731
    plo = torch.minimum(*h(lo_m))
    phi = torch.maximum(*h(hi_m))
    oa, ob = h(is_out)
    both_out = oa & ob
    plo = torch.where(both_out, torch.minimum(*h(lo)), plo)
    phi = torch.where(both_out, torch.maximum(*h(hi)), phi)
    lo_t, hi_t = pair_spread(plo, pairs), pair_spread(phi, pairs)
    return KeyRanges((hi_t + lo_t) / 2, (hi_t - lo_t) / 2)
