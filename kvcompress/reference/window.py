"""The fp16 regions of a cache: sink tokens and the recent window; which source each query position reads."""
from __future__ import annotations

import torch


# ---------------------------------------------------------------- window / sinks
def fp16_mask(q_pos: torch.Tensor, kv_len: int, sink_tokens: int, window: int) -> torch.Tensor:
    """Which cached positions a query sees in fp16.

    q_pos: [Tq] absolute positions of the queries. Returns bool [Tq, kv_len]:
    True iff s < sink_tokens or q_pos - s < window (DESIGN §3). Causality is not applied here.
    """
    s = torch.arange(kv_len, device=q_pos.device)
    return (s < sink_tokens).unsqueeze(0) | ((q_pos.unsqueeze(-1) - s.unsqueeze(0)) < window)


def context_phase_sources(q_pos: torch.Tensor, kv_len: int, chunk_start: torch.Tensor, sink_tokens: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Serving semantics of chunked prefill + decode (what `CompressedCache` does per call).

    q_pos: [Tq] query positions; chunk_start: [Tq] first position of each query's chunk (a decode
    step is a chunk of one token, chunk_start == q_pos). Returns (exact, hp) bool [Tq, kv_len]:
    exact: s is in the query's own chunk of C > 1 tokens (read in the model's dtype);
    hp: otherwise s is read in fp16 iff s < sink_tokens or (end of the query's chunk) - s < window,
    i.e. as stored after the chunk was appended; all other positions are read compressed.
    Causality is not applied here.
    """
    s = torch.arange(kv_len, device=q_pos.device)
    # the last position of each query's chunk: the largest position sharing its chunk start
    end = torch.zeros_like(q_pos)
    for i in range(q_pos.numel()):
        end[i] = q_pos[chunk_start == chunk_start[i]].max()
    multi = end > chunk_start  # chunks of more than one token
    exact = multi.unsqueeze(-1) & (s.unsqueeze(0) >= chunk_start.unsqueeze(-1))
    hp = (s < sink_tokens).unsqueeze(0) | ((end.unsqueeze(-1) - s.unsqueeze(0)) < window)
    return exact, hp & ~exact


def region_sizes(n_tokens: int, sink_tokens: int, window: int) -> tuple[int, int, int]:
    """(sinks, compressed, window) token counts of a cache holding n_tokens positions."""
    n_sink = min(n_tokens, sink_tokens)
    n_win = min(n_tokens - n_sink, window)
    return n_sink, n_tokens - n_sink - n_win, n_win
