"""Memory planner: concurrent sequences and maximum context, fp16 vs compressed cache.

free = gpu_mem * (1 - reserve) - n_params * weight_bytes_per_param;  a sequence of C tokens needs
sum(reference.cache_nbytes(C)) per-sequence bytes (static scales are paid once).
"""
from __future__ import annotations

from kvcompress import reference as ref
from kvcompress.models.base import Geometry

# Published configs (config.json of Llama-3.1-70B and Llama-3.1-8B); used only for planning.
KNOWN = {
    "llama70b": (Geometry(80, 64, 8, 128, 8192, 128256, 131072, 500000.0, "LlamaForCausalLM"), 70.55e9),
    "llama3_8b": (Geometry(32, 32, 8, 128, 4096, 128256, 131072, 500000.0, "LlamaForCausalLM"), 8.03e9),
}
MAX_SEARCH_TOKENS = 1 << 26


def _seq_bytes(spec, geom: Geometry, n_tokens: int) -> tuple[int, int]:
    b = ref.spec_cache_nbytes(spec, geom, n_tokens)
    return sum(v for k, v in b.items() if k != "static"), b.get("static", 0)


def plan(spec, geom: Geometry, n_params: float, cfg, context: int) -> dict:
    """Capacity of one GPU for `spec` at `context` tokens per sequence, and max context at cfg.batch."""
    batch = cfg.batch
    free = cfg.gpu_mem_gb * 1e9 * (1 - cfg.reserve_frac) - n_params * cfg.weight_bytes_per_param
    per_seq, static = _seq_bytes(spec, geom, context)
    budget = free - static
    max_seqs = int(budget // per_seq) if budget > 0 else 0
    lo, hi = 0, MAX_SEARCH_TOKENS  # largest C with batch * bytes(C) <= budget (bytes(C) is monotone)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if batch * _seq_bytes(spec, geom, mid)[0] <= budget:
            lo = mid
        else:
            hi = mid - 1
    return {
        "context": context,
        "bytes_per_seq": per_seq,
        "max_concurrent_seqs": max_seqs,
        "batch": batch,
        "max_context_tokens": lo,
        "max_context_within_model_limit": min(lo, geom.max_position),
    }


def plan_pair(baseline_spec, spec, geom: Geometry, n_params: float, cfg) -> dict:
    """fp16 vs compressed for each planned context."""
    rows = []
    for ctx in cfg.contexts:
        f = plan(baseline_spec, geom, n_params, cfg, ctx)
        c = plan(spec, geom, n_params, cfg, ctx)
        ratio = c["max_concurrent_seqs"] / f["max_concurrent_seqs"] if f["max_concurrent_seqs"] else None
        rows.append({"context": ctx, "fp16": f, "compressed": c, "capacity_multiplier": ratio})
    return {
        "gpu": cfg.gpu_name,
        "gpu_mem_gb": cfg.gpu_mem_gb,
        "reserve_frac": cfg.reserve_frac,
        "weight_bytes_per_param": cfg.weight_bytes_per_param,
        "weights_gb": n_params * cfg.weight_bytes_per_param / 1e9,
        "rows": rows,
    }
