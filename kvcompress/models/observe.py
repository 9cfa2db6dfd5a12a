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


def attention_chunk(config, layer: int) -> int | None:
    """The chunk size of a chunked-attention layer (config.layer_types[layer] == "chunked_attention": Llama 4), else None."""
    types = getattr(config, "layer_types", None)
    if types and types[layer] == "chunked_attention":
        return int(config.attention_chunk_size)
    return None


def _observing_attention(module, query, key, value, attention_mask, **kwargs):
    cb = _Q_CALLBACKS.get(OBSERVE_ATTN)
    if cb is not None:
        cb(module.layer_idx, query)  # query: [B, H_q, T, D] post-RoPE
    S = key.shape[2]
    window, chunk = kwargs.get("sliding_window"), attention_chunk(module.config, module.layer_idx)
    if kwargs.get("softcap") is None and kwargs.get("s_aux") is None and not (window and S > window) and not (chunk and S > chunk):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    # SDPA has no soft cap (Gemma 2) and ignores attention sinks (GPT-OSS); under this registered attention transformers
    # builds no sliding-window or chunked mask: where one of them binds, the reference computes the model's own attention
    # (a teacher-forced pass of one unpadded window, keys and queries at the same positions)
    from kvcompress import reference as ref

    scaling = kwargs.get("scaling")
    out = ref.mixed_attention(query, key, value, key, value, torch.arange(S - query.shape[2], S, device=query.device), sink_tokens=0, window=0,
                              scaling=scaling if scaling is not None else query.shape[-1] ** -0.5, sliding_window=window,
                              softcap=kwargs.get("softcap"), sink_logits=kwargs.get("s_aux"), chunk=chunk)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


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
