"""A transformers Cache that SIMULATES TensorRT-LLM's native INT8/FP8 KV cache (evaluation only).

TensorRT-LLM stores every token with one per-tensor scale per layer shared by K and V; kvcompress
folds per-channel factors into the weights first. This cache keeps what that cache hands back,
k_hat = sigma * Q(k / sigma) (reference.native_fake_quant), as float tensors: it is a numerical
simulation for scoring the native fallback on generated tasks, not a memory-saving cache (the
real one is TensorRT-LLM's). Same call semantics as CompressedCache: a call with C > 1 tokens
is a context-phase chunk (exact within itself), a call with one token a generation step.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvcompress import reference as ref
from kvcompress.eval.attention import native_factors
from kvcompress.scalebook import ScaleBook


class _NativeSimLayer(CacheLayerMixin):
    is_sliding = False

    def __init__(self, book: ScaleBook, layer_idx: int):
        super().__init__()
        self.book, self.layer_idx = book, layer_idx
        self.k_hat = self.v_hat = None
        self.n_tokens = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        # key_states, value_states: [B, H, C, D] new post-RoPE tokens
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        sk, sv, s = native_factors(self.book, self.layer_idx, key_states.device)
        fmt = self.book.spec.format
        kq = (ref.native_fake_quant(ref.to_hp(key_states) / sk, s, fmt) * sk).to(self.dtype)
        vq = (ref.native_fake_quant(ref.to_hp(value_states) / sv, s, fmt) * sv).to(self.dtype)
        self.k_hat = kq if self.k_hat is None else torch.cat([self.k_hat, kq], -2)
        self.v_hat = vq if self.v_hat is None else torch.cat([self.v_hat, vq], -2)
        self.n_tokens += key_states.shape[-2]
        C = key_states.shape[-2]
        if C > 1:  # context phase: the chunk reads itself exactly
            return torch.cat([self.k_hat[..., :-C, :], key_states], -2), torch.cat([self.v_hat[..., :-C, :], value_states], -2)
        return self.k_hat, self.v_hat

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n_tokens + query_length, 0

    def get_seq_length(self) -> int:
        return self.n_tokens

    def get_max_length(self) -> int:
        return -1


class SimulatedNativeCache(Cache):
    """See the module docstring: a simulation of TensorRT-LLM's INT8/FP8 KV cache."""

    def __init__(self, book: ScaleBook):
        super().__init__(layers=[_NativeSimLayer(book, i) for i in range(book.geometry["n_layers"])])
        self.book = book


def cache_for(book: ScaleBook) -> Cache:
    """The cache that holds `book`'s format: the real CompressedCache, or the native simulation."""
    if book.spec.is_native:
        return SimulatedNativeCache(book)
    from kvcompress.cache import CompressedCache

    return CompressedCache(book)
