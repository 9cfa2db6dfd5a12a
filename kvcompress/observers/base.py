"""Shared pieces of the key observers: per-channel ranges and the outlier / RoPE-pair rules."""
from __future__ import annotations

import math
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


def _cos_bounds(a: torch.Tensor, width: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """min and max of cos over the angles [a, a + width], a in [0, 2 pi), width >= 0 (elementwise, float64)."""
    two_pi = 2 * math.pi
    b = a + width
    ca, cb = torch.cos(a), torch.cos(b)
    full = width >= two_pi
    hi = torch.where(full | (b >= two_pi), torch.ones_like(ca), torch.maximum(ca, cb))  # reaches 0 mod 2 pi
    lo = torch.where(full | ((a <= math.pi) & (b >= math.pi)) | (b >= 3 * math.pi), -torch.ones_like(ca), torch.minimum(ca, cb))  # reaches pi
    return lo, hi


def arc_ranges(arcmin: torch.Tensor, arcmax: torch.Tensor, inv_freq: torch.Tensor, max_position: int,
               pairs: torch.Tensor | None = None) -> KeyRanges:
    """Each post-RoPE key channel's range over every position 0..max_position-1, from the pre-RoPE angle histogram
    of its RoPE pair (stats k_arcmin / k_arcmax [L, H, D/2, NB]: per bin of the angle before RoPE, the smallest and
    largest norm observed). RoPE turns pair j by p * inv_freq[j], so a key whose pre-RoPE angle lies in bin b
    = [b w, (b + 1) w) can sit at any angle in [b w, (b + 1) w + (max_position - 1) inv_freq[j]] and its two channels
    are norm x cos and norm x sin of that angle: each channel's range is the union over the observed bins of
    [min, max] of norm x cos over that arc (the norm anywhere between the bin's min and max). A pair whose arc is a
    whole turn gets the symmetric pair-norm bound [-max norm, max norm] (as tie_rope_pairs with k_pairmax); a slow
    pair, which turns less than a full circle by max_position, keeps its offset (the reason for asymmetric keys:
    a slow pair's keys sit far from 0 at every position the model serves). Conservative by at most one bin's
    width of angle; no key of an observed angle and norm clips at any position below max_position.
    inv_freq: [D/2] or [L, D/2]. Returns per-channel ranges [L, H, D] (center, half), not yet tied."""
    L, H, P, NB = arcmax.shape
    inv = (inv_freq if inv_freq.dim() == 2 else inv_freq.expand(L, -1)).double().view(L, 1, P, 1)
    w = 2 * math.pi / NB
    a = (torch.arange(NB, dtype=torch.float64) * w).view(1, 1, 1, NB).expand(L, H, P, NB)
    width = w + (max(int(max_position), 1) - 1) * inv.expand(L, H, P, NB)
    seen = arcmax > 0
    rmin = torch.where(seen, arcmin.double().clamp(max=float(torch.finfo(torch.float32).max)), torch.zeros_like(arcmin, dtype=torch.float64))
    rmax = arcmax.double()
    out_lo, out_hi = [], []
    for shift in (0.0, math.pi / 2):  # channel a: norm cos(angle); channel b: norm sin(angle) = norm cos(angle - pi/2)
        c_lo, c_hi = _cos_bounds(torch.remainder(a - shift, 2 * math.pi), width)
        corners = torch.stack([rmin * c_lo, rmax * c_lo, rmin * c_hi, rmax * c_hi])
        big = torch.tensor(float("inf"), dtype=torch.float64)
        lo = torch.where(seen, corners.amin(0), big).amin(-1)
        hi = torch.where(seen, corners.amax(0), -big).amax(-1)
        none = ~seen.any(-1)
        out_lo.append(torch.where(none, torch.zeros_like(lo), lo))
        out_hi.append(torch.where(none, torch.zeros_like(hi), hi))
    lo_c, hi_c = pair_spread(out_lo[0], pairs, out_lo[1]).float(), pair_spread(out_hi[0], pairs, out_hi[1]).float()
    return KeyRanges((hi_c + lo_c) / 2, (hi_c - lo_c) / 2)


def tie_pair_scales(r: KeyRanges, outliers: torch.Tensor, pairs: torch.Tensor | None = None) -> KeyRanges:
    """The two channels of each RoPE pair share the larger half-range (one scale, so the fold commutes with RoPE)
    and keep their own centers (zero points, which the kernels apply as one q . z constant per query). A channel
    kept in fp16 (an outlier) does not widen its partner's range."""
    is_out = torch.zeros_like(r.half, dtype=torch.bool).scatter_(-1, outliers, True)
    h = torch.where(is_out, torch.zeros_like(r.half), r.half)
    ha, hb = pair_halves(h, pairs)
    m = torch.maximum(ha, hb)
    oa, ob = pair_halves(is_out, pairs)
    m = torch.where(oa & ob, torch.maximum(*pair_halves(r.half, pairs)), m)
    return KeyRanges(r.center, pair_spread(m, pairs).to(r.half))


def uses_arc(stats, spec) -> bool:
    """Whether fit takes static asymmetric key ranges from the pre-RoPE angle histogram (arc_ranges): static
    per-channel keys (no token groups), asymmetric, tied across RoPE pairs, minmax or mse clipping, and kv_stats
    that recorded the histogram and the RoPE frequencies."""
    k = spec.key
    return (not k.symmetric and k.tie_rope_pairs and k.granularity == "channel" and not k.group_tokens and k.clip != "percentile"
            and "k_arcmax" in stats.tensors and "rope_inv_freq" in stats.tensors)


def key_positions(spec, geometry: dict) -> int:
    """The positions 0..N-1 asymmetric static keys' ranges hold at (arc_ranges): kv.key.max_position, else the model's."""
    return int(spec.key.max_position or geometry["max_position"])
