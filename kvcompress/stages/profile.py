"""profile: run calibration windows through the model and stream KVStats (post-RoPE K/V)."""
from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from kvcompress.data import TextSet, token_windows
from kvcompress.models.base import LoadedModel
from kvcompress.models.streaming import Pass
from kvcompress.models.observe import ObservingCache, attention_hook, prerope_key_hooks
from kvcompress.provenance import base_provenance
from kvcompress.stats import KVStats, StatsAccumulator


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
    acc = StatsAccumulator(g.n_layers, g.n_heads, g.n_kv_heads, g.head_dim, calib.sample_tokens, rotary_dim(lm.model, g))
    per_row = math.ceil(calib.sample_tokens / calib.n_samples) if calib.sample_tokens else 0
    gen = torch.Generator().manual_seed(calib.seed)
    batches = [windows[lo : lo + calib.batch_size] for lo in range(0, windows.shape[0], calib.batch_size)]
    positions = [sample_positions(b.shape[0], b.shape[1], per_row, gen) if per_row else None for b in batches]

    def before_batch(i: int) -> None:
        if positions[i] is not None:
            acc.set_sample_positions(*positions[i])

    with prerope_key_hooks(lm.model, acc.observe_prerope_k):
        if lm.streamer is not None:  # layer by layer from the checkpoint: every batch through layer 0, then layer 1, ...
            p = Pass(kwargs=lambda i: {"cache": ObservingCache(g.n_layers, acc.observe_kv), "use_cache": True}, context=lambda: attention_hook(lm.model, acc.observe_q))
            lm.streamer.run(batches, [p], before_batch=before_batch, progress=progress, desc="profile")
        else:
            with attention_hook(lm.model, acc.observe_q):
                for i, ids in enumerate(tqdm(batches, desc="profile", unit="batch", disable=not progress)):
                    before_batch(i)
                    lm.model(input_ids=ids.to(lm.device), cache=ObservingCache(g.n_layers, acc.observe_kv), use_cache=True, logits_to_keep=1)
    inv_freq = rope_inv_freq(lm.model, g)
    if inv_freq is not None:
        acc.t["rope_inv_freq"] = inv_freq  # lets fit rotate keys to other positions
    header = {
        "geometry": g.to_dict(),
        "key_norm": key_norm(lm.model, g),
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


KEY_NORMS = ("none", "shared", "per_head")


def key_norm(model, g) -> str:
    """Where an exact key fold can live. "none": the keys are the k projection's output, so factors and RoPE-pair
    rotations fold into W_q/W_k. A norm on each head's keys before RoPE (Qwen3, Gemma 3, OLMo 2: k_norm) undoes any
    scaling of W_k, so a factor must go into the norms' weights instead, and no rotation can (an elementwise weight
    does not commute with one): "shared" when one weight of head_dim serves every head (Qwen3, Gemma 3: the
    factors must be the same for every head), "per_head" when the weight spans all heads (OLMo 2)."""
    norm = next((m for n, m in model.named_modules() if n.split(".")[-1] in ("k_norm", "k_layernorm")), None)
    if norm is None:
        return "none"
    w = getattr(norm, "weight", None)
    return "per_head" if w is not None and w.numel() == g.n_kv_heads * g.head_dim and g.n_kv_heads > 1 else "shared"


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
