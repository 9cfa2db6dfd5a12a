"""The exact fold: per-channel factors tied across RoPE pairs, moved into the attention weights.

keys:   k' = k / sigma,  q' = q * sigma   (sigma[d] = sigma[d + D/2], so it commutes with RoPE)
        W_k rows of channel d are divided by sigma[d]; W_q rows of channel d of every query head of
        the kv group are multiplied by sigma[d]. q'.k' = q.k exactly.
values: v' = v / tau,  W_o columns of channel c of every query head of the group times tau[c].
sigma = (range / target) ** strength with target = the layer's shared K/V amax: at strength 1
every key (value) channel spans the whole range of the single per-tensor scale. sigma <= 1, so
the fold only shrinks queries and W_o; the cached K/V never exceed the target: no fp16 overflow.
key pairs (kv.fold_pairs, native_fp8): each RoPE pair (d, d + D/2) of W_k and of W_q is also
        rotated by its own angle (reference.pair_rotate), k' = R k / sigma, q' = R q * sigma; planar
        rotations commute with RoPE's, so q'.k' = q.k exactly. fit may then also shrink a pair's
        keys (sigma up to 2) to move them on FP8's grid; see stages/fit.pair_transforms.
key norms (Qwen3: RMSNorm of each head's q and k before RoPE) undo any scaling of W_q/W_k: the key factors
        go into the q_norm/k_norm weights instead (key_norm_weights), shared by every head, with no rotation.
        Gemma's norms multiply by (1 + w) (norm_offset 1, profile.key_norm_offset): the factors scale 1 + w.
"""
from __future__ import annotations

import torch

from kvcompress.reference import pair_halves, pair_rotate, pair_spread

FLOOR = 1e-4  # smallest factor: a dead channel is not blown up by more than 1e4
OFFSET_FLOOR = 0.5  # smallest key factor in a (1 + w) norm weight: q_norm's stored w' = (1 + w) * sigma - 1 keeps its
                    # effective weight to within twice the model's own rounding in the export dtype (a smaller sigma loses bits)


def fold_factors(absmax: torch.Tensor, target: torch.Tensor, strength: float, tie_pairs: bool, pairs: torch.Tensor | None = None,
                 floor: float = FLOOR) -> torch.Tensor:
    """absmax [L, H, D], target [L] (>= absmax) -> factors [L, H, D] in [floor, 1], tied across each RoPE pair
    (reference.rope_pairs; None: (d, d + D/2))."""
    a = absmax.float().clamp(min=1e-8)
    if tie_pairs:
        a = pair_spread(torch.maximum(*pair_halves(a, pairs)), pairs)
    f = (a / target.float().view(-1, 1, 1)) ** strength
    return f.clamp(min=floor, max=1.0)


def absorb_kv_scale(sigma: torch.Tensor, tau: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold factors [L, H, D] with each layer's per-tensor KV dequant scale `scale` [L] moved into them: keys and values are
    divided by it too, so the cache holds x / (fold * s), what the per-tensor quantizer saw, and the stored scale becomes 1.0.
    For servers that read no stored KV scale and quantize at 1.0 (targets.hf_ckpt.KV_SCALES_UNREAD); q.k and the attention
    output are unchanged (the fold is exact for any factors), and FP8 at scale 1.0 rounds what FP8 at scale s rounded."""
    s = scale.float().view(-1, 1, 1)
    return sigma * s, tau * s


@torch.no_grad()
def apply_fold(model, sigma: torch.Tensor | None, tau: torch.Tensor | None, rot: torch.Tensor | None = None) -> None:
    """Fold factors [L, H_kv, D] (and key pair angles rot [L, H_kv, D/2]) into a Llama-family model's q/k/v/o projections, in place.

    The same arithmetic as the export (fold_state_dict), loaded back into the model: tests of the
    fold's exactness therefore test what is exported. The key norm's offset is probed from the model.
    """
    from kvcompress.models.base import Geometry
    from kvcompress.models.fused import fuse, unfuse
    from kvcompress.stages.profile import key_norm_offset

    geom = Geometry.from_hf_config(model.config)
    own = {k: v.detach() for k, v in model.state_dict().items()}
    model.load_state_dict(fuse(fold_state_dict(unfuse(own, geom), geom, sigma, tau, rot, key_norm_offset(model)), own))


def guard_factors(state: dict, geom, sigma: torch.Tensor, dtype: torch.dtype, margin: float = 16.0, norm_offset: float = 0.0) -> tuple[torch.Tensor, dict]:
    """Raise key fold factors where the folded weights would leave `dtype`'s normal range.

    W_k rows are divided by sigma (<= 1; < 2 after a fold_pairs shrink) and must stay below finfo.max / margin; W_q rows are
    multiplied by sigma and their largest element must stay above 16 * finfo.tiny (not flushed
    towards zero, not into the subnormal range). Factors stay tied across RoPE pairs. Returns the guarded
    factors and {"raised": count, "layers": [...]} (the export records it; the re-measurement of
    the written checkpoint covers any change). `state` needs only the q/k weights of each layer.
    """
    out = sigma.clone()
    raised, layers = 0, []
    for L in range(sigma.shape[0]):
        out[L], n = guard_layer(state, geom, L, sigma[L], dtype, margin, norm_offset)
        if n:
            raised += n
            layers.append(L)
    return out, {"raised": raised, "layers": layers}


def guard_layer(state: dict, geom, L: int, sigma_l: torch.Tensor, dtype: torch.dtype, margin: float = 16.0,
                norm_offset: float = 0.0) -> tuple[torch.Tensor, int]:
    """guard_factors for one layer: (guarded factors [H, D], how many were raised). Key norms with an offset
    (Gemma's 1 + w) also keep every factor >= OFFSET_FLOOR (fit's factors already do)."""
    fi = torch.finfo(dtype)
    D, H = geom.head_dim, geom.n_kv_heads
    g = geom.n_heads // H
    p = f"model.layers.{L}.self_attn."
    if p + "k_norm.weight" in state:  # the factors live in the q/k norm weights (key_norm_weights): one [D] weight, or one per head
        wk, wq = ((state[p + n].float() + norm_offset).abs() for n in ("k_norm.weight", "q_norm.weight"))
        wk = wk.expand(H, D) if wk.numel() == D else wk.view(H, D)
        wq = wq.expand(H, D) if wq.numel() == D else wq.view(H, g, D).amin(1)
    else:
        wk = state[p + "k_proj.weight"].float().abs().amax(1).view(H, D)  # [H, D] row max
        wq = state[p + "q_proj.weight"].float().abs().amax(1).view(H, g, D).amin(1)  # smallest row max of the group
    lo_over = wk * margin / fi.max  # sigma >= this keeps W_k / sigma finite
    lo_under = fi.tiny * 16.0 / wq.clamp(min=fi.tiny)  # sigma >= this keeps W_q * sigma normal
    lo = torch.maximum(lo_over, lo_under)
    if norm_offset and p + "k_norm.weight" in state:
        lo = lo.clamp(min=OFFSET_FLOOR)
    lo = torch.maximum(lo[:, : D // 2], lo[:, D // 2 :]).repeat(1, 2)  # tied pairs
    new = torch.maximum(sigma_l, lo.clamp(max=1.0))  # a raised factor stays <= 1; a pair shrink's sigma > 1 is kept
    return new, int((new > sigma_l).sum())


@torch.no_grad()
def fold_state_dict(state: dict, geom, sigma: torch.Tensor | None, tau: torch.Tensor | None, rot: torch.Tensor | None = None,
                    norm_offset: float = 0.0) -> dict:
    """A new state dict with the factors folded into q/k/v/o (float32 math); other tensors are shared, not copied."""
    out = dict(state)
    for L in range(geom.n_layers):
        out.update(fold_layer(state, geom, L, sigma, tau, rot, norm_offset))
    return out


def _rotate_rows(w: torch.Tensor, angles: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows (or bias entries) of a q/k projection with each head's RoPE pairs rotated: w [heads*D, ...],
    angles [heads, D/2]. Row d of head h is output channel d, so rotating the rows rotates the output."""
    wf = w.float()
    x = wf.reshape(heads, -1, *wf.shape[1:]).movedim(1, -1)  # [heads, ..., D]
    a = angles.float().reshape(heads, *([1] * (x.dim() - 2)), -1)
    return pair_rotate(x, a).movedim(-1, 1).reshape(wf.shape)


@torch.no_grad()
def fold_layer(state: dict, geom, L: int, sigma: torch.Tensor | None, tau: torch.Tensor | None, rot: torch.Tensor | None = None,
               norm_offset: float = 0.0) -> dict:
    """The folded q/k/v/o tensors of layer L (float32); `state` needs only that layer's tensors.
    rot [L, H_kv, D/2]: key pair angles (None or all zero: no rotation); norm_offset: the key norm's
    (profile.key_norm_offset: 1 for Gemma's 1 + w)."""
    out = {}
    g = geom.n_heads // geom.n_kv_heads
    p = f"model.layers.{L}.self_attn."
    if sigma is not None and p + "k_norm.weight" in state:
        out |= key_norm_weights(state, p, sigma[L], g, rot is not None and bool(rot[L].any()), norm_offset)
    elif sigma is not None:
        s = sigma[L].reshape(-1).float()  # [H*D]
        sq = sigma[L].repeat_interleave(g, 0).reshape(-1).float()  # every query head of the group
        names = ["k_proj.weight", "q_proj.weight"] + (["k_proj.bias", "q_proj.bias"] if p + "k_proj.bias" in state else [])
        src = {n: state[p + n].float() for n in names}
        if rot is not None and bool(rot[L].any()):
            ra = {"k": rot[L], "q": rot[L].repeat_interleave(g, 0)}
            src = {n: _rotate_rows(w, ra[n[0]], ra[n[0]].shape[0]) for n, w in src.items()}
        out[p + "k_proj.weight"] = src["k_proj.weight"] / s[:, None]
        out[p + "q_proj.weight"] = src["q_proj.weight"] * sq[:, None]
        if p + "k_proj.bias" in state:
            out[p + "k_proj.bias"] = src["k_proj.bias"] / s
            out[p + "q_proj.bias"] = src["q_proj.bias"] * sq
    if tau is not None:
        t = tau[L].reshape(-1).float()
        out[p + "v_proj.weight"] = state[p + "v_proj.weight"].float() / t[:, None]
        if p + "v_proj.bias" in state:
            out[p + "v_proj.bias"] = state[p + "v_proj.bias"].float() / t
        out[p + "o_proj.weight"] = state[p + "o_proj.weight"].float() * tau[L].repeat_interleave(g, 0).reshape(1, -1).float()
    return out


def key_norm_weights(state: dict, p: str, sigma_l: torch.Tensor, g: int, rotated: bool, norm_offset: float = 0.0) -> dict:
    """The key factors of a model that normalises each head's keys before RoPE (Qwen3's q_norm/k_norm; a
    standard RMSNorm weight): k' = k / sigma is k_norm's weight divided by sigma, q' = q * sigma is q_norm's
    times sigma; scaling W_k instead would be undone by the norm. A weight of head_dim serves every head, so
    the factors must be the same for every head (fit makes them so: profile.key_norm "shared"); a weight over
    all heads (OLMo 2) takes per-head factors. No RoPE-pair rotation can live in an elementwise weight. A norm that
    multiplies by (w + norm_offset) (Gemma: 1 + w) gets w' = (w + offset) / sigma - offset (keys) and
    (w + offset) * sigma - offset (queries)."""
    if rotated:
        raise ValueError(f"{p}k_norm: RoPE-pair rotations cannot be folded into a key norm's weight")
    H, D = sigma_l.shape
    off = float(norm_offset)
    wk, wq = state[p + "k_norm.weight"].float() + off, state[p + "q_norm.weight"].float() + off
    if wk.numel() == D:
        if not torch.equal(sigma_l, sigma_l[:1].expand(H, D)):
            raise ValueError(f"{p}k_norm: one weight serves every head, but the key factors differ between heads")
        return {p + "k_norm.weight": wk / sigma_l[0].float() - off, p + "q_norm.weight": wq * sigma_l[0].float() - off}
    return {p + "k_norm.weight": wk / sigma_l.reshape(-1).float() - off, p + "q_norm.weight": wq * sigma_l.repeat_interleave(g, 0).reshape(-1).float() - off}


def check_range(state: dict, dtype: torch.dtype) -> list[str]:
    """Names of floating tensors that overflow `dtype` or have a row that rounds to all zeros."""
    bad = []
    fi = torch.finfo(dtype)
    for k, v in state.items():
        if not v.is_floating_point() or v.dim() != 2 or not k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")):
            continue
        c = v.to(dtype)
        if not torch.isfinite(c).all() or v.float().abs().max() > fi.max:
            bad.append(f"{k}: overflows {dtype}")
        elif ((c == 0).all(1) & (v != 0).any(1)).any():
            bad.append(f"{k}: a row flushes to zero in {dtype}")
    return bad
