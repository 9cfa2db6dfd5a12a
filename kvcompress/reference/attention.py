"""Attention over a compressed cache: fp16 sinks and window, the compressed middle (the CPU oracle of the kernels)."""
from __future__ import annotations

import torch

from kvcompress.reference.window import fp16_mask


# ---------------------------------------------------------------- attention over a compressed cache
def _allowed(pos: torch.Tensor, s_idx: torch.Tensor, sliding_window: int | None, chunk: int | None = None) -> torch.Tensor:
    """Causal (sliding-window, chunked) visibility [tq, S]: s <= t, t - s < sliding_window, and with chunked attention
    (Llama 4's attention_chunk_size) s in t's chunk: s // chunk == t // chunk."""
    allowed = s_idx.unsqueeze(0) <= pos.unsqueeze(-1)
    if sliding_window is not None:
        allowed = allowed & ((pos.unsqueeze(-1) - s_idx.unsqueeze(0)) < sliding_window)
    if chunk:
        allowed = allowed & ((pos.unsqueeze(-1) // chunk) == (s_idx.unsqueeze(0) // chunk))
    return allowed


def _reachable(pos: torch.Tensor, S: int, sink_tokens: int, window: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Key column ranges a block of queries at positions `pos` can read (causal): compressed part
    [0, max(pos) - window + 1), fp16 part sinks [0, sink_tokens) and the window band
    [min(pos) - window + 1, max(pos) + 1). Everything outside is masked anyway."""
    pmin, pmax = int(pos.min()), int(pos.max())
    end = min(S, pmax + 1)
    comp = [(0, max(0, min(end, pmax - window + 1)))]
    band_lo = max(0, pmin - window + 1)
    sinks = min(sink_tokens, end)
    hp = [(0, end)] if band_lo <= sinks else [(0, sinks), (band_lo, end)]
    return comp, hp


def _take_cols(x: torch.Tensor, ranges: list[tuple[int, int]], dim: int = -1) -> torch.Tensor:
    parts = [x.narrow(dim, a, b - a) for a, b in ranges if b > a]
    if not parts:
        return x.narrow(dim, 0, 0)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def mixed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_hat: torch.Tensor,
    v_hat: torch.Tensor,
    q_pos: torch.Tensor,
    *,
    sink_tokens: int,
    window: int,
    scaling: float,
    key_mask: torch.Tensor | None = None,
    q_block: int = 1024,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sink_logits: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Causal attention where query t reads (k, v) at s in fp16 iff fp16_mask, else (k_hat, v_hat).

    q: [B, Hq, Tq, D]; k, v, k_hat, v_hat: [B, Hkv, S, D]; q_pos: [Tq] absolute positions
    (cache slot index). key_mask: optional bool [B, S] (False = padding). sliding_window: a layer
    that attends only to t - s < sliding_window (transformers' convention). softcap: the scaled
    scores become softcap * tanh(scores / softcap) before the softmax (Gemma 2's attn_logit_softcapping).
    sink_logits: [Hq] one learned logit per query head that joins every softmax's denominator and
    adds no value (GPT-OSS's attention sinks, transformers' s_aux). chunk: a chunked-attention layer (Llama 4) attends
    only within its attention_chunk_size-token chunk. Returns [B, Hq, Tq, D]
    in float32 (float64 for float64 inputs).

    softmax over the union of two disjoint key sets (compressed: k_hat/v_hat; fp16: k/v) equals
    the log-sum-exp weighted merge of the two partial attentions; on CPU each part is one fused
    flash-attention call (which returns its log-sum-exp), queries in blocks of q_block to bound
    the masks' memory; a sink logit is one more part with log-sum-exp = the logit and output 0.
    Elsewhere, and with a soft cap (which the fused call cannot apply to its scores),
    `_mixed_attention_explicit` computes the same thing (tested equal).
    """
    if q.device.type != "cpu" or softcap:
        return _mixed_attention_explicit(q, k, v, k_hat, v_hat, q_pos, sink_tokens=sink_tokens, window=window, scaling=scaling,
                                         key_mask=key_mask, q_block=min(q_block, 256), sliding_window=sliding_window, softcap=softcap,
                                         sink_logits=sink_logits, chunk=chunk)
    B, Hq, Tq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    g = Hq // Hkv
    dt = torch.promote_types(q.dtype, torch.float32)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    kv = [tuple(x.to(dt).repeat_interleave(g, 1) for x in pair) for pair in ((k_hat, v_hat), (k, v))]  # [B, Hq, S, D]
    qf = q.to(dt)
    out = torch.empty(B, Hq, Tq, D, dtype=dt, device=q.device)
    s_idx = torch.arange(S, device=q.device)
    for lo in range(0, Tq, q_block):
        hi = min(Tq, lo + q_block)
        pos = q_pos[lo:hi]
        allowed = _allowed(pos, s_idx, sliding_window, chunk).expand(B, 1, hi - lo, S)
        if key_mask is not None:
            allowed = allowed & key_mask[:, None, None, :]
        hp = fp16_mask(pos, S, sink_tokens, window)
        parts = []
        for (kk, vv), m, cols in zip(kv, (allowed & ~hp, allowed & hp), _reachable(pos, S, sink_tokens, window)):
            # only the key columns this block of queries can reach in this part (causality, window band)
            m = _take_cols(m, cols)
            if not m.any():
                continue
            kk, vv = _take_cols(kk, cols, -2), _take_cols(vv, cols, -2)
            o, lse = flash(qf[:, :, lo:hi], kk, vv, 0.0, False, attn_mask=torch.zeros(m.shape, dtype=dt).masked_fill_(~m, float("-inf")), scale=scaling)
            parts.append((o, lse.masked_fill(~m.any(-1), float("-inf"))))  # a row with no key here: weight 0
        if not parts:
            out[:, :, lo:hi] = 0
            continue
        lses = [p[1] for p in parts]
        if sink_logits is not None:  # the sink: one more term of the denominator, no value
            lses.append(sink_logits.to(dt).reshape(1, Hq, 1).expand_as(lses[0]))
        total = torch.logsumexp(torch.stack(lses), 0)  # [B, Hq, tq]
        safe = total.masked_fill(total == float("-inf"), 0.0)
        out[:, :, lo:hi] = sum(o * torch.exp(lse - safe).unsqueeze(-1) for o, lse in parts)
    return out


def _mixed_attention_explicit(q, k, v, k_hat, v_hat, q_pos, *, sink_tokens: int, window: int, scaling: float,
                               key_mask=None, q_block: int = 256, sliding_window: int | None = None, softcap: float | None = None,
                               sink_logits: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """mixed_attention's contract as one explicit softmax over the mixed scores (any device)."""
    B, Hq, Tq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    g = Hq // Hkv
    dt = torch.promote_types(q.dtype, torch.float32)
    qf = q.to(dt).unflatten(1, (Hkv, g))  # [B, Hkv, g, Tq, D]
    khf, vhf = k_hat.to(dt), v_hat.to(dt)  # [B, Hkv, S, D]
    # fp16 positions are read as k_hat + (k - k_hat): only the (few) columns some query of a block
    # reads in fp16 (sinks and the band of the window) need the correction
    dk, dv = k.to(dt) - khf, v.to(dt) - vhf
    out = torch.empty(B, Hkv, g, Tq, D, dtype=dt, device=q.device)
    s_idx = torch.arange(S, device=q.device)
    for lo in range(0, Tq, q_block):
        hi = min(Tq, lo + q_block)
        tq, pos = hi - lo, q_pos[lo:hi]
        qb = qf[..., lo:hi, :].flatten(2, 3)  # [B, Hkv, g*tq, D]: the query heads of a kv head as rows
        hp = fp16_mask(pos, S, sink_tokens, window)  # [tq, S]
        cols = hp.any(0).nonzero().squeeze(-1)
        scores = qb @ khf.transpose(-1, -2)  # [B, Hkv, g*tq, S]
        if cols.numel():
            hpc = hp[:, cols].repeat(g, 1)
            scores[..., cols] += (qb @ dk[..., cols, :].transpose(-1, -2)) * hpc
        allowed = _allowed(pos, s_idx, sliding_window, chunk).repeat(g, 1)  # [g*tq, S]
        if key_mask is not None:
            allowed = allowed & key_mask[:, None, None, :]
        scores = scores * scaling
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores.masked_fill_(~allowed, float("-inf"))
        if sink_logits is None:
            p = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
        else:  # the sink's column joins the softmax and is dropped
            sink = sink_logits.to(dt).reshape(1, Hkv, g, 1, 1).expand(B, Hkv, g, tq, 1).flatten(2, 3)
            p = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        ob = p @ vhf
        if cols.numel():
            ob += (p[..., cols] * hpc) @ dv[..., cols, :]
        out[..., lo:hi, :] = ob.unflatten(2, (g, tq))
    return out.flatten(1, 2)
