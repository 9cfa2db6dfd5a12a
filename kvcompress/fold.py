"""The exact fold: per-channel factors tied across RoPE pairs, moved into the attention weights.

keys:   k' = k / sigma,  q' = q * sigma   (sigma[d] = sigma[d + D/2], so it commutes with RoPE)
        W_k rows of channel d are divided by sigma[d]; W_q rows of channel d of every query head of
        the kv group are multiplied by sigma[d]. q'.k' = q.k exactly.
values: v' = v / tau,  W_o columns of channel c of every query head of the group times tau[c].
sigma = (range / target) ** strength with target = the layer's shared K/V amax: at strength 1
every key (value) channel spans the whole range of the single per-tensor scale. sigma <= 1, so
the fold only shrinks queries and W_o; the cached K/V never exceed the target: no fp16 overflow.
"""
from __future__ import annotations

import torch

FLOOR = 1e-4  # smallest factor: a dead channel is not blown up by more than 1e4


def fold_factors(absmax: torch.Tensor, target: torch.Tensor, strength: float, tie_pairs: bool) -> torch.Tensor:
    """absmax [L, H, D], target [L] (>= absmax) -> factors [L, H, D] in (0, 1], tied across (d, d + D/2)."""
    a = absmax.float().clamp(min=1e-8)
    if tie_pairs:
        D = a.shape[-1]
        pair = torch.maximum(a[..., : D // 2], a[..., D // 2 :])
        a = torch.cat([pair, pair], -1)
    f = (a / target.float().view(-1, 1, 1)) ** strength
    return f.clamp(min=FLOOR, max=1.0)


@torch.no_grad()
def apply_fold(model, sigma: torch.Tensor | None, tau: torch.Tensor | None) -> None:
    """Fold factors [L, H_kv, D] into a Llama-family model's q/k/v/o projections, in place."""
    from kvcompress.models.observe import attention_modules

    for attn in attention_modules(model):
        L = attn.layer_idx
        g = attn.num_key_value_groups
        if sigma is not None:
            s = sigma[L].to(attn.k_proj.weight)  # [H, D]
            attn.k_proj.weight.div_(s.reshape(-1, 1))
            if attn.k_proj.bias is not None:
                attn.k_proj.bias.div_(s.reshape(-1))
            sq = s.repeat_interleave(g, 0).reshape(-1)  # every query head of the group
            attn.q_proj.weight.mul_(sq.unsqueeze(1))
            if attn.q_proj.bias is not None:
                attn.q_proj.bias.mul_(sq)
        if tau is not None:
            t = tau[L].to(attn.v_proj.weight)
            attn.v_proj.weight.div_(t.reshape(-1, 1))
            if attn.v_proj.bias is not None:
                attn.v_proj.bias.div_(t.reshape(-1))
            attn.o_proj.weight.mul_(t.repeat_interleave(g, 0).reshape(1, -1))
