"""fit: KVStats + KVSpec -> ScaleBook (static per-channel key scales, outliers, clipping)."""
from __future__ import annotations

import logging

import torch

from kvcompress.errors import UserError
from kvcompress.fold import FLOOR, OFFSET_FLOOR, fold_factors
from kvcompress.observers import OBSERVERS
from kvcompress.observers.base import arc_ranges, channel_ranges, key_positions, pick_outliers, tie_pair_scales, tie_rope_pairs, uses_arc
from kvcompress.observers.mse import gram_score_error
from kvcompress.observers.percentile import percentile_half
from kvcompress.provenance import base_provenance
from kvcompress.reference import NATIVE_QMAX, is_half_split, key_qmax, native_fake_quant, pair_rotate, waterfill_bits
from kvcompress.scalebook import ScaleBook
from kvcompress.spec import KVSpec, LayerFormat, mixed_spec
from kvcompress.stats import KVStats


FOLD_STRENGTHS = (0.5, 1.0)  # candidates when kv.fold_strength=auto (0 = no fold is always a candidate of auto)
HEADROOMS = (1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 8.0, 16.0, 32.0, 64.0)  # candidates when kv.headroom=auto
PAIR_ANGLES = 16  # kv.fold_pairs: rotation angles per RoPE pair, k * (pi/2) / 16 (a quarter turn maps the grid onto itself)
PAIR_SHRINKS = 4  # kv.fold_pairs on native_fp8: shrinks 2^(-i/4), i < 4 (an octave maps FP8's grid onto itself)
# On the embedded model (compare_peers, 6 x 1024 held-out tokens) 16 x 4 reached the held-out KL of 64 x 16
# (7.4e-3 both) with less calibration fit (0.66x vs 0.61x of the unrotated error): finer grids fit the sample, not text
PAIR_SHIFTS = 256  # kv.pair_context > 0: position shifts each pair's score is averaged over
HEADROOM_TOL = 0.01  # auto: the largest headroom whose calibration error (keys and values) is within 1% of headroom 1


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


def check_fold_flags(spec: KVSpec, blocked: dict[str, str], pairs: torch.Tensor | None, knorm: str) -> None:
    """A fold the user forced (kv.fold_keys/values/pairs=true) that this model cannot take: a side its attention cannot
    take folded (profile.fold_obstacles), pair rotations without (i, i + head_dim/2) RoPE pairs, or with keys normalised
    before RoPE (profile.key_norm). Fit checks the profiled header; the pipeline the model itself, before profiling."""
    for side, flag in (("keys", spec.fold_keys), ("values", spec.fold_values), ("pairs", spec.fold_pairs)):
        why = blocked.get("keys" if side == "pairs" else side)
        if why and flag is True:
            raise UserError(f"kv.fold_{side}=true: {why}; allowed for this model: kv.fold_{side}=auto or false")
    if spec.fold_pairs is True and not is_half_split(pairs):
        raise UserError(f"kv.fold_pairs=true: this model's RoPE pairs are not (i, i + head_dim/2) (partial or interleaved rotary: first pair "
                        f"{tuple(pairs[:, 0].tolist())}); the pair rotations are for that layout only; allowed: kv.fold_pairs=auto or false")
    if spec.fold_pairs is True and knorm != "none":
        raise UserError(f"kv.fold_pairs=true: this model normalises each head's keys before RoPE (key_norm={knorm}), where no RoPE-pair "
                        "rotation can be folded; allowed: kv.fold_pairs=auto or false")


def native_tensors(stats: KVStats, spec: KVSpec) -> tuple[dict[str, torch.Tensor], dict]:
    """TensorRT-LLM INT8/FP8 KV: fold factors and one scale per layer (amax of the folded K and V).

    The fold of keys and of values, and its strength, are chosen per layer by measuring the error
    of the native quantizer on the calibration sample (q.k scores for keys, reconstruction for
    values), among "no fold" and the allowed strengths. Folding never raises the shared amax, so
    the per-layer scale is the same for every candidate.
    """
    knorm = stats.header.get("key_norm", "none")  # profile.key_norm: where the key fold can live
    pairs = stats.tensors.get("rope_pairs")  # the model's RoPE pairs (partial rotary: its own)
    blocked = stats.header.get("fold_obstacles") or {}  # profile.fold_obstacles: a side the model's attention cannot take folded
    check_fold_flags(spec, blocked, pairs, knorm)
    L, H, D = stats["k_absmax"].shape
    k_abs, v_abs = stats["k_absmax"], stats["v_absmax"]
    target = torch.maximum(k_abs.amax(dim=(1, 2)), v_abs.amax(dim=(1, 2)))  # [L] the shared K/V amax
    if knorm == "shared":  # one k_norm weight for every head (Qwen3): the key factors must be head-independent
        k_abs = k_abs.amax(1, keepdim=True).expand_as(k_abs)
    offset = float(stats.header.get("key_norm_offset", 0.0)) if knorm != "none" else 0.0  # Gemma's (1 + w) norm weights
    k_floor = OFFSET_FLOOR if offset else FLOOR  # fold.OFFSET_FLOOR: the stored q_norm weight keeps its precision
    scale = (target / NATIVE_QMAX[spec.format]).float()
    n = stats["sample_k"].shape[1] if "sample_k" in stats.tensors else 0
    sk, sv = torch.ones(L, H, D), torch.ones(L, H, D)
    info = {"fold_strength_keys": [], "fold_strength_values": [], "fold_error_keys": [], "fold_error_values": [],
            "fold_measured_on": f"{n} sampled calibration rows (q.k score MSE over the calibration queries' second moment for keys, reconstruction MSE for values)"}
    info |= {f"fold_{side}_off": why for side, why in blocked.items()}
    fold_keys, fold_values = (False if "keys" in blocked else spec.fold_keys), (False if "values" in blocked else spec.fold_values)
    for layer in range(L):
        for w, abs_, flag, tie, out in (("k", k_abs, fold_keys, True, sk), ("v", v_abs, fold_values, False, sv)):
            cands = _strengths(flag, spec.fold_strength)
            facts = {a: fold_factors(abs_[layer : layer + 1], target[layer : layer + 1], a, tie_pairs=tie, pairs=pairs,
                                     floor=k_floor if w == "k" else FLOOR)[0] for a in cands}
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
    headroom = _headroom(stats, spec, sk, sv, scale, n, info)
    scale = scale * headroom
    rot = torch.zeros(L, H, D // 2)
    half_split = is_half_split(pairs)
    if not half_split and spec.pairs_folded:
        info["fold_pairs"] = "off: partial or interleaved rotary (the key factors are tied over the model's own RoPE pairs; no pair rotation is chosen)"
    if knorm != "none":
        info["key_norm"] = (f"{knorm}: the model normalises each head's keys before RoPE, so the key factors fold into its q/k norm weights"
                            + (" (one per channel, shared by every head)" if knorm == "shared" else "")
                            + (f"; the norms multiply by (w + {offset:g}), so the factors scale that and stay >= {OFFSET_FLOOR}" if offset else "")
                            + "; no RoPE-pair rotation can fold there")
    if "keys" in blocked and spec.pairs_folded:
        info["fold_pairs"] = f"off: {blocked['keys']}"
    if spec.pairs_folded and n and knorm == "none" and half_split and "keys" not in blocked:
        per_layer = []
        inv = stats.tensors.get("rope_inv_freq")
        context = spec.pair_context
        calib_len = int(stats.header.get("provenance", {}).get("calib", {}).get("seq_len", 0))
        shift = max(0, context - calib_len) if inv is not None and context else 0
        for layer in range(L):
            rot[layer], sk[layer], e = pair_transforms(stats["sample_k"][layer].float(), stats.q_second_moment(layer), sk[layer],
                                                       float(scale[layer]), spec.format, stats["k_pairmax"][layer],
                                                       None if inv is None else (inv[layer] if inv.dim() == 2 else inv), shift)
            per_layer.append(e)
        info["fold_pairs"] = {"rotated_pairs": [e["rotated"] for e in per_layer], "shrunk_pairs": [e["shrunk"] for e in per_layer],
                              "key_error_before_after": [[e["before"], e["after"]] for e in per_layer],
                              "context": context, "position_shift": shift,
                              "rule": f"per RoPE pair, of {PAIR_ANGLES} angles x {PAIR_SHRINKS if spec.format == 'native_fp8' else 1} shrinks the one with the "
                                      "least q.k score MSE on the calibration sample"
                                      + (f", averaged over shifts of keys and queries by up to {shift} positions (kv.pair_context={context})" if shift else "")
                                      + ", among those that keep the pair's calibrated norm unsaturated"}
    tensors = {"fold_k": sk, "fold_v": sv, "fold_k_rot": rot, "native_scale": scale, "k_scale": torch.ones(L, H, D), "k_zero": torch.zeros(L, H, D),
               "k_clip": torch.ones(L, H)}
    return tensors, info


def pair_transforms(x: torch.Tensor, qq: torch.Tensor, sigma: torch.Tensor, scale: float, fmt: str, pairmax: torch.Tensor,
                    inv_freq: torch.Tensor | None = None, shift: int = 0):
    """kv.fold_pairs for one layer: per RoPE pair, the rotation angle and shrink of the folded keys.

    RoPE allows one exact transform per pair beyond the tied factor: a planar rotation (it commutes
    with RoPE's). FP8's rounding error is relative per element, so a pair whose key energy sits in one
    channel (the low-frequency pairs, which RoPE hardly turns) gets its score error up to halved by a
    rotation that spreads it over both; and a shrink by 2^(-i/PAIR_SHRINKS) moves the pair on FP8's grid (its
    error depends on where the values fall between grid points). Each pair is scored separately on
    the calibration sample: E[dy^T (R Q R^T) dy] sigma^2 / c^2 (the q.k score MSE of that pair, Q its
    2x2 block of E[q q^T], y = c R k / sigma what is cached, dy its rounding error); identity is a
    candidate, so the calibration error never rises. A rotated candidate must keep c * pairmax / sigma
    within the format's range: the pair's calibrated norm bounds either channel at every angle and position.

    Serving positions beyond the calibration windows (kv.pair_context; inv_freq [D/2], the RoPE
    frequencies, and shift > 0): RoPE turns a pair by o * theta more o positions later, keys and
    queries alike, so where the calibration keys sit on FP8's grid at angle t, the same tokens
    o positions on sit there at t + o * theta. Each candidate is then scored by the average over
    shifts o in (0, shift] of its calibration score at t + o * theta (pair_scores). A choice that
    fits a pair's near-constant key component onto the grid at the calibration positions (what
    most of the gain at 1K is, on the embedded model) is then weighed against the positions
    where RoPE has turned it off the grid.

    x [N, H, D] keys, qq [H, D, D], sigma [H, D] (tied), pairmax [H, D/2] -> (angles [H, D/2],
    sigma [H, D] (divided by the shrink), {before, after: calibration error summed over pairs,
    rotated, shrunk: how many pairs}).
    """
    N, H, D = x.shape
    P = D // 2
    sig = sigma[:, :P].double()  # [H, P]
    xf = x.double() / torch.cat([sig, sig], -1)  # [N, H, D] in the folded domain
    qa, qb = torch.diagonal(qq, dim1=-2, dim2=-1)[:, :P].double(), torch.diagonal(qq, dim1=-2, dim2=-1)[:, P:].double()
    qab = torch.diagonal(qq[:, :P, P:], dim1=-2, dim2=-1).double()  # [H, P]
    limit = NATIVE_QMAX[fmt] * scale
    room = limit * sig / pairmax.double().clamp(min=1e-30)  # largest shrink factor c that cannot saturate
    best = torch.full((H, P), float("inf"), dtype=torch.float64)
    ang, shrink = torch.zeros(H, P, dtype=torch.float64), torch.ones(H, P, dtype=torch.float64)
    shrinks = [2.0 ** (-i / PAIR_SHRINKS) for i in range(PAIR_SHRINKS)] if fmt == "native_fp8" else [1.0]
    scores = pair_scores(xf, qa, qb, qab, scale, fmt, shrinks, inv_freq, shift)  # {c: [J, H, P]}
    e0 = scores[1.0][0] * sig ** 2
    for j in range(PAIR_ANGLES):
        t = torch.tensor(j * torch.pi / 2 / PAIR_ANGLES, dtype=torch.float64)
        for c in shrinks:
            e = scores[c][j] * (sig / c) ** 2  # [H, P]
            ok = room >= c if j else torch.ones_like(e, dtype=torch.bool)  # a shrink alone never raises a channel
            better = ok & (e < best)
            best = torch.where(better, e, best)
            ang = torch.where(better, t, ang)
            shrink = torch.where(better, torch.full_like(shrink, c), shrink)
    new_sigma = sigma.clone()
    new_sigma[:, :P] = (sig / shrink).float()
    new_sigma[:, P:] = new_sigma[:, :P]
    return ang.float(), new_sigma, {"before": float(e0.sum()), "after": float(best.sum()), "rotated": int((ang != 0).sum()), "shrunk": int((shrink != 1).sum())}


def pair_scores(xf: torch.Tensor, qa, qb, qab, scale: float, fmt: str, shrinks, inv_freq: torch.Tensor | None = None, shift: int = 0) -> dict:
    """Per shrink c: the q.k score MSE of each pair [J, H, P] at the PAIR_ANGLES angles t_j = j (pi/2) / J,
    in the folded domain (times (sigma / c)^2 in model units). xf [N, H, D] folded keys, (qa, qb, qab)
    [H, P] the pairs' 2x2 query blocks. shift > 0 with inv_freq [D/2]: averaged over PAIR_SHIFTS
    position shifts o in (0, shift] of keys and queries together, at angle t_j + o * theta (the key
    error second moments interpolated between the measured angles; see pair_transforms)."""
    H, P = qa.shape
    # key rounding error second moments at each measured angle: m[c] = (E[da^2], E[db^2], E[da db]) [3, J, H, P]
    m = {c: torch.zeros(3, PAIR_ANGLES, H, P, dtype=torch.float64) for c in shrinks}
    for j in range(PAIR_ANGLES):
        y = pair_rotate(xf, torch.tensor(j * torch.pi / 2 / PAIR_ANGLES, dtype=torch.float64))
        ya, yb = y[..., :P], y[..., P:]
        for c in shrinks:
            da = native_fake_quant((c * ya).float(), scale, fmt).double() - c * ya
            db = native_fake_quant((c * yb).float(), scale, fmt).double() - c * yb
            m[c][:, j] = torch.stack([(da * da).mean(0), (db * db).mean(0), (da * db).mean(0)])
    out = {}
    for c, mc in m.items():
        sc = []
        for j in range(PAIR_ANGLES):
            t = j * torch.pi / 2 / PAIR_ANGLES
            if inv_freq is not None and shift > 0:
                off = (torch.arange(PAIR_SHIFTS, dtype=torch.float64) + 0.5) / PAIR_SHIFTS * shift  # [S]
                beta = t + off[:, None, None] * inv_freq.double()[:P]  # [S, 1, P]
                me = _error_at(mc, beta)  # [3, S, H, P]
            else:
                beta, me = torch.tensor(t, dtype=torch.float64), mc[:, j]
            raa, rbb, rab = _rotate_block(qa, qb, qab, beta)  # R Q R^T for the pair (a, b) -> (a c - b s, a s + b c)
            e = me[0] * raa + me[1] * rbb + 2 * me[2] * rab
            sc.append(e.mean(0) if e.dim() == 3 else e)
        out[c] = torch.stack(sc)
    return out


def _rotate_block(qa, qb, qab, t):
    """The 2x2 block [[qa, qab], [qab, qb]] of a pair turned by angle t: R Q R^T, R = [[c, -s], [s, c]]."""
    c_, s_ = torch.cos(t), torch.sin(t)
    return (qa * c_ * c_ - 2 * qab * c_ * s_ + qb * s_ * s_, qa * s_ * s_ + 2 * qab * c_ * s_ + qb * c_ * c_,
            (qa - qb) * c_ * s_ + qab * (c_ * c_ - s_ * s_))


def _error_at(m: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Key rounding error second moments at arbitrary angles beta [..., P] (broadcast against [H, P]),
    linearly interpolated between the J measured angles k * (pi/2) / J of m [3, J, H, P]. A quarter turn
    maps (a, b) to (-b, a): E[da^2] and E[db^2] swap and E[da db] changes sign."""
    J = m.shape[1]
    u = beta / (torch.pi / 2 / J)  # in grid steps
    i0 = torch.floor(u)
    w = u - i0
    i0 = i0.long()
    out = 0
    for i, wt in ((i0, 1 - w), (i0 + 1, w)):
        quarter, j = torch.div(i, J, rounding_mode="floor") % 2, i % J  # odd quarter turns swap
        aa, bb, ab = (_gather(m[k], j) for k in range(3))
        odd = quarter == 1
        out = out + wt * torch.stack([torch.where(odd, bb, aa), torch.where(odd, aa, bb), torch.where(odd, -ab, ab)])
    return out


def _gather(mk: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """mk [J, H, P] at grid indices j [..., H or 1, P] -> [..., H, P]."""
    J, H, P = mk.shape
    j = j.expand(*j.shape[:-2], H, P)
    flat = mk.permute(1, 2, 0).reshape(H * P, J)  # [H*P, J]
    idx = j.reshape(-1, H * P).transpose(0, 1)  # [H*P, K]
    return flat.gather(1, idx).transpose(0, 1).reshape(j.shape)


def _headroom(stats: KVStats, spec: KVSpec, sk, sv, scale, n: int, info: dict) -> torch.Tensor:
    """[L] headroom factors on the per-layer scale (kv.headroom; see HEADROOMS / HEADROOM_TOL).

    On the calibration sample nothing saturates at headroom 1, so headroom only costs resolution
    there; a held-out K or V beyond the calibrated amax saturates without it. FP8's error is relative
    per element down to its subnormals, so headroom is free until then; INT8's step grows with it.
    """
    L = scale.shape[0]
    if spec.headroom != "auto":
        info["headroom"] = [float(spec.headroom)] * L
        return torch.full((L,), float(spec.headroom))
    if not n:
        info["headroom"] = [1.0] * L
        return torch.ones(L)
    out, errs_all = torch.ones(L), []
    for layer in range(L):
        xk, xv = stats["sample_k"][layer].float(), stats["sample_v"][layer].float()
        qq = stats.q_second_moment(layer)
        errs = {h: (_native_error(xk, sk[layer], float(scale[layer]) * h, spec.format, qq),
                    _native_error(xv, sv[layer], float(scale[layer]) * h, spec.format, None)) for h in HEADROOMS}
        base = errs[1.0]
        ok = [h for h, (ek, ev) in errs.items() if ek <= (1 + HEADROOM_TOL) * base[0] and ev <= (1 + HEADROOM_TOL) * base[1]]
        out[layer] = max(ok)
        errs_all.append({str(h): list(e) for h, e in errs.items()})
    info["headroom"] = out.tolist()
    info["headroom_rule"] = (f"largest of {list(HEADROOMS)} whose key (q.k score MSE) and value (reconstruction MSE) errors on the "
                             f"calibration sample are within {HEADROOM_TOL:.0%} of headroom 1")
    info["headroom_error"] = errs_all
    return out


def waterfill_tensors(stats: KVStats, spec: KVSpec) -> tuple[torch.Tensor, str]:
    """kv.key.alloc=waterfill: bits per key channel [L, H, D] int64 (reference.waterfill_bits), weighing each
    channel by E[q_d^2] (the calibration queries of its kv-head group) times E[range_d^2] over the calibration
    windows' aligned groups of kv.key.group_tokens tokens: the q.k score error its quantization step adds."""
    L = stats["k_absmax"].shape[0]
    w = torch.stack([torch.diagonal(stats.q_second_moment(i), dim1=-2, dim2=-1) * stats.group_range_sq(i, spec.key.group_tokens) for i in range(L)])
    bits = waterfill_bits(w, spec.key.bits, pairs=stats.tensors.get("rope_pairs"))
    hist = torch.bincount(bits.flatten(), minlength=9).tolist()
    return bits, f"waterfill: mean {spec.key.bits} bits per key channel; channels with 1..8 bits: {hist[1:]}"


def assemble(spec: KVSpec, uniform: dict[LayerFormat, ScaleBook]) -> ScaleBook:
    """The ScaleBook of a per-layer spec from uniform books of its layer formats: layer i takes
    its tensors from the book of its own format (the fit of a layer depends on that layer only)."""
    any_book = next(iter(uniform.values()))
    L = any_book.geometry["n_layers"]
    formats = spec.layer_formats(L)
    n_out = max(f.outlier_channels for f in formats)
    t = {k: torch.zeros_like(v) for k, v in any_book.tensors.items() if k != "k_outliers"}
    H = t["k_scale"].shape[1]
    t["k_outliers"] = torch.zeros(L, H, n_out, dtype=torch.int64)
    for i, f in enumerate(formats):
        src = uniform[f].tensors
        for k in t:
            if k == "k_outliers":
                t[k][i, :, : f.outlier_channels] = src[k][i]
            else:
                t[k][i] = src[k][i]
    info = {"method": "per-layer formats: each layer fitted as its own format", "layers": [f.label for f in formats],
            "per_format": {f.label: uniform[f].fit_info for f in dict.fromkeys(formats)}}
    return ScaleBook(spec, any_book.geometry, t, any_book.provenance, info)


log = logging.getLogger("kvcompress")
ASYM_MSE_NOTE = ("asymmetric keys with kv.key.clip=mse: the q.k-score MSE search shrinks each range around its center; on the embedded "
                 "model that gave more KL at 8K than kv.key.clip=minmax (docs/results.md, long8k_asymk_mse; kv=int8k_asym_rotv uses minmax)")


def uniform_spec(spec: KVSpec, f: LayerFormat) -> KVSpec:
    """`spec` with format `f` on every layer (no per-layer tuple)."""
    return mixed_spec(spec, (f,), name=f"{spec.name}:{f.label}").layer(0)


def fit(stats: KVStats, spec: KVSpec) -> ScaleBook:
    """Static key parameters for `spec` from profiled statistics; no model needed."""
    geom = stats.geometry
    if spec.is_auto:
        raise UserError(f"kv={spec.name} has kv.layers={spec.layers}: the tune stage chooses the per-layer formats (add tune to stages)")
    if spec.is_mixed:
        formats = spec.layer_formats(geom["n_layers"])
        return assemble(spec, {f: fit(stats, uniform_spec(spec, f)) for f in dict.fromkeys(formats)})
    spec.check_geometry(geom["head_dim"])
    L, H, D = stats["k_absmax"].shape
    absmax = percentile_half(stats, spec) if spec.key.clip == "percentile" else stats["k_absmax"]
    ranges = channel_ranges(stats["k_min"], stats["k_max"], absmax, spec.key.symmetric)
    outliers = pick_outliers(ranges.half, spec.outlier_channels)
    if uses_arc(stats, spec):
        # asymmetric: each channel's range over every position the model serves, from the pre-RoPE angles (one scale per pair)
        ranges = tie_pair_scales(arc_ranges(stats["k_arcmin"], stats["k_arcmax"], stats["rope_inv_freq"], key_positions(spec, geom),
                                            stats.tensors.get("rope_pairs")), outliers, stats.tensors.get("rope_pairs"))
    elif spec.key.tie_rope_pairs:
        # the rotation-invariant pair-norm bound (symmetric keys; percentile clipping keeps its histogram ranges)
        bound = stats.tensors.get("k_pairmax") if spec.key.symmetric and spec.key.clip != "percentile" else None
        ranges = tie_rope_pairs(ranges, outliers, bound, stats.tensors.get("rope_pairs"))
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
    if uses_arc(stats, spec):
        info["key_ranges"] = (f"asymmetric: each channel's range over positions 0..{key_positions(spec, geom) - 1} from the pre-RoPE angle "
                              "histogram (observers.base.arc_ranges), one scale per RoPE pair, per-channel zero points"
                              + (f" (kv.key.max_position; the model's is {geom['max_position']})" if spec.key.max_position else ""))
        info["key_max_position"] = key_positions(spec, geom)
        if spec.key.clip == "mse":
            info["key_clip_note"] = ASYM_MSE_NOTE
            log.warning("fit: kv=%s: %s", spec.name, ASYM_MSE_NOTE)
    if spec.key.alloc == "waterfill":
        tensors["k_bits"], info["key_bits"] = waterfill_tensors(stats, spec)
    provenance = {**base_provenance(), "stats": stats.header.get("provenance", {})}
    return ScaleBook(spec, geom, tensors, provenance, info)
