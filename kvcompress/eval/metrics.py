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
        nb, nc = -lb.gather(-1, tgt).squeeze(-1), -lc.gather(-1, tgt).squeeze(-1)  # [B, n]
        self.update_stats(nb, nc, lb.argmax(-1) == lc.argmax(-1), kl_per_position(lb, lc), start)

    def update_stats(self, nb: torch.Tensor, nc: torch.Tensor, agree: torch.Tensor, kl: torch.Tensor, start: int = 0) -> None:
        """Per-position statistics [B, n] at positions start..start+n-1: the baseline's and the compressed
        negative log-likelihoods of the next token, whether their top-1 tokens agree, KL(base || comp)."""
        self.nll_base += float(nb.double().sum())  # double sums: blocks of positions add up as whole windows
        self.nll_comp += float(nc.double().sum())
        self.n += nb.numel()
        self.top1_agree += int(agree.sum())
        self.kl_values.append(kl.flatten().double())
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
    tensor is ever whole, and the numbers are those of whole windows (update_logprobs with start). Where a head would
    read its weights again for every application (rereads: a layer-streamed lm_head the head phase cannot keep) and
    reading it twice is fewer reads (by_vocabulary), every position is scored at once a vocabulary range at a time
    instead (vocab_stats)."""
    heads = [base_head] + [head for _, _, head in scored]
    n = ids.shape[1] - 1
    if by_vocabulary(heads, -(-n // position_block(ids.shape[0], vocab))):
        base, *others = vocab_stats([(base_hidden[:, :n], base_head)] + [(h[:, :n], head) for _, h, head in scored], ids[:, 1:], vocab)
        for (acc, _, _), o in zip(scored, others, strict=True):
            acc.update_stats(base["nll"], o["nll"], base["top1"] == o["top1"], o["kl"])
        return
    for lo, hi in blocks(n, position_block(ids.shape[0], vocab)):
        lb = next_token_logprobs(base_head(base_hidden[:, lo : hi + 1]))
        for acc, h, head in scored:
            acc.update_logprobs(lb, next_token_logprobs(head(h[:, lo : hi + 1])), ids, start=lo)


def rereads(head) -> bool:
    """Whether applying `head` reads its weights again each time (LayerStreamer's head outside a phase that keeps it)."""
    return bool(getattr(head, "rereads", False))


def by_vocabulary(heads: list, n_blocks: int) -> bool:
    """Score a vocabulary range at a time (vocab_stats) rather than a block of positions at a time: when every head can
    be applied by ranges and that reads the checkpoint fewer times (twice per distinct re-reading head, against once
    per block of positions for each application of one). Otherwise the block path, whose numbers are the in-memory
    ones to the bit."""
    if not all(callable(getattr(h, "rows", None)) for h in heads):
        return False
    again = [h for h in heads if rereads(h)]
    return 2 * len({id(h) for h in again}) < n_blocks * len(again)


@torch.no_grad()
def vocab_stats(sides: list, targets: torch.Tensor, vocab: int) -> list[dict]:
    """Per-position statistics of the next-token distributions of `sides`, [(final-normed hidden [B, n, hidden],
    head)], side 0 the baseline, against targets [B, n]: {"nll", "top1"} per side and {"kl"} (KL(side 0 || side k))
    for the others, all [B, n] on the CPU. Every head is applied a vocabulary range at a time through head.rows(lo, hi)
    (its weights for that range, read once and applied to every side that shares it) in two passes: an online
    log-sum-exp, argmax and target logit, then the KL terms. So a head too large to keep is read twice per batch, not
    once per block of positions; the numbers are log_softmax's up to float32 summation order."""
    heads = list({id(h): h for _, h in sides}.values())
    chunk = min(int(getattr(h, "chunk", vocab)) for h in heads)
    dev = [torch.device(getattr(h, "device", "cpu")) for _, h in sides]
    hs = [hid.to(d) for (hid, _), d in zip(sides, dev)]
    B, n = targets.shape
    step = max(1, LOGPROB_BLOCK_BYTES // (4 * max(1, B) * chunk))
    inf = float("inf")
    st = [{"m": torch.full((B, n), -inf, device=d), "s": torch.zeros(B, n, dtype=torch.float64, device=d),
           "best": torch.full((B, n), -inf, device=d), "top1": torch.zeros(B, n, dtype=torch.long, device=d),
           "tl": torch.zeros(B, n, device=d), "t": targets.to(d)} for d in dev]
    for lo, hi in blocks(vocab, chunk):  # pass 1: log-sum-exp, top-1 and the target's logit
        fns = {id(h): h.rows(lo, hi) for h in heads}
        for (_, head), h, s in zip(sides, hs, st):
            for plo, phi in blocks(n, step):
                z = fns[id(head)](h[:, plo:phi])  # [B, p, hi - lo] float32 logits
                zmax, zarg = z.max(-1)
                best = s["best"][:, plo:phi]
                up = zmax > best  # the first index of the largest logit, as argmax over the whole row
                s["top1"][:, plo:phi] = torch.where(up, zarg + lo, s["top1"][:, plo:phi])
                s["best"][:, plo:phi] = torch.where(up, zmax, best)
                m = torch.maximum(s["m"][:, plo:phi], zmax)
                s["s"][:, plo:phi] = (s["s"][:, plo:phi] * (s["m"][:, plo:phi] - m).exp().double()
                                      + (z - m.unsqueeze(-1)).exp().sum(-1).double())
                s["m"][:, plo:phi] = m
                t = s["t"][:, plo:phi]
                inside = (t >= lo) & (t < hi)
                got = z.gather(-1, (t - lo).clamp(0, hi - lo - 1).unsqueeze(-1)).squeeze(-1)
                s["tl"][:, plo:phi] = torch.where(inside, got, s["tl"][:, plo:phi])
        del fns
    for s in st:
        s["lse"] = s["m"].double() + s["s"].log()  # float64: one rounding of it would shift every KL term alike
    kl = [torch.zeros(B, n, dtype=torch.float64, device=d) for d in dev[1:]]
    (hb, base_head), sb = (hs[0], sides[0][1]), st[0]
    for lo, hi in blocks(vocab, chunk):  # pass 2: sum over the vocabulary of p_base * (log p_base - log p_side)
        fns = {id(h): h.rows(lo, hi) for h in heads}
        for plo, phi in blocks(n, step):
            zb, lse_b = fns[id(base_head)](hb[:, plo:phi]), sb["lse"][:, plo:phi]
            pb = (zb - lse_b.float().unsqueeze(-1)).exp()
            for k, ((_, head), h, s) in enumerate(zip(sides[1:], hs[1:], st[1:])):
                # log p_base - log p_side = (z_base - z_side) - (lse_base - lse_side), the difference of the lse's in float64
                shift = (lse_b - s["lse"][:, plo:phi].to(lse_b.device)).float().unsqueeze(-1)
                d = zb - fns[id(head)](h[:, plo:phi]).to(zb.device) - shift
                kl[k][:, plo:phi] += (pb * d).sum(-1).double().to(kl[k].device)
        del fns
    out = [{"nll": (s["lse"] - s["tl"].double()).float().cpu(), "top1": s["top1"].cpu()} for s in st]
    for o, k in zip(out[1:], kl):
        o["kl"] = k.float().clamp(min=0).cpu()
    return out


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
