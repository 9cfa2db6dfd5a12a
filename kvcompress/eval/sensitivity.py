"""Per-layer sensitivity: the quality change when only one layer reads a compressed cache.

For every layer l and every candidate format c, the one-pass (decode-equivalent) evaluation is
run with layer l reading the simulated compressed cache of c and every other layer reading the
exact cache. Layers below l see exactly the baseline, so their hidden states are shared: the
passes run layer-major (layer 0 for every live pass, then layer 1, ...). A pass (l, c) starts at
layer l from the baseline's hidden state there, runs layer l under the evaluation attention with
c's ScaleBook and the layers above with the model's own attention. This costs about half of one
forward per (layer, candidate) instead of a full one. In-memory and layer-streamed models run the
same schedule (a streamed layer is loaded once for all passes). The passes in flight hold L x candidates
hidden states at the last layer; where that would exceed SENSITIVITY_LIVE_BYTES, the start layers are
taken in groups (start_groups), each running the layers from its first start (the same numbers).
"""
from __future__ import annotations

import math
from contextlib import nullcontext

import torch
from tqdm.auto import tqdm

from kvcompress.eval.attention import LayerErrors, eval_call
from kvcompress.eval.metrics import by_vocabulary, kl_per_position, vocab_stats
from kvcompress.models.observe import attention_implementation
from kvcompress.models.streaming import catch_layer_inputs, final_logits
from kvcompress.scalebook import ScaleBook


class _Layers:
    """The decoder layers of a loaded model, in memory or streamed from its checkpoint."""

    def __init__(self, lm):
        self.lm, self.s = lm, lm.streamer
        self.layers = lm.model.model.layers

    def catch(self, ids: torch.Tensor, impl, kw) -> tuple[torch.Tensor, list[dict]]:
        """The first layer's input and every layer's own keywords (see catch_layer_inputs)."""
        with attention_implementation(self.lm.model, impl):
            if self.s is None:
                return catch_layer_inputs(self.lm.model, input_ids=ids.to(self.lm.device), **kw)
            return catch_layer_inputs(self.lm.model, inputs_embeds=self.s.embed(ids), **kw)

    def loaded(self, li: int):
        if self.s is None:
            return nullcontext()
        s, layer = self.s, self.layers[li]

        class _Loaded:
            def __enter__(self_):
                s._materialize(layer, f"model.layers.{li}.")

            def __exit__(self_, *exc):
                s._release(layer)

        return _Loaded()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.s is not None:
            return self.s.logits(hidden)
        m = self.lm.model
        return final_logits(m, m.model.norm(hidden))  # the evaluation's head (logit scales, soft cap: head_transform)

    def head_context(self):
        return nullcontext() if self.s is None else self.s.head_phase()

    def vocab_head(self):
        """The streamed head as scoring uses it (None in memory)."""
        return None if self.s is None else self.s.scoring_head


def _run_layer(layer, h: torch.Tensor, kw: dict, model, impl) -> torch.Tensor:
    with attention_implementation(model, impl):
        out = layer(h, **kw)
    return out[0] if isinstance(out, tuple) else out


SENSITIVITY_LIVE_BYTES = 4 << 30  # hidden states of passes in flight at once (layer_sensitivity's groups of start layers)


def _state_bytes(lm, T: int) -> int:
    """Bytes of one pass's hidden states [1, T, hidden] in the compute dtype."""
    dtype = lm.streamer.dtype if lm.streamer is not None else next(lm.model.parameters()).dtype
    return T * lm.geometry.hidden_size * torch.empty(0, dtype=dtype).element_size()


def start_groups(L: int, n_candidates: int, state_bytes: int) -> list[tuple[int, int]]:
    """Consecutive groups [g0, g1) of start layers whose passes (n_candidates per layer) are in flight together: as
    many layers as keep the states within SENSITIVITY_LIVE_BYTES (at least one). One group, the whole model, unless
    L x candidates states would exceed it (a 70B in float32 at 1K tokens: 80 x 4 x 32 MB); each further group runs
    the layers from its first start again (streamed: reads them again)."""
    per = max(1, SENSITIVITY_LIVE_BYTES // max(1, n_candidates * state_bytes))
    return [(g0, min(L, g0 + per)) for g0 in range(0, L, per)]


def scored_positions(T: int, first: int, stride: int) -> torch.Tensor:
    """Positions whose next-token prediction is scored: from `first` (the first query that reads a
    compressed key; earlier ones read only fp16 keys and change by fp16 rounding alone) every
    `stride`-th up to T - 2 (the last prediction with a target)."""
    return torch.arange(min(first, T - 2), T - 1, stride)


def _quality(kl: torch.Tensor, nll_base: torch.Tensor, nll_comp: torch.Tensor, n_all: int, scale: float) -> dict:
    """KL mean and perplexity change over all n_all predictions, estimated from the scored ones' per-position KL
    and negative log-likelihoods (their sums times `scale`; the unscored early positions counted as unchanged)."""
    return {"kl_sum": float(kl.double().sum()) * scale, "dnll_sum": float((nll_comp - nll_base).double().sum()) * scale, "n": n_all}


def _score_live(layers, final_h: torch.Tensor, live: dict, pos: torch.Tensor, tgt: torch.Tensor):
    """(key, per-position KL, baseline nll, compressed nll) of each live pass's final states against the baseline's at
    the scored positions `pos` (targets tgt [1, n]). A streamed head that the head phase cannot keep is applied a
    vocabulary range at a time to every pass at once (metrics.vocab_stats: two reads), not read once per pass, when
    more than one pass is live."""
    head = layers.vocab_head()
    if head is not None and by_vocabulary([head] * (1 + len(live)), 1):  # one block: all scored positions at once
        norm = layers.lm.model.model.norm
        sides = [(norm(final_h[:, pos]), head)] + [(norm(h[:, pos]), head) for h in live.values()]
        base, *others = vocab_stats(sides, tgt, layers.lm.geometry.vocab_size)
        for key, o in zip(list(live), others, strict=True):
            yield key, o["kl"], base["nll"], o["nll"]
        return
    lb = torch.log_softmax(layers.logits(final_h[:, pos]).float(), dim=-1).cpu()
    nb = -lb.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    for key, h in live.items():
        lc = torch.log_softmax(layers.logits(h[:, pos]).float(), dim=-1).cpu()
        yield key, kl_per_position(lb, lc), nb, -lc.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)


def _merge(parts: list[dict]) -> dict:
    n = sum(p["n"] for p in parts)
    return {"kl_mean": sum(p["kl_sum"] for p in parts) / n, "ppl_delta_rel": math.expm1(sum(p["dnll_sum"] for p in parts) / n), "tokens": n}


@torch.no_grad()
def layer_sensitivity(lm, windows: torch.Tensor, books: dict[str, ScaleBook], progress: bool = True, stride: int = 2) -> dict[str, list[dict]]:
    """{candidate: [{kl_mean, ppl_delta_rel} of "only layer l compressed", for l = 0..L-1]} over
    token windows [N, T] (batch 1). books: {candidate label: a uniform ScaleBook of that format};
    fp16 books are not candidates (their change is zero by construction). Predictions are scored
    every `stride`-th position from the first that reads a compressed key (an estimate of the
    full-window mean; the search checks its picks end to end on every position)."""
    layers = _Layers(lm)
    L = len(layers.layers)
    names = [n for n, b in books.items() if not b.spec.is_baseline]
    acc: dict[tuple[int, str], list[dict]] = {(li, n): [] for li in range(L) for n in names}
    first = min((b.spec.fp16_positions for n, b in books.items() if n in names), default=0)
    groups = start_groups(L, len(names), _state_bytes(lm, windows.shape[1]))
    # progress in layer calls (pass (l, c) runs L - l layers; the baseline runs every layer once, and again up to the
    # end of each later group's starts) and lm-head calls, so the ETA holds
    total = windows.shape[0] * (len(names) * L * (L + 1) // 2 + L + sum(g1 - g0 for g0, g1 in groups[1:]) + len(names) * L)
    bar = tqdm(total=total, desc="tune: per-layer sensitivity", unit="call", disable=not progress)
    for wi in range(windows.shape[0]):
        ids = windows[wi : wi + 1]
        start_h, base_kw = layers.catch(ids, None, {})
        impl, ekw = eval_call(books[names[0]], LayerErrors(L)) if names else (None, {})
        _, eval_kw = layers.catch(ids, impl, ekw)
        T = ids.shape[1]
        pos = scored_positions(T, first, stride)
        tgt = ids[0, pos + 1].view(1, -1)
        scale = (T - 1 - min(first, T - 2)) / len(pos)
        final_h = None
        for g0, g1 in groups:  # passes starting at layers g0..g1-1 live together; the layers from g0 up run for them
            base_h, live = start_h, {}
            for li in range(g0, L):
                layer = layers.layers[li]
                with layers.loaded(li):
                    if li < g1:
                        for n in names:  # passes that start here: the baseline's input to layer li, compressed at li
                            _, kw = eval_call(books[n], LayerErrors(L))
                            live[(li, n)] = _run_layer(layer, base_h, {**eval_kw[li], **kw}, lm.model, impl)
                    for key in [k for k in live if k[0] < li]:  # passes compressed below: exact attention here
                        live[key] = _run_layer(layer, live[key], base_kw[li], lm.model, None)
                    if li < g1 or final_h is None:  # the baseline: to the next group's start (the first group: to the end)
                        base_h = _run_layer(layer, base_h, base_kw[li], lm.model, None)
                if li == g1 - 1:
                    start_h = base_h
                bar.update((min(li, g1 - 1) - g0 + 1) * len(names) + (li < g1 or final_h is None))
            if final_h is None:
                final_h = base_h
            with layers.head_context():
                for key, kl, nb, nc in _score_live(layers, final_h, live, pos, tgt):
                    acc[key].append(_quality(kl, nb, nc, T - 1, scale))
                    live[key] = None
                    bar.update(1)
    bar.close()
    return {n: [_merge(acc[(li, n)]) for li in range(L)] for n in names}
