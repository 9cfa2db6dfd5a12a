"""Observe K/V where transformers caches them, without forking modeling code.

* `ObservingCache` is a transformers `Cache` whose layers hand every `update(key, value)`
  (post-RoPE, exactly the tensors a cache stores) to a callback and keep nothing: one
  teacher-forced forward per calibration window, no past, no copies.
* `attention_hook` registers an attention function in transformers' `AttentionInterface`
  that shows the post-RoPE queries to a callback, then runs the model's own SDPA attention.
* `prerope_key_hooks` adds forward hooks on `self_attn.k_proj` (pre-RoPE keys), where present.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward

KVCallback = Callable[[int, torch.Tensor, torch.Tensor], None]


class _ObservingLayer(CacheLayerMixin):
    is_sliding = False

    def __init__(self, layer_idx: int, callback: KVCallback):
        super().__init__()
        self.layer_idx = layer_idx
        self.callback = callback

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        # key_states, value_states: [B, H_kv, T, D] post-RoPE
        self.callback(self.layer_idx, key_states, value_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


class ObservingCache(Cache):
    """A pass-through cache for single teacher-forced passes: observes, stores nothing."""

    def __init__(self, n_layers: int, callback: KVCallback):
        super().__init__(layers=[_ObservingLayer(i, callback) for i in range(n_layers)])


QCallback = Callable[[int, torch.Tensor], None]
_Q_CALLBACKS: dict[str, QCallback] = {}
OBSERVE_ATTN = "kvcompress_observe"


def _observing_attention(module, query, key, value, attention_mask, **kwargs):
    cb = _Q_CALLBACKS.get(OBSERVE_ATTN)
    if cb is not None:
        cb(module.layer_idx, query)  # query: [B, H_q, T, D] post-RoPE
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(OBSERVE_ATTN, _observing_attention)


@contextmanager
def attention_implementation(model, name: str):
    """Temporarily switch a model's attention implementation (restored on exit); None: the model's own."""
    if name is None:
        yield
        return
    old = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(old)


@contextmanager
def attention_hook(model, callback: QCallback):
    _Q_CALLBACKS[OBSERVE_ATTN] = callback
    try:
        with attention_implementation(model, OBSERVE_ATTN):
            yield
    finally:
        _Q_CALLBACKS.pop(OBSERVE_ATTN, None)


def attention_modules(model) -> list[torch.nn.Module]:
    """The self-attention modules in layer order (those with a `layer_idx`)."""
    mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "k_proj")]
    return sorted(mods, key=lambda m: m.layer_idx)


@contextmanager
def prerope_key_hooks(model, callback: Callable[[int, torch.Tensor], None]):
    handles = []
    for attn in attention_modules(model):
        idx = attn.layer_idx
        handles.append(attn.k_proj.register_forward_hook(lambda mod, inp, out, idx=idx: callback(idx, out)))
    try:
        yield len(handles)
    finally:
        for h in handles:
            h.remove()
