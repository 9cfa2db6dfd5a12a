"""Show the real structure of a model's keys from kv_stats: outlier channels per layer.

    python -m kvcompress.inspect runs/<model>/<kv>/<time>/kv_stats.safetensors [--top 3]

For every layer and kv-head it lists the channels with the largest |k| and their ratio to the
median channel, in three views: pre-RoPE (the k_proj output), post-RoPE per channel (what is
cached), and post-RoPE per RoPE pair (d, d + D/2) (what a tied scale sees).
"""
from __future__ import annotations

import argparse
import sys

import torch

from kvcompress.errors import UserError
from kvcompress.reference import is_half_split, pair_halves
from kvcompress.stats import KVStats


def top_ratios(absmax: torch.Tensor, top: int) -> list[tuple[int, float]]:
    """absmax: [D] -> [(channel, absmax / median)] for the `top` largest channels (every channel when there are fewer)."""
    med = absmax.median().clamp(min=1e-12)
    vals, idx = absmax.topk(min(top, absmax.numel()))
    return [(int(i), float(v / med)) for v, i in zip(vals, idx)]


def outlier_table(stats: KVStats, top: int = 3) -> list[dict]:
    post = stats["k_absmax"]  # [L, H, D]
    pre = stats["k_prerope_absmax"]
    pairs = torch.maximum(*pair_halves(post, stats.tensors.get("rope_pairs")))  # [L, H, D/2], pair j = the model's own (profile.rope_pairs_of)
    rows = []
    for layer in range(post.shape[0]):
        for head in range(post.shape[1]):
            rows.append(
                {
                    "layer": layer,
                    "kv_head": head,
                    "pre_rope": top_ratios(pre[layer, head], top) if stats.header.get("prerope_observed") else [],
                    "post_rope": top_ratios(post[layer, head], top),
                    "post_rope_pairs": top_ratios(pairs[layer, head], top),
                }
            )
    return rows


def _fmt(entries: list[tuple[int, float]]) -> str:
    return " ".join(f"{c:>3}:{r:5.1f}x" for c, r in entries) or "(not observed)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stats", help="path to kv_stats.safetensors")
    ap.add_argument("--top", type=int, default=3)
    a = ap.parse_args(argv)
    if a.top < 1:
        print(f"kvcompress: error: --top {a.top}: allowed: an integer >= 1 (channels listed per layer and head)", file=sys.stderr)
        return 2
    try:
        stats = KVStats.load(a.stats)
    except UserError as e:
        print(f"kvcompress: error: {e}", file=sys.stderr)
        return 2
    g = stats.geometry
    print(f"key outlier channels: {g['architecture']} ({g['n_layers']} layers, {g['n_kv_heads']} kv heads, head dim {g['head_dim']})")
    pairs = stats.tensors.get("rope_pairs")
    if pairs is None or is_half_split(pairs):
        print("channel:absmax/median-channel; pairs are (d, d+D/2) with d < D/2")
    else:  # the model's own RoPE pairs (profile.rope_pairs_of): pair j is (a[j], b[j])
        print("channel:absmax/median-channel; pair j is the model's own RoPE pair (" + ", ".join(f"{j}=({a},{b})" for j, (a, b) in enumerate(pairs.t().tolist()[:4])) + ", ...)")
    print(f"{'layer':>5} {'head':>4} | {'pre-RoPE channels':<34} | {'post-RoPE channels':<34} | post-RoPE pairs")
    for r in outlier_table(stats, a.top):
        print(f"{r['layer']:>5} {r['kv_head']:>4} | {_fmt(r['pre_rope']):<34} | {_fmt(r['post_rope']):<34} | {_fmt(r['post_rope_pairs'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
