"""fit: KVStats + KVSpec -> ScaleBook (static per-channel key scales, outliers, clipping)."""
from __future__ import annotations

import torch

from kvcompress.observers import OBSERVERS
from kvcompress.observers.base import channel_ranges, pick_outliers, tie_rope_pairs
from kvcompress.observers.percentile import percentile_half
from kvcompress.provenance import base_provenance
from kvcompress.reference import key_qmax
from kvcompress.scalebook import ScaleBook
from kvcompress.spec import KVSpec
from kvcompress.stats import KVStats


def fit(stats: KVStats, spec: KVSpec) -> ScaleBook:
    """Static key parameters for `spec` from profiled statistics; no model needed."""
    geom = stats.geometry
    spec.check_geometry(geom["head_dim"])
    L, H, D = stats["k_absmax"].shape
    absmax = percentile_half(stats, spec) if spec.key.clip == "percentile" else stats["k_absmax"]
    ranges = channel_ranges(stats["k_min"], stats["k_max"], absmax, spec.key.symmetric)
    outliers = pick_outliers(ranges.half, spec.outlier_channels)
    if spec.key.tie_rope_pairs:
        ranges = tie_rope_pairs(ranges, outliers)
    tensors = {"k_outliers": outliers, "k_range": ranges.half.float()}
    if spec.is_baseline:
        tensors |= {"k_scale": torch.ones(L, H, D), "k_zero": torch.zeros(L, H, D), "k_clip": torch.ones(L, H)}
        info = {"method": "none (fp16 baseline)"}
    else:
        clip, info = OBSERVERS.get(spec.key.clip)(stats, spec, ranges, outliers)
        half = (ranges.half * clip.unsqueeze(-1)).clamp(min=1e-8)
        tensors |= {"k_scale": (half / key_qmax(spec.key.bits)).float(), "k_zero": ranges.center.float(), "k_clip": clip.float()}
    provenance = {**base_provenance(), "stats": stats.header.get("provenance", {})}
    return ScaleBook(spec, geom, tensors, provenance, info)
