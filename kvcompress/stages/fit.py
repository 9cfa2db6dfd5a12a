"""fit: KVStats + KVSpec -> ScaleBook (static per-channel key scales, outliers, clipping)."""
from __future__ import annotations

import torch

from kvcompress.fold import fold_factors
from kvcompress.observers import OBSERVERS
from kvcompress.observers.base import channel_ranges, pick_outliers, tie_rope_pairs
from kvcompress.observers.mse import gram_score_error
from kvcompress.observers.percentile import percentile_half
from kvcompress.provenance import base_provenance
from kvcompress.reference import NATIVE_QMAX, key_qmax, native_fake_quant
from kvcompress.scalebook import ScaleBook
from kvcompress.spec import KVSpec
from kvcompress.stats import KVStats


FOLD_STRENGTHS = (0.5, 1.0)  # candidates when kv.fold_strength=auto (0 = no fold is always a candidate of auto)


def _strengths(flag, strength) -> tuple[float, ...]:
    tried = (float(strength),) if strength != "auto" else FOLD_STRENGTHS
    if flag is False:
        return (0.0,)
    return tried if flag is True else (0.0, *tried)


def _native_error(x: torch.Tensor, f: torch.Tensor, scale: float, fmt: str, qq: torch.Tensor | None) -> float:
    """Error of what the folded checkpoint caches, in the model's own units.

    x: sample [N, H, D] (keys or values), f: fold factors [H, D]; x_hat = f * Q(x / f).
    keys (qq = E[q q^T] per kv head [H, D, D]): mean squared q.k score error; values: mean
    squared reconstruction error.
    """
    dx = x - f * native_fake_quant(x / f, scale, fmt)
    if qq is None:
        return float(dx.pow(2).mean())
    return float(gram_score_error(dx.transpose(0, 1), qq).mean())


def native_tensors(stats: KVStats, spec: KVSpec) -> tuple[dict[str, torch.Tensor], dict]:
    """TensorRT-LLM INT8/FP8 KV: fold factors and one scale per layer (amax of the folded K and V).

    The fold of keys and of values, and its strength, are chosen per layer by measuring the error
    of the native quantizer on the calibration sample (q.k scores for keys, reconstruction for
    values), among "no fold" and the allowed strengths. Folding never raises the shared amax, so
    the per-layer scale is the same for every candidate.
    """
    L, H, D = stats["k_absmax"].shape
    k_abs, v_abs = stats["k_absmax"], stats["v_absmax"]
    target = torch.maximum(k_abs.amax(dim=(1, 2)), v_abs.amax(dim=(1, 2)))  # [L] the shared K/V amax
    scale = (target / NATIVE_QMAX[spec.format]).float()
    n = stats["sample_k"].shape[1] if "sample_k" in stats.tensors else 0
    sk, sv = torch.ones(L, H, D), torch.ones(L, H, D)
    info = {"fold_strength_keys": [], "fold_strength_values": [], "fold_error_keys": [], "fold_error_values": [],
            "fold_measured_on": f"{n} sampled calibration rows (q.k score MSE over the calibration queries' second moment for keys, reconstruction MSE for values)"}
    for layer in range(L):
        for w, abs_, flag, tie, out in (("k", k_abs, spec.fold_keys, True, sk), ("v", v_abs, spec.fold_values, False, sv)):
            cands = _strengths(flag, spec.fold_strength)
            facts = {a: fold_factors(abs_[layer : layer + 1], target[layer : layer + 1], a, tie_pairs=tie)[0] for a in cands}
            if n and len(cands) > 1:
                x = stats[f"sample_{w}"][layer].float()
                q = stats.q_second_moment(layer) if w == "k" else None
                errs = {a: _native_error(x, facts[a], float(scale[layer]), spec.format, q) for a in cands}
                best = min(errs, key=errs.get)
            else:
                errs, best = {}, cands[-1]
            out[layer] = facts[best]
            name = "keys" if w == "k" else "values"
            info[f"fold_strength_{name}"].append(best)
            info[f"fold_error_{name}"].append({str(a): e for a, e in errs.items()})
    tensors = {"fold_k": sk, "fold_v": sv, "native_scale": scale, "k_scale": torch.ones(L, H, D), "k_zero": torch.zeros(L, H, D), "k_clip": torch.ones(L, H)}
    return tensors, info


def fit(stats: KVStats, spec: KVSpec) -> ScaleBook:
    """Static key parameters for `spec` from profiled statistics; no model needed."""
    geom = stats.geometry
    spec.check_geometry(geom["head_dim"])
    L, H, D = stats["k_absmax"].shape
    absmax = percentile_half(stats, spec) if spec.key.clip == "percentile" else stats["k_absmax"]
    ranges = channel_ranges(stats["k_min"], stats["k_max"], absmax, spec.key.symmetric)
    outliers = pick_outliers(ranges.half, spec.outlier_channels)
    if spec.key.tie_rope_pairs:
        # the rotation-invariant pair-norm bound (symmetric keys; percentile clipping keeps its histogram ranges)
        bound = stats.tensors.get("k_pairmax") if spec.key.symmetric and spec.key.clip != "percentile" else None
        ranges = tie_rope_pairs(ranges, outliers, bound)
    tensors = {"k_outliers": outliers, "k_range": ranges.half.float()}
    if spec.is_native:
        native, info = native_tensors(stats, spec)
        tensors |= native
        info = {"method": "native per-tensor amax (shared by K and V, as TensorRT-LLM)", **info}
    elif spec.is_baseline:
        tensors |= {"k_scale": torch.ones(L, H, D), "k_zero": torch.zeros(L, H, D), "k_clip": torch.ones(L, H)}
        info = {"method": "none (fp16 baseline)"}
    else:
        clip, info = OBSERVERS.get(spec.key.clip)(stats, spec, ranges, outliers)
        half = (ranges.half * clip.unsqueeze(-1)).clamp(min=1e-8)
        tensors |= {"k_scale": (half / key_qmax(spec.key.bits)).float(), "k_zero": ranges.center.float(), "k_clip": clip.float()}
    provenance = {**base_provenance(), "stats": stats.header.get("provenance", {})}
    return ScaleBook(spec, geom, tensors, provenance, info)
