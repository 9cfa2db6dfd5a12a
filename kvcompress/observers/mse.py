"""mse: choose a clipping ratio per layer x kv-head that minimises the error of q.k scores.

error(alpha) = E over the calibration queries of the group and the sampled keys of
    (q . k - q . k_hat(alpha))^2 = mean_n dk_n^T E[q q^T] dk_n,   dk = k - k_hat(alpha),
    k_hat = dequant(quant(k; scale = alpha * half / Q))
computed with the reference numerics on the raw key sample and the queries' second moment
(q_gram) kept by `profile`. Position augmentation: when kv_stats records the model's RoPE inverse
frequencies, each sampled key is first rotated by RoPE to a random position in [0, max_position)
(RoPE(p + delta) = R(delta) RoPE(p), applied per pair), so the clipping is chosen for the positions
the model serves, not only the short calibration windows. Outlier channels are
kept in fp16 and contribute no error. alpha is searched on ALPHA_GRID (1.0 included, so the
result is never worse on the sample than the raw range).
"""
from __future__ import annotations

import torch

from kvcompress.observers import OBSERVERS
from kvcompress.observers.base import key_positions, uses_arc
from kvcompress.reference import KeyParams, fake_quant_keys, key_qmax, pair_halves, pair_spread

ALPHA_GRID = torch.linspace(1.0, 0.3, 36)
AUGMENT_SEED = 0


def rotate_to_random_positions(k: torch.Tensor, inv_freq: torch.Tensor, max_position: int, seed: int = AUGMENT_SEED,
                               pairs: torch.Tensor | None = None, from_pos: torch.Tensor | None = None) -> torch.Tensor:
    """k: [H, N, D] post-RoPE keys -> the same keys moved by a random position offset per row
    (rotate_half convention: pair j, channels (d, d + D/2) or `pairs` (reference.rope_pairs), rotates by delta * inv_freq[j]).
    With from_pos ([N], each row's position): moved to a random position in [0, max_position) instead (delta =
    target - from_pos), for ranges that hold up to max_position only (asymmetric keys, observers.base.arc_ranges)."""
    g = torch.Generator().manual_seed(seed)
    delta = torch.randint(0, max(1, max_position), (k.shape[1],), generator=g).float()  # [N]
    if from_pos is not None:
        delta = delta - from_pos.float()
    ang = delta[:, None] * inv_freq[None, :].float()  # [N, D/2]
    cos, sin = ang.cos(), ang.sin()
    x, y = pair_halves(k, pairs)
    return pair_spread(x * cos - y * sin, pairs, y * cos + x * sin)


def gram_score_error(dk: torch.Tensor, qq: torch.Tensor) -> torch.Tensor:
    """E_q[(q . dk)^2] averaged over keys, per kv head: dk [Hkv, N, D], qq = E[q q^T] [Hkv, D, D] -> [Hkv]."""
    dk = dk.double()
    return ((dk @ qq) * dk).sum(-1).mean(-1).float()


def score_error(qq: torch.Tensor, k: torch.Tensor, params: KeyParams) -> torch.Tensor:
    """Mean squared q.k score error per kv-head. qq: E[q q^T] [Hkv, D, D], k: [Hkv, N, D] -> [Hkv]."""
    return gram_score_error(k - fake_quant_keys(k, params), qq)


@OBSERVERS.register("mse")
def mse_clip(stats, spec, ranges, outliers) -> tuple[torch.Tensor, dict]:
    L, H, D = ranges.half.shape
    n = stats.tensors["sample_k"].shape[1]
    info = {"method": "mse", "error": "mean squared q.k score error: sampled keys (rotated to random positions up to max_position when RoPE is known) x the calibration queries' second moment", "grid": [round(a, 4) for a in ALPHA_GRID.tolist()], "sample_rows": n}
    if n == 0:
        info["fallback"] = "no raw sample in kv_stats (calib.sample_tokens=0): used the raw range"
        return torch.ones(L, H), info
    qmax = key_qmax(spec.key.bits)
    best = torch.ones(L, H)
    err_raw = torch.zeros(L, H)
    err_best = torch.zeros(L, H)
    for layer in range(L):
        k = stats.tensors["sample_k"][layer].transpose(0, 1).float()  # [H, N, D]
        if "rope_inv_freq" in stats.tensors and spec.key.tie_rope_pairs:
            inv = stats["rope_inv_freq"]
            arc = uses_arc(stats, spec)  # ranges that hold to key_positions only: the keys moved to absolute positions below it
            k = rotate_to_random_positions(k, inv[layer] if inv.dim() == 2 else inv, key_positions(spec, stats.geometry) if arc else stats.geometry["max_position"],
                                           AUGMENT_SEED + layer, stats.tensors.get("rope_pairs"), stats["sample_pos"][layer] if arc else None)
        q = stats.q_second_moment(layer)  # [H, D, D]
        errs = []
        for alpha in ALPHA_GRID.tolist():
            half = (ranges.half[layer] * alpha).clamp(min=1e-8)
            p = KeyParams(spec.key.bits, half / qmax, ranges.center[layer], outliers[layer])
            errs.append(score_error(q, k, p))
        errs = torch.stack(errs)  # [n_alpha, H]
        idx = errs.argmin(0)
        best[layer] = ALPHA_GRID[idx]
        err_raw[layer], err_best[layer] = errs[0], errs.gather(0, idx[None])[0]
    info["score_mse_raw_range"] = err_raw.tolist()
    info["score_mse_chosen"] = err_best.tolist()
    return best, info
