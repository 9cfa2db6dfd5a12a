"""Fused projections under the Llama names that the fold, its guards and the checkpoint writers use.

Phi-3 and Phi-4 (Phi3ForCausalLM) have the Llama forward with two matrices fused:
    self_attn.qkv_proj  rows q | k | v   (n_heads*head_dim, n_kv_heads*head_dim, n_kv_heads*head_dim)
    mlp.gate_up_proj    rows gate | up   (Phi3MLP: gate, up = gate_up_proj(x).chunk(2, -1); up * act(gate))
`unfuse` splits them into q_proj/k_proj/v_proj and gate_proj/up_proj when tensors are read from the model.
`fuse` joins them again for anything written or read under the model's own names (the folded HF checkpoint,
the streamed re-measure of a TensorRT-LLM checkpoint). Meta tensors split like real ones.
"""
from __future__ import annotations

import torch

QKV = ("self_attn.qkv_proj.", ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj."))
GATE_UP = ("mlp.gate_up_proj.", ("mlp.gate_proj.", "mlp.up_proj."))


def _parts(name: str) -> tuple[str, list[str]] | None:
    """(which fused group, the names it is made of) for a fused tensor name, else None."""
    for fused, names in (QKV, GATE_UP):
        if fused in name:
            return fused, [name.replace(fused, n) for n in names]
    return None


def parts_of(name: str) -> list[str]:
    """The Llama names a (possibly fused) tensor name stands for."""
    p = _parts(name)
    return [name] if p is None else p[1]


def unfuse(state: dict[str, torch.Tensor], geom) -> dict[str, torch.Tensor]:
    """`state` with fused q/k/v and gate/up tensors split into their Llama-named parts (other tensors shared)."""
    out = {}
    for name, t in state.items():
        p = _parts(name)
        if p is None:
            out[name] = t
            continue
        fused, names = p
        sizes = [geom.n_heads * geom.head_dim, geom.n_kv_heads * geom.head_dim, geom.n_kv_heads * geom.head_dim] if fused == QKV[0] else [t.shape[0] // 2] * 2
        if sum(sizes) != t.shape[0]:
            raise ValueError(f"{name}: {t.shape[0]} rows, expected {' + '.join(map(str, sizes))}")
        out |= dict(zip(names, torch.split(t, sizes, dim=0)))
    return out


def fuse(state: dict[str, torch.Tensor], names) -> dict[str, torch.Tensor]:
    """`state` (Llama names) with the parts of every fused name in `names` joined under that name."""
    out = dict(state)
    for name in names:
        p = _parts(name)
        if p is not None and all(n in out for n in p[1]):
            out[name] = torch.cat([out.pop(n) for n in p[1]], dim=0)
    return out
