"""The custom-tier network's check file and step loops: the export's CPU-oracle decoding kept for the GPU host (the tokens it
fed and the validated decoding's distribution at each step, coarsened to the top tokens plus one bucket), the comparison
of an engine's steps with it, and batched greedy decoding. Part of the network's code (trtllm_network.py): copied into the
plugin bundle with it; imports only the standard library at module level (torch and safetensors inside the functions).
"""
from __future__ import annotations

import json
from pathlib import Path

# the export's network check, kept for the GPU host: the tokens it fed and the validated decoding's distribution at each step
# (CompressedCache through transformers), coarsened to the reference's top CHECK_TOP_K tokens plus one bucket for the rest
CHECK_FILE = "network_check.safetensors"
CHECK_TOP_K = 256


def coarsen(logits, top_k: int | None = None) -> dict:
    """The validated decoding's log-probabilities at each step (logits [T, V] torch), in float64, kept as the top_k tokens'
    (`idx`, `logp`) and the log of the remaining tokens' mass (`rest`; -inf when top_k covers the vocabulary): what
    CHECK_FILE stores."""
    import torch

    lp = torch.log_softmax(logits.double(), -1)
    logp, idx = lp.topk(min(top_k or CHECK_TOP_K, lp.shape[-1]), -1)
    return {"idx": idx.to(torch.int32), "logp": logp, "rest": _rest(lp, idx)}


def _rest(lp, idx):
    """log of the probability mass outside idx, per row (a sum over the other tokens, not 1 minus the top's)."""
    import torch

    others = torch.ones_like(lp, dtype=torch.bool).scatter_(-1, idx.long(), False)
    return torch.logsumexp(lp.masked_fill(~others, float("-inf")), -1)


def coarse_kl(ref: dict, logits):
    """Per-step KL(reference || got) over the reference's top-k tokens and one bucket for the rest (logits [T, V] torch),
    in float64. Merging tokens into one bucket never raises a KL (the log-sum inequality), so this is at most the full KL
    and, with the rest's mass small, close to it: a distribution that passes here cannot be far off the full one on the
    tokens the reference considers likely."""
    import torch

    lq = torch.log_softmax(logits.double(), -1)
    q_top = lq.gather(-1, ref["idx"].long())
    p_rest = ref["rest"].double().exp()
    rest = torch.where(p_rest > 0, p_rest * (ref["rest"].double() - _rest(lq, ref["idx"])), torch.zeros_like(p_rest))
    return (ref["logp"].double().exp() * (ref["logp"].double() - q_top)).sum(-1) + rest


def save_check(path: Path, ids: list[int], ref: dict, meta: dict) -> None:
    """CHECK_FILE: ids [T + 1] int32 (fed one per step; the last is the final step's prediction), the coarsened reference
    [T, ...], and meta (tolerance, the CPU oracle's own coarse KL) in the safetensors header."""
    import torch
    from safetensors.torch import save_file

    tensors = {"ids": torch.tensor(ids, dtype=torch.int32), "idx": ref["idx"].contiguous(), "logp": ref["logp"].double().contiguous(),
               "rest": ref["rest"].double().contiguous()}
    tmp = Path(path).with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={k: json.dumps(v) for k, v in meta.items()})
    tmp.replace(path)


def load_check(path: Path) -> tuple[list[int], dict, dict]:
    """(ids, reference, meta) of a CHECK_FILE."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
        meta = {k: json.loads(v) for k, v in (f.metadata() or {}).items()}
    return t["ids"].tolist(), {k: t[k] for k in ("idx", "logp", "rest")}, meta


def check_against_reference(step, path: Path) -> dict:
    """Feed CHECK_FILE's tokens through step(ids [1], lens [1]) -> logits [1, V] one per call (the engine's generation steps,
    the prompt crossing the fp16 window into the compressed store) and compare each step's distribution with the
    validated decoding's: mean and max coarse KL, top-1 agreement, pass = mean KL <= the export's tolerance."""
    import torch

    ids, ref, meta = load_check(path)
    got = step([ids[0]], [0]).float().reshape(1, -1)
    if int(ref["idx"].max()) >= got.shape[-1]:
        raise ValueError(f"{path} holds token ids up to {int(ref['idx'].max())}, past the engine's vocabulary of {got.shape[-1]}: "
                         f"give the network_check.safetensors of the export this engine was built from")
    got = torch.cat([got] + [step([tok], [t]).float().reshape(1, -1) for t, tok in enumerate(ids[:-1]) if t > 0])
    kl = coarse_kl(ref, got)
    tol = float(meta["kl_tolerance"])
    out = {"tokens": len(ids) - 1, "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
           "top1_agreement": float((got.argmax(-1) == ref["idx"][:, 0].long()).float().mean()), "kl_tolerance": tol,
           "cpu_oracle_kl_mean": meta.get("oracle_kl_mean")}
    return out | {"pass": out["kl_mean"] <= tol}


def greedy_loop(step, seqs: list[list[int]], max_new_tokens: int):
    """Drive a one-token-per-sequence step function: step(ids [B], lens [B]) -> logits [B, V] (torch).
    Each sequence feeds its prompt one token per step, then its own greedy tokens. Returns (the token
    lists, prompt + generated; per-step logits [steps, B, V]). Sequences that finish early keep
    stepping on their last token; those steps' outputs are ignored."""
    import torch

    out = [list(s) for s in seqs]
    pos = [0] * len(seqs)
    history = []
    for _ in range(max(map(len, seqs)) + max_new_tokens - 1):
        feed = [o[p] if p < len(o) else o[-1] for o, p in zip(out, pos)]
        logits = step(feed, list(pos))
        history.append(logits)
        top = logits.argmax(-1).tolist()
        for b, o in enumerate(out):
            if pos[b] == len(o) - 1 and len(o) < len(seqs[b]) + max_new_tokens:
                o.append(int(top[b]))
            pos[b] += 1
    return out, torch.stack(history)
