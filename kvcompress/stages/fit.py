"""fit: KVStats + KVSpec -> ScaleBook (static per-channel key scales, outliers, clipping)."""
from __future__ import annotations

import torch

from kvcompress.fold import fold_factors
from kvcompress.observers import OBSERVERS
from kvcompress.observers.base import channel_ranges, pick_outliers, tie_rope_pairs
from kvcompress.observers.percentile import percentile_half
from kvcompress.provenance import base_provenance
from kvcompress.reference import NATIVE_QMAX, key_qmax
from kvcompress.scalebook import ScaleBook
from kvcompress.spec import KVSpec
from kvcompress.stats import KVStats


def native_tensors(stats: KVStats, spec: KVSpec) -> dict[str, torch.Tensor]:
    """TensorRT-LLM INT8/FP8 KV: fold factors and one scale per layer, amax of the folded K and V."""
    L, H, D = stats["k_absmax"].shape
    ones = torch.ones(L, H, D)
    k_abs, v_abs = stats["k_absmax"], stats["v_absmax"]
    target = torch.maximum(k_abs.amax(dim=(1, 2)), v_abs.amax(dim=(1, 2)))  # [L] the shared K/V amax
    sigma = fold_factors(k_abs, target, spec.fold_strength, tie_pairs=True) if spec.fold_keys else ones
    tau = fold_factors(v_abs, target, spec.fold_strength, tie_pairs=False) if spec.fold_values else ones
    amax = torch.maximum((k_abs / sigma).amax(dim=(1, 2)), (v_abs / tau).amax(dim=(1, 2)))  # [L], == target
    return {
        "fold_k": sigma, "fold_v": tau, "native_scale": (amax / NATIVE_QMAX[spec.format]).float(),
        "k_scale": ones, "k_zero": torch.zeros(L, H, D), "k_clip": torch.ones(L, H),
    }


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
    if spec.is_native:
        tensors |= native_tensors(stats, spec)
        info = {"method": "native per-tensor amax (shared by K and V, as TensorRT-LLM)", "fold_keys": spec.fold_keys, "fold_values": spec.fold_values, "fold_strength": spec.fold_strength}
    elif spec.is_baseline:
        tensors |= {"k_scale": torch.ones(L, H, D), "k_zero": torch.zeros(L, H, D), "k_clip": torch.ones(L, H)}
        info = {"method": "none (fp16 baseline)"}
    else:
        clip, info = OBSERVERS.get(spec.key.clip)(stats, spec, ranges, outliers)
        half = (ranges.half * clip.unsqueeze(-1)).clamp(min=1e-8)
        tensors |= {"k_scale": (half / key_qmax(spec.key.bits)).float(), "k_zero": ranges.center.float(), "k_clip": clip.float()}
    provenance = {**base_provenance(), "stats": stats.header.get("provenance", {})}
    return ScaleBook(spec, geom, tensors, provenance, info)
