"""One-pass, decode-equivalent attention over a simulated compressed cache (DESIGN §3).

Registered in transformers' `AttentionInterface` as `kvcompress_eval`, so any model that uses
the standard attention interface runs it without forked modeling code. In a teacher-forced
forward, query t reads key/value s in fp16 iff s < sink_tokens or t - s < window, and
otherwise the value the compressed cache would hand back (reference encode -> decode of the
fp16 form). Each position's K/V only depend on earlier positions, so one pass gives the
same logits as token-by-token decoding with `CompressedCache` (tests prove it).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kvcompress import reference as ref
from kvcompress.models.observe import attention_implementation
from kvcompress.scalebook import ScaleBook

EVAL_ATTN = "kvcompress_eval"


@dataclass
class LayerErrors:
    """Per-layer diagnostics accumulated over eval windows."""

    n_layers: int
    attn_err_sq: torch.Tensor = None  # sum ||o_hat - o||^2 per layer
    attn_ref_sq: torch.Tensor = None  # sum ||o||^2 per layer
    clipped: torch.Tensor = None  # clipped key elements (compressed region) per layer
    quantized: torch.Tensor = None  # key elements stored compressed per layer
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        z = lambda: torch.zeros(self.n_layers, dtype=torch.float64)  # noqa: E731
        self.attn_err_sq, self.attn_ref_sq, self.clipped, self.quantized = z(), z(), z(), z()

    def rel_attn_error(self) -> list[float]:
        return (self.attn_err_sq / self.attn_ref_sq.clamp(min=1e-30)).sqrt().tolist()

    def clip_rate(self) -> float:
        return float(self.clipped.sum() / self.quantized.sum().clamp(min=1))


@dataclass
class _Ctx:
    book: ScaleBook
    errors: LayerErrors | None
    q_block: int


_CTX: dict[str, _Ctx] = {}


def simulate_kv(key: torch.Tensor, value: torch.Tensor, book: ScaleBook, layer: int):
    """(k_hp, v_hp, k_hat, v_hat): the fp16 and the compressed view of every position.

    Native formats: k_hat = sigma * Q(k / sigma) with TensorRT-LLM's per-tensor quantizer Q; this is
    what the folded checkpoint caches (q.k is unchanged by the fold, so scores are computed on the
    unfolded query against sigma-rescaled keys).
    """
    k_hp, v_hp = ref.to_hp(key), ref.to_hp(value)
    if book.spec.is_native:
        t = book.tensors
        sk, sv = t["fold_k"][layer].to(key.device).unsqueeze(-2), t["fold_v"][layer].to(key.device).unsqueeze(-2)  # [H, 1, D]
        s = float(t["native_scale"][layer])
        fmt = book.spec.format
        return k_hp, v_hp, (ref.native_fake_quant(k_hp / sk, s, fmt) * sk).to(key.dtype), (ref.native_fake_quant(v_hp / sv, s, fmt) * sv).to(value.dtype)
    k_hat = ref.fake_quant_keys(k_hp, book.key_params(layer))
    v_hat = ref.fake_quant_values(v_hp, book.spec.value.bits, book.value_group)
    return k_hp, v_hp, k_hat, v_hat


def _eval_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    # query: [B, Hq, T, D]; key, value: [B, Hkv, S, D] post-RoPE (S == T: one teacher-forced pass)
    # attention_mask is not read: eval windows are unpadded and causality is rebuilt from positions
    ctx = _CTX[EVAL_ATTN]
    layer = module.layer_idx
    spec = ctx.book.spec
    S, T = key.shape[2], query.shape[2]
    q_pos = torch.arange(S - T, S, device=query.device)
    k_hp, v_hp, k_hat, v_hat = simulate_kv(key, value, ctx.book, layer)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = ref.mixed_attention(
        query, k_hp, v_hp, k_hat, v_hat, q_pos, sink_tokens=spec.sink_tokens, window=spec.window, scaling=scale, q_block=ctx.q_block
    )  # [B, Hq, T, D] float32
    if ctx.errors is not None:
        e = ctx.errors
        g = query.shape[1] // key.shape[1]
        exact = F.scaled_dot_product_attention(
            query.float(), key.float().repeat_interleave(g, 1), value.float().repeat_interleave(g, 1), is_causal=True, scale=scale
        )  # the same layer inputs through an uncompressed cache
        e.attn_err_sq[layer] += float((out - exact).pow(2).sum())
        e.attn_ref_sq[layer] += float(exact.pow(2).sum())
        # keys that end up compressed: positions outside the sinks and the window of the last query
        comp = (torch.arange(S, device=key.device) >= spec.sink_tokens) & (torch.arange(S, device=key.device) <= S - 1 - spec.window)
        if not spec.is_native:
            clipped = ref.key_clipped(k_hp, ctx.book.key_params(layer))[..., comp, :]
            e.clipped[layer] += float(clipped.sum())
            e.quantized[layer] += clipped.numel()
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register(EVAL_ATTN, _eval_attention)


@contextmanager
def compressed_attention(model, book: ScaleBook, errors: LayerErrors | None = None, q_block: int = 512):
    """Within the block, the model's attention reads the simulated compressed cache of `book`.

    A baseline (fp16) book leaves the model's own attention untouched.
    """
    if book.spec.is_baseline:
        yield
        return
    _CTX[EVAL_ATTN] = _Ctx(book, errors, q_block)
    try:
        with attention_implementation(model, EVAL_ATTN):
            yield
    finally:
        _CTX.pop(EVAL_ATTN, None)
