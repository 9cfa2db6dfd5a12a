"""percentile: clip each channel at the kv.key.clip_percentile-th percentile of |k| (from the histogram).

Returns a per-layer-head ratio of 1: the range itself is replaced by the percentile range in
`fit` (see `percentile_half`), so this observer only documents the choice.
"""
from __future__ import annotations

import torch

from kvcompress.observers import OBSERVERS


def percentile_half(stats, spec) -> torch.Tensor:
    """Per-channel |k| percentile, an upper bound from the fixed histogram: [L, H, D]."""
    return stats.quantile_abs("k", spec.key.clip_percentile)


@OBSERVERS.register("percentile")
def percentile_clip(stats, spec, ranges, outliers) -> tuple[torch.Tensor, dict]:
    L, H = ranges.half.shape[:2]
    return torch.ones(L, H), {"method": "percentile", "percentile": spec.key.clip_percentile}
