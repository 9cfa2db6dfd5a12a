"""profile: run calibration windows through the model and stream KVStats (post-RoPE K/V)."""
from __future__ import annotations

import logging
import math
import sys

import torch

from kvcompress.data import TextSet, token_windows
from kvcompress.models.base import LoadedModel
from kvcompress.models.streaming import Pass, run_passes
from kvcompress.models.observe import ObservingCache, attention_hook, prerope_key_hooks
from kvcompress.provenance import base_provenance
from kvcompress.reference import rope_pairs
from kvcompress.stats import KVStats, StatsAccumulator

log = logging.getLogger("kvcompress")


def sample_positions(n_rows: int, seq_len: int, per_row: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """per_row distinct random positions in [1, seq_len) for each of n_rows rows: (rows, pos) [n]."""
    per_row = min(per_row, seq_len - 1)
    pos = torch.stack([torch.randperm(seq_len - 1, generator=gen)[:per_row] + 1 for _ in range(n_rows)])
    rows = torch.arange(n_rows).repeat_interleave(per_row)
    return rows, pos.flatten()


@torch.no_grad()
def profile(lm: LoadedModel, calib, texts: TextSet, progress: bool = True) -> KVStats:
    """Stream statistics of the K/V the model caches over calibration windows -> KVStats."""
    g = lm.geometry
    windows = token_windows(lm.tokenizer, texts, calib.n_samples, calib.seq_len, seed=calib.seed)  # [N, T]
    inv_freq = rope_inv_freq(lm.model, g)
    acc = StatsAccumulator(g.n_layers, g.n_heads, g.n_kv_heads, g.head_dim, calib.sample_tokens, rope_pairs_of(lm.model, g), inv_freq)
    per_row = math.ceil(calib.sample_tokens / calib.n_samples) if calib.sample_tokens else 0
    gen = torch.Generator().manual_seed(calib.seed)
    batches = [windows[lo : lo + calib.batch_size] for lo in range(0, windows.shape[0], calib.batch_size)]
    positions = [sample_positions(b.shape[0], b.shape[1], per_row, gen) if per_row else None for b in batches]

    def before_batch(i: int) -> None:
        if positions[i] is not None:
            acc.set_sample_positions(*positions[i])

    # in memory batch by batch, or streamed layer by layer from the checkpoint (every batch through layer 0, then layer 1, ...)
    p = Pass(kwargs=lambda i: {"cache": ObservingCache(g.n_layers, acc.observe_kv), "use_cache": True}, context=lambda: attention_hook(lm.model, acc.observe_q))
    with prerope_key_hooks(lm.model, acc.observe_prerope_k):
        run_passes(lm, batches, [p], None, progress=progress, desc="profile", before_batch=before_batch)
    if inv_freq is not None:
        acc.t["rope_inv_freq"] = inv_freq  # lets fit rotate keys to other positions
    header = {
        "geometry": g.to_dict(),
        "key_norm": key_norm(lm.model, g),
        "key_norm_offset": key_norm_offset(lm.model),
        "fold_obstacles": fold_obstacles(lm.model),
        "provenance": {
            **base_provenance(),
            "model": lm.identity,
            "calib": {
                "origin": texts.origin,
                "sha256": texts.sha256,
                "n_samples": int(windows.shape[0]),
                "seq_len": int(windows.shape[1]),
                "tokens": int(windows.numel()),
                "seed": calib.seed,
            },
        },
    }
    return acc.finish(header)


def rotary_dim(model, g) -> int:
    """Channels per head the model's RoPE rotates: twice its inverse frequencies (the rotary module transformers
    built, wherever the model keeps it); head_dim when it has none. Fewer than head_dim (Phi, GPT-NeoX): partial
    rotary, whose pairs are (i, i + rotary_dim/2) (reference.rope_pairs; the stats record them)."""
    rotary = next((m for n, m in model.named_modules() if n.split(".")[-1] == "rotary_emb"), None)
    if rotary is None:
        return g.head_dim
    inv = getattr(rotary, "inv_freq", None)
    if inv is None:  # per layer type (Gemma 3): every type rotates the same channels
        inv = next((getattr(rotary, f"{t}_inv_freq") for t in getattr(model.config, "layer_types", None) or ()
                    if getattr(rotary, f"{t}_inv_freq", None) is not None), None)
    return g.head_dim if inv is None else 2 * inv.numel()


def key_norm(model, g) -> str:
    """Where an exact key fold can live. "none": the keys are the k projection's output, so factors and RoPE-pair
    rotations fold into W_q/W_k. A norm on each head's keys before RoPE (Qwen3, Gemma 3, OLMo 2: k_norm) undoes any
    scaling of W_k, so a factor must go into the norms' weights instead, and no rotation can (an elementwise weight
    does not commute with one): "shared" when one weight of head_dim serves every head (Qwen3, Gemma 3: the
    factors must be the same for every head), "per_head" when the weight spans all heads (OLMo 2)."""
    norm = _key_norm_module(model)
    if norm is None:
        return "none"
    w = getattr(norm, "weight", None)
    return "per_head" if w is not None and w.numel() == g.n_kv_heads * g.head_dim and g.n_kv_heads > 1 else "shared"


# the per-head q/k norms the key fold knows (before RoPE: fold.key_norm_weights folds into their weights)
KEY_NORMS = ("k_norm", "k_layernorm")  # per-head key norms before RoPE (Qwen3, Gemma 3; Cohere): the fold's key factors go into them
PRE_ROPE_NORMS = ("q_norm", "q_layernorm", *KEY_NORMS)
# a norm on the attention output before o_proj (BitNet's attn_sub_norm): undoes the value factors folded into W_v / W_o
OUTPUT_NORMS = ("attn_sub_norm", "sub_norm", "o_norm")


def fold_obstacles(model) -> dict[str, str]:
    """Which of the native fold's two halves the model's attention cannot take exactly, with why: {"keys": ..., "values": ...}
    (a side absent: its fold is exact). Any other norm inside the attention module sits where the fold cannot follow it: a
    norm of q and k after RoPE (Llama 4's weightless qk_norm, HunYuan's query/key_layernorm) renormalises the scaled keys;
    a norm of the attention output (BitNet's attn_sub_norm) renormalises the scaled values. fit then folds only the other side
    (tests/test_architectures.py: the logits move by > 1e-2 with the blocked side folded, stay with the rest)."""
    attn = next((m for n, m in model.named_modules() if n.split(".")[-1] in ("self_attn", "attention", "attn") and hasattr(m, "k_proj")), None)
    out: dict[str, str] = {}
    for name, m in (attn.named_children() if attn is not None else ()):
        if "norm" not in type(m).__name__.lower() or name in PRE_ROPE_NORMS:
            continue
        side = "values" if name in OUTPUT_NORMS else "keys"
        where = "the attention output before o_proj" if side == "values" else "the queries and keys after RoPE"
        out.setdefault(side, f"{type(attn).__name__}.{name} ({type(m).__name__}) normalises {where}, which undoes folded {side[:-1]} factors")
    return out


def _key_norm_module(model):
    """The model's first per-head key norm module (k_norm; Cohere's k_layernorm), or None."""
    return next((m for n, m in model.named_modules() if n.split(".")[-1] in KEY_NORMS), None)


@torch.no_grad()
def key_norm_offset(model) -> float:
    """The constant the key norm adds to its weight: 0.0 for a standard RMSNorm (y = x / rms(x) * w: Llama's, Qwen3's),
    1.0 for Gemma's (y = x / rms(x) * (1 + w)); 0.0 without a key norm. Found by probing the model's own k_norm with a
    row of +-100 (mean 0, rms 100 >> eps, so an RMSNorm and a LayerNorm both see x / rms(x) = +-1) through a float32 CPU
    copy of it whose parameters are zero (a streamed model's are on the meta device): the output times the sign is
    the offset. The key fold scales the effective weight (w + offset), so it must know it (fold.key_norm_weights)."""
    import copy

    norm = _key_norm_module(model)
    w = getattr(norm, "weight", None)
    if w is None:
        return 0.0
    probe = copy.deepcopy(norm).to_empty(device="cpu").float()
    for p in probe.parameters():
        p.zero_()
    sign = torch.ones(w.shape[-1])
    sign[1::2] = -1
    x = (100.0 * sign).expand(1, *w.shape)
    return round(float((probe(x).float() * sign).mean()), 3)


_ASSUMED: set[str] = set()  # model classes whose RoPE layout was assumed (warned once each)


def _assumed(model, default: torch.Tensor, why: str) -> torch.Tensor:
    """rope_pairs_of's fallback: the half-split pairs, with a warning (once per model class) that they were assumed."""
    name = type(model).__name__
    if name not in _ASSUMED:
        _ASSUMED.add(name)
        log.warning("profile: %s's RoPE could not be read (%s); assuming it rotates channel pairs (i, i + rotary_dim/2), as Llama does. "
                    "If it pairs channels otherwise, tied key scales may not bound keys at unseen positions and the fold may not be exact "
                    "(the export's re-measurement would catch an inexact fold)", name, why)
    return default


def rope_pairs_of(model, g) -> torch.Tensor:
    """[2, D/2]: the channels each RoPE pair of the model rotates together, found by probing the model's own RoPE:
    its rotary module's cos/sin at position 1 and its modeling code's apply_rotary_pos_emb applied to the unit
    vectors of the rotated channels. Each unit vector comes out on its own channel and its partner's. This reads
    the half-split layout (Llama, Qwen: (i, i + r/2)), the interleaved one (Cohere, GLM, ERNIE: (2i, 2i + 1)) and
    partial rotary (r < D: the rotated channels first) alike. Pairs are ordered by their first channel (pair j
    turns at the rotary module's inv_freq[j] in both layouts); the pass-through channels follow, paired among
    themselves (reference.rope_pairs). Without a recognisable RoPE: reference.rope_pairs(D, rotary_dim)."""
    D, r = g.head_dim, rotary_dim(model, g)
    default = rope_pairs(D, r)
    rotary = next((m for n, m in model.named_modules() if n.split(".")[-1] == "rotary_emb"), None)
    attn = next((m for n, m in model.named_modules() if n.split(".")[-1] in ("self_attn", "attention", "attn")), None)
    fn = getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None) if attn is not None else None
    if rotary is None or fn is None:
        return default
    try:
        x = torch.eye(r, dtype=torch.float32)[None, None]  # [1, 1 head, r tokens, r]: token t is the unit vector e_t
        pos = torch.ones(1, r, dtype=torch.long)
        try:
            cos, sin = rotary(x, pos)
        except TypeError:  # per layer type (Gemma 3): every type rotates the same channels
            cos, sin = rotary(x, pos, layer_type=(getattr(model.config, "layer_types", None) or ["full_attention"])[0])
        out = fn(x, x, cos.float(), sin.float())[0][0, 0].cpu()  # row t: e_t turned by RoPE
    except Exception as e:  # a RoPE this probe cannot drive: the half-split default, said once per model class
        return _assumed(model, default, f"probing it raised {type(e).__name__}: {str(e)[:120]}")
    if out.is_meta:  # a streamed model's empty rotary module: nothing to probe (its config's layout is the default's)
        return default
    if out.shape != (r, r):
        return _assumed(model, default, f"its output has shape {tuple(out.shape)}, not ({r}, {r})")
    off = (out != 0) & ~torch.eye(r, dtype=torch.bool)
    if not bool((off.sum(1) == 1).all()):
        return _assumed(model, default, "it does not turn each channel with exactly one partner")
    partner = off.float().argmax(1)
    if not torch.equal(partner[partner], torch.arange(r)):
        return _assumed(model, default, "its channel partners are not mutual")
    first = torch.nonzero(torch.arange(r) < partner).flatten()
    pairs = torch.stack([first, partner[first]])
    return torch.cat([pairs, default[:, r // 2 :]], 1) if r < D else pairs


def rope_inv_freq(model, g) -> torch.Tensor | None:
    """The model's RoPE inverse frequencies per pair of reference.rope_pairs: [D/2], or [L, D/2] when layer types
    use different RoPE bases (Gemma 3: local and global layers); a partial-rotary model's pass-through pairs get 0
    (they never turn). None when the model has no standard rotary."""
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None:
        return None
    inv = getattr(rotary, "inv_freq", None)
    if inv is not None:
        inv = inv.detach().float().cpu().flatten()
        if inv.numel() < g.head_dim // 2 and inv.numel() == rotary_dim(model, g) // 2:  # partial rotary
            inv = torch.cat([inv, inv.new_zeros(g.head_dim // 2 - inv.numel())])
        return inv if inv.numel() == g.head_dim // 2 else None
    types = getattr(model.config, "layer_types", None)
    per = [getattr(rotary, f"{t}_inv_freq", None) for t in types] if types else []
    if per and all(p is not None and p.numel() == g.head_dim // 2 for p in per):
        return torch.stack([p.detach().float().cpu() for p in per])
    return None
