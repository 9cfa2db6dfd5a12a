"""KVStats: streaming statistics of the post-RoPE keys and the values a model caches.

Per layer x kv-head x channel: absmax, min, max, sum, sum of squares, a fixed histogram of
|x|; per layer x kv-head a histogram of per-token L2 norms; token counts; the second moment of
the post-RoPE queries per kv-head group (q_gram = sum of q q^T over every calibration position and
query head of the group: all the fit's q.k score-error objective needs of the queries, [L, H_kv,
D, D] whatever the number of query heads); per RoPE pair (a, b) (rope_pairs [2, D/2], reference.rope_pairs:
(d, d + D/2), or a partial-rotary model's own pairs) the largest norm sqrt(k_a^2 + k_b^2) of the post-RoPE
keys (k_pairmax [L, H, D/2]: RoPE rotates each pair, so this norm is the same at every position and bounds
either channel at any position); when the model's RoPE frequencies are known, per pair and per bin of the pair's
angle before RoPE (the post-RoPE angle less position x inv_freq, N_ARC_BINS bins of [0, 2 pi)) the smallest and
largest norm (k_arcmin / k_arcmax [L, H, D/2, N_ARC_BINS], empty bins +inf / 0: what observers.base.arc_ranges
turns into each channel's range over every position up to the model's max_position); per key channel
the mean squared range (max - min) over aligned groups of G tokens of each window, G in
spec.GROUP_RANGE_TOKENS (k_grange_sq [L, n_G, H, D] summed, k_grange_n [L, n_G] groups: what
kv.key.alloc=waterfill weighs channels by); and a small bounded sample of raw (k, v) rows per layer
and kv head. Never all activations.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvcompress.artifacts import load_artifact, save_artifact
from kvcompress.errors import ArtifactError, UserError
from kvcompress.reference import pair_halves, rope_pairs
from kvcompress.spec import GROUP_RANGE_TOKENS

FORMAT_VERSION = 8  # 2: q_gram replaces the per-query-head sample_q; 3: k_pairmax (RoPE-pair norm bound); 4: sample_pos; 5: k_grange_sq; 6: rope_pairs; 7: k_arcmin/k_arcmax; 8: fold_obstacles (header)
KIND = "kv_stats"
# Fixed histogram of |x|: log2-spaced edges 2^-12 .. 2^12 in quarter octaves; bin i counts
# values in [edge[i-1], edge[i]); bin 0 is below the first edge, the last bin above the last.
HIST_EDGES = 2.0 ** torch.arange(-12.0, 12.01, 0.25)
N_BINS = HIST_EDGES.numel() + 1
NORM_EDGES = 2.0 ** torch.arange(-6.0, 14.01, 0.25)
N_NORM_BINS = NORM_EDGES.numel() + 1
N_ARC_BINS = 128  # bins of a RoPE pair's pre-RoPE angle (k_arcmin / k_arcmax): 2 pi / 128 = 0.049 rad each

CHANNEL_STATS = ("absmax", "min", "max", "sum", "sumsq")


@dataclass
class KVStats:
    """Tensors are [L, H, D] (channel stats), [L, H, D, N_BINS] (hist), [L, N, H, D] (k/v samples), [L, H, D, D] (q_gram)."""

    tensors: dict[str, torch.Tensor]
    header: dict = field(default_factory=dict)

    @property
    def geometry(self) -> dict:
        return self.header["geometry"]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def mean(self, which: str) -> torch.Tensor:
        return self[f"{which}_sum"] / self["count"].view(-1, 1, 1).clamp(min=1)

    def std(self, which: str) -> torch.Tensor:
        m = self.mean(which)
        return (self[f"{which}_sumsq"] / self["count"].view(-1, 1, 1).clamp(min=1) - m * m).clamp(min=0).sqrt()

    def q_second_moment(self, layer: int) -> torch.Tensor:
        """E[q q^T] per kv-head group of one layer: [H, D, D] float64 (queries of every head of the group)."""
        return self["q_gram"][layer] / self["q_count"][layer].clamp(min=1)

    def group_range_sq(self, layer: int, group_tokens: int) -> torch.Tensor:
        """E[(max - min)^2] of each key channel over aligned groups of group_tokens calibration tokens: [H, D]
        float64. A clear error when no calibration window held a whole group."""
        i = GROUP_RANGE_TOKENS.index(group_tokens)
        n = int(self["k_grange_n"][layer, i])
        if not n:
            raise UserError(f"kv.key.group_tokens={group_tokens}: no calibration window holds a whole group of {group_tokens} tokens "
                            f"(calib.seq_len={self.header.get('provenance', {}).get('calib', {}).get('seq_len', '?')}); use calib.seq_len >= {group_tokens}")
        return self["k_grange_sq"][layer, i] / n

    def quantile_abs(self, which: str, q: float) -> torch.Tensor:
        """Upper bound of the q-th percentile (0..100) of |x| per [L, H, D], from the histogram."""
        hist = self[f"{which}_hist"].double()
        cdf = hist.cumsum(-1) / hist.sum(-1, keepdim=True).clamp(min=1)
        idx = (cdf < q / 100.0).sum(-1).clamp(max=N_BINS - 1)
        upper = torch.cat([HIST_EDGES, HIST_EDGES[-1:] * 2]).double()
        return torch.minimum(upper[idx], self[f"{which}_absmax"].double()).float()

    def save(self, path: str | Path) -> None:
        save_artifact(path, self.tensors, {"kind": KIND, "format_version": FORMAT_VERSION, **self.header})

    @classmethod
    def load(cls, path: str | Path) -> "KVStats":
        tensors, header = load_artifact(path, KIND, (FORMAT_VERSION,))
        missing = [f"{w}_{s}" for w in ("k", "v") for s in CHANNEL_STATS if f"{w}_{s}" not in tensors]
        if missing:
            raise ArtifactError(f"{str(path)!r} lacks tensors {missing}")
        return cls(tensors, header)


class StatsAccumulator:
    """Streams K/V (and a q/k/v row sample) into KVStats. One instance per profiling run."""

    def __init__(self, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, sample_capacity: int, pairs: torch.Tensor | None = None,
                 inv_freq: torch.Tensor | None = None):
        L, H, D = n_layers, n_kv_heads, head_dim
        # RoPE inverse frequency per pair ([D/2], or [L, D/2] per layer): with it, the pre-RoPE angle histogram of
        # each pair (k_arcmin / k_arcmax). The keys observe_kv sees are assumed at positions 0..T-1 (each window from 0).
        self.inv_freq = None if inv_freq is None else inv_freq.detach().double().cpu()
        self.pairs = rope_pairs(D) if pairs is None else pairs.long().cpu()
        self.shape = (L, H, D)
        self.t: dict[str, torch.Tensor] = {"count": torch.zeros(L, dtype=torch.int64)}
        for w in ("k", "v"):
            self.t[f"{w}_absmax"] = torch.zeros(L, H, D)
            self.t[f"{w}_min"] = torch.full((L, H, D), float("inf"))
            self.t[f"{w}_max"] = torch.full((L, H, D), float("-inf"))
            self.t[f"{w}_sum"] = torch.zeros(L, H, D, dtype=torch.float64)
            self.t[f"{w}_sumsq"] = torch.zeros(L, H, D, dtype=torch.float64)
            self.t[f"{w}_hist"] = torch.zeros(L, H, D, N_BINS, dtype=torch.int64)
            self.t[f"{w}_norm_hist"] = torch.zeros(L, H, N_NORM_BINS, dtype=torch.int64)
        self.t["k_prerope_absmax"] = torch.zeros(L, H, D)
        self.t["k_pairmax"] = torch.zeros(L, H, D // 2)
        self.t["rope_pairs"] = self.pairs.clone()  # the channels of each pair (reference.rope_pairs): k_pairmax's and fit's
        if self.inv_freq is not None:
            self.t["k_arcmin"] = torch.full((L, H, D // 2, N_ARC_BINS), float("inf"))
            self.t["k_arcmax"] = torch.zeros(L, H, D // 2, N_ARC_BINS)
        self.t["k_grange_sq"] = torch.zeros(L, len(GROUP_RANGE_TOKENS), H, D, dtype=torch.float64)
        self.t["k_grange_n"] = torch.zeros(L, len(GROUP_RANGE_TOKENS), dtype=torch.int64)
        self.t["q_gram"] = torch.zeros(L, H, D, D, dtype=torch.float64)
        self.t["q_count"] = torch.zeros(L, dtype=torch.float64)
        self.t["sample_k"] = torch.zeros(L, sample_capacity, H, D)
        self.t["sample_v"] = torch.zeros(L, sample_capacity, H, D)
        self.t["sample_pos"] = torch.zeros(L, sample_capacity, dtype=torch.int64)  # position in its window of each sampled row
        self.n_sampled = torch.zeros(L, dtype=torch.int64)
        self.prerope_seen = False
        self.rows: torch.Tensor | None = None  # [n] batch row of each sampled position in the current batch
        self.pos: torch.Tensor | None = None  # [n] position of each sampled row

    def set_sample_positions(self, rows: torch.Tensor, pos: torch.Tensor) -> None:
        """Which (batch row, position) pairs of the next forward pass go into the raw sample."""
        self.rows, self.pos = rows, pos

    def _channel(self, w: str, layer: int, x: torch.Tensor) -> None:
        # x: [B, H, T, D] float32
        t, L = self.t, layer
        t[f"{w}_absmax"][L] = torch.maximum(t[f"{w}_absmax"][L], x.abs().amax(dim=(0, 2)))
        t[f"{w}_min"][L] = torch.minimum(t[f"{w}_min"][L], x.amin(dim=(0, 2)))
        t[f"{w}_max"][L] = torch.maximum(t[f"{w}_max"][L], x.amax(dim=(0, 2)))
        xd = x.double()
        t[f"{w}_sum"][L] += xd.sum(dim=(0, 2))
        t[f"{w}_sumsq"][L] += (xd * xd).sum(dim=(0, 2))
        H, D = x.shape[1], x.shape[3]
        bins = torch.bucketize(x.abs().contiguous(), HIST_EDGES.to(x.device))  # [B, H, T, D]
        flat = (torch.arange(H * D, device=x.device).view(1, H, 1, D) * N_BINS + bins).flatten()
        t[f"{w}_hist"][L] += torch.bincount(flat, minlength=H * D * N_BINS).view(H, D, N_BINS).cpu()
        nb = torch.bucketize(x.norm(dim=-1).contiguous(), NORM_EDGES.to(x.device))  # [B, H, T]
        flat = (torch.arange(H, device=x.device).view(1, H, 1) * N_NORM_BINS + nb).flatten()
        t[f"{w}_norm_hist"][L] += torch.bincount(flat, minlength=H * N_NORM_BINS).view(H, N_NORM_BINS).cpu()

    def _sample(self, name: str, layer: int, x: torch.Tensor) -> int:
        # x: [B, H*, T, D]; rows at (self.rows, self.pos) -> sample_<name>[layer, n0:n0+n]; returns n
        if self.rows is None or not self.rows.numel():
            return 0
        cap = self.t[f"sample_{name}"].shape[1]
        n0 = int(self.n_sampled[layer])
        n = min(self.rows.numel(), cap - n0)
        if n <= 0:
            return 0
        rows = x[self.rows[:n].to(x.device), :, self.pos[:n].to(x.device)]  # [n, H*, D]
        self.t[f"sample_{name}"][layer, n0 : n0 + n] = rows.float().cpu()
        return n

    def observe_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [B, H_kv, T, D] post-RoPE, exactly what the model caches."""
        k, v = k.detach().float(), v.detach().float()
        ka, kb = pair_halves(k, self.pairs)
        pair = (ka.square() + kb.square()).sqrt().amax(dim=(0, 2)).cpu()  # [H, D/2]
        self.t["k_pairmax"][layer] = torch.maximum(self.t["k_pairmax"][layer], pair)
        if self.inv_freq is not None:
            self._arc(layer, ka, kb)
        for i, G in enumerate(GROUP_RANGE_TOKENS):  # aligned groups of G tokens of each window (a partial tail is left out)
            n = k.shape[2] // G
            if n:
                kg = k[:, :, : n * G].unflatten(2, (n, G))  # [B, H, n, G, D]
                self.t["k_grange_sq"][layer, i] += (kg.amax(3) - kg.amin(3)).double().square().sum(dim=(0, 2)).cpu()
                self.t["k_grange_n"][layer, i] += k.shape[0] * n
        self._channel("k", layer, k)
        self._channel("v", layer, v)
        self.t["count"][layer] += k.shape[0] * k.shape[2]
        self._sample("k", layer, k)
        n = self._sample("v", layer, v)
        if n:  # none with calib.sample_tokens=0 (no sample positions set)
            n0 = int(self.n_sampled[layer])
            self.t["sample_pos"][layer, n0 : n0 + n] = self.pos[:n].cpu()
            self.n_sampled[layer] += n  # each layer has its own cursor: any batch/layer order

    def _arc(self, layer: int, ka: torch.Tensor, kb: torch.Tensor) -> None:
        # ka, kb: [B, H, T, D/2] the two channels of each pair at positions 0..T-1 -> the pre-RoPE angle's bin
        # (RoPE turns pair j by position * inv_freq[j]) and the norm, min and max per (head, pair, bin)
        B, H, T, P = ka.shape
        inv = self.inv_freq[layer] if self.inv_freq.dim() == 2 else self.inv_freq
        turn = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]  # [T, P]
        ang = torch.remainder(torch.atan2(kb.double().cpu(), ka.double().cpu()) - turn, 2 * math.pi)
        b = (ang * (N_ARC_BINS / (2 * math.pi))).long().clamp_(0, N_ARC_BINS - 1)
        norm = (ka.square() + kb.square()).sqrt().float().cpu()
        idx = ((torch.arange(H).view(1, H, 1, 1) * P + torch.arange(P).view(1, 1, 1, P)) * N_ARC_BINS + b).flatten()
        for name, how in (("k_arcmax", "amax"), ("k_arcmin", "amin")):
            flat = self.t[name][layer].view(-1)
            flat.scatter_reduce_(0, idx, norm.flatten(), reduce=how)

    def observe_q(self, layer: int, q: torch.Tensor) -> None:
        """q: [B, H_q, T, D] post-RoPE queries -> q_gram[layer, h] += sum of q q^T over the group of kv head h."""
        B, Hq, T, D = q.shape
        H = self.shape[1]
        qg = q.detach().double().unflatten(1, (H, Hq // H)).permute(1, 0, 2, 3, 4).reshape(H, -1, D)  # [H, B*g*T, D]
        self.t["q_gram"][layer] += (qg.transpose(1, 2) @ qg).cpu()
        self.t["q_count"][layer] += qg.shape[1]

    def observe_prerope_k(self, layer: int, k_lin: torch.Tensor) -> None:
        """k_lin: [B, T, H_kv * D], the k_proj output before RoPE."""
        L, H, D = self.shape
        a = k_lin.detach().float().abs().amax(dim=(0, 1)).view(H, D).cpu()
        self.t["k_prerope_absmax"][layer] = torch.maximum(self.t["k_prerope_absmax"][layer], a)
        self.prerope_seen = True

    def finish(self, header: dict) -> KVStats:
        n = int(self.n_sampled.min())
        t = dict(self.t)
        for name in ("k", "v", "pos"):
            t[f"sample_{name}"] = t[f"sample_{name}"][:, :n].contiguous()
        header = {**header, "prerope_observed": self.prerope_seen, "sample_rows": n}
        return KVStats(t, header)
