"""Quality metrics of compressed vs baseline next-token distributions on the same tokens."""
from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from typing import ContextManager
from dataclasses import dataclass, field

import torch

KL_POSITION_BIN = 64  # KL-vs-position curve resolution (tokens)
BUCKET_EDGES = (0, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 1 << 62)  # position buckets of the report


def position_bucket(pos: torch.Tensor) -> torch.Tensor:
    """Bucket index of each position: [0, 1K) -> 0, [1K, 2K) -> 1, [2K, 4K) -> 2, ..."""
    return torch.bucketize(pos, torch.tensor(BUCKET_EDGES[1:], device=pos.device), right=True)


@dataclass
class QualityAccumulator:
    """Streams (baseline logits, compressed logits, targets) windows into the report metrics."""

    nll_base: float = 0.0
    nll_comp: float = 0.0
    n: int = 0
    top1_agree: int = 0
    kl_values: list = field(default_factory=list)
    kl_pos_sum: dict = field(default_factory=dict)
    kl_pos_n: dict = field(default_factory=dict)
    buckets: dict = field(default_factory=dict)  # bucket -> [tokens, nll_base, nll_comp, kl_sum]

    def update_logprobs(self, lb: torch.Tensor, lc: torch.Tensor, ids: torch.Tensor, start: int = 0) -> None:
        """lb, lc: [B, n, V] next-token log-probabilities at positions start..start+n-1 (whole windows: start 0,
        n = T-1); ids: [B, T]."""
        tgt = ids[:, start + 1 : start + 1 + lb.shape[1]].unsqueeze(-1)
        self.nll_base += float(-lb.gather(-1, tgt).double().sum())  # double sums: blocks of positions add up as whole windows
        self.nll_comp += float(-lc.gather(-1, tgt).double().sum())
        self.n += tgt.numel()
        self.top1_agree += int((lb.argmax(-1) == lc.argmax(-1)).sum())
        kl = kl_per_position(lb, lc)  # [B, T-1]  KL(base || comp)
        self.kl_values.append(kl.flatten().double())
        nb, nc = -lb.gather(-1, tgt).squeeze(-1), -lc.gather(-1, tgt).squeeze(-1)  # [B, T-1]
        pb = position_bucket(torch.arange(start + 1, start + kl.shape[1] + 1))  # position of the predicted token
        for b in pb.unique().tolist():
            m = pb == b
            acc = self.buckets.setdefault(b, [0, 0.0, 0.0, 0.0])
            acc[0] += int(m.sum()) * kl.shape[0]
            acc[1] += float(nb[:, m].double().sum())
            acc[2] += float(nc[:, m].double().sum())
            acc[3] += float(kl[:, m].double().sum())
        pos_bin = (start + torch.arange(kl.shape[1])) // KL_POSITION_BIN
        for b in pos_bin.unique().tolist():
            sel = kl[:, pos_bin == b]
            self.kl_pos_sum[b] = self.kl_pos_sum.get(b, 0.0) + float(sel.double().sum())
            self.kl_pos_n[b] = self.kl_pos_n.get(b, 0) + sel.numel()

    def result(self) -> dict:
        kl = torch.cat(self.kl_values) if self.kl_values else torch.zeros(1, dtype=torch.float64)
        ppl_b = math.exp(self.nll_base / max(1, self.n))
        ppl_c = math.exp(self.nll_comp / max(1, self.n))
        return {
            "tokens": self.n,
            "ppl_baseline": ppl_b,
            "ppl_compressed": ppl_c,
            "ppl_delta": ppl_c - ppl_b,
            "ppl_delta_rel": (ppl_c - ppl_b) / ppl_b,
            "kl_mean": float(kl.mean()),
            "kl_se": float(kl.std() / math.sqrt(kl.numel())) if kl.numel() > 1 else 0.0,  # standard error of kl_mean
            "kl_p99": float(torch.quantile(kl.float(), 0.99)) if kl.numel() > 1 else float(kl.max()),
            "kl_max": float(kl.max()),
            "top1_agree": self.top1_agree / max(1, self.n),
            "kl_by_position": [
                {"start": b * KL_POSITION_BIN + 1, "kl_mean": self.kl_pos_sum[b] / self.kl_pos_n[b]} for b in sorted(self.kl_pos_sum)
            ],
            "by_position": [
                {"start": BUCKET_EDGES[b], "end": BUCKET_EDGES[b + 1], "tokens": n, "kl_mean": k / n, "ppl_baseline": math.exp(x / n),
                 "ppl_compressed": math.exp(y / n), "ppl_delta_rel": math.exp((y - x) / n) - 1}
                for b, (n, x, y, k) in sorted(self.buckets.items())
            ],
        }


def kl_per_position(lb: torch.Tensor, lc: torch.Tensor) -> torch.Tensor:
    """KL(base || compressed) of each position's next-token distribution from log-probabilities [..., V]."""
    return (lb.exp() * (lb - lc)).sum(-1).clamp(min=0)


LOGPROB_BLOCK_BYTES = 256 << 20  # float32 log-probabilities formed at once (a block of positions); bounds the temporaries


def blocks(n: int, step: int):
    """(lo, hi) of consecutive blocks of at most `step` positions covering 0..n."""
    return ((lo, min(n, lo + step)) for lo in range(0, n, step))


def position_block(batch: int, vocab: int) -> int:
    """Positions per block so that a block's [batch, positions, vocab] float32 takes at most LOGPROB_BLOCK_BYTES: at
    8K context a 262K vocabulary (Gemma 3) would otherwise hold several 8.6 GB temporaries at once."""
    return max(1, LOGPROB_BLOCK_BYTES // (4 * batch * vocab))


@dataclass
class Baseline:
    """The unquantized model's final-normed hidden states of each batch of windows and its head: what validate keeps
    for export's re-measurement. Hidden states, not log-probabilities: [N, T, hidden] is small where [N, T, V] is not
    (17 GB for Llama 3's vocabulary at 4 x 8K tokens); logits are formed a block of positions at a time (score_hidden)."""

    windows: torch.Tensor  # [N, T] token ids
    hidden: list  # per batch of windows, [B, T, hidden] on the CPU
    head: Callable[[torch.Tensor], torch.Tensor]  # final-normed hidden [B, n, hidden] (any device) -> float32 logits [B, n, V]
    vocab: int
    phase: Callable[[], ContextManager] = nullcontext  # held around scoring: a streamed head keeps its rows (LayerStreamer.head_phase)

    def batches(self) -> list[torch.Tensor]:
        """The windows' batches [B, T] that `hidden` holds, in order."""
        ends = torch.tensor([h.shape[0] for h in self.hidden]).cumsum(0).tolist()
        return [self.windows[lo:hi] for lo, hi in zip([0] + ends[:-1], ends)]


def score_hidden(base_hidden: torch.Tensor, base_head, scored: list, ids: torch.Tensor, vocab: int) -> None:
    """Score one batch ids [B, T]: the baseline's final-normed hidden states [B, T, hidden] (through base_head) against
    each (QualityAccumulator, hidden, head) of `scored`, a block of positions at a time (position_block): no [B, T, V]
    tensor is ever whole, and the numbers are those of whole windows (update_logprobs with start)."""
    for lo, hi in blocks(ids.shape[1] - 1, position_block(ids.shape[0], vocab)):
        lb = next_token_logprobs(base_head(base_hidden[:, lo : hi + 1]))
        for acc, h, head in scored:
            acc.update_logprobs(lb, next_token_logprobs(head(h[:, lo : hi + 1])), ids, start=lo)


def next_token_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, T, V] -> float32 log-probabilities [B, T-1, V] of the next token at positions 0..T-2 (CPU), formed
    a block of positions at a time into one output tensor (log_softmax is per position: the same numbers)."""
    B, T, V = logits.shape
    out = torch.empty(B, max(0, T - 1), V, dtype=torch.float32)
    for lo, hi in blocks(T - 1, position_block(B, V)):
        out[:, lo:hi] = torch.log_softmax(logits[:, lo:hi].float(), dim=-1).cpu()
    return out


def kl_mean(logits_base: torch.Tensor, logits_other: torch.Tensor) -> float:
    """Mean KL(base || other) of next-token distributions over every position. logits: [..., V]. In double, a block
    of positions at a time (position_block): no double copy of either whole tensor is formed."""
    V = logits_base.shape[-1]
    lb_all, lo_all = logits_base.reshape(-1, V), logits_other.reshape(-1, V)
    total = 0.0
    for lo, hi in blocks(lb_all.shape[0], max(1, position_block(1, V) // 2)):
        lb = torch.log_softmax(lb_all[lo:hi].double(), -1)
        total += float(kl_per_position(lb, torch.log_softmax(lo_all[lo:hi].double(), -1)).sum())
    return total / max(1, lb_all.shape[0])
