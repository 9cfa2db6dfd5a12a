"""One-pass, decode-equivalent attention over a simulated compressed cache (DESIGN §3).

Registered in transformers' `AttentionInterface` as `kvcompress_eval`, so any model that uses
the standard attention interface runs it without forked modeling code. In a teacher-forced
forward, query t reads key/value s in fp16 iff s < sink_tokens or t - s < window, and
otherwise the value the compressed cache would hand back (reference encode -> decode of the
fp16 form). Each position's K/V only depend on earlier positions, so one pass gives the
same logits as token-by-token decoding with `CompressedCache` (tests prove it). This is the
**decode-equivalent** semantics (every token reads the compressed past: pessimistic for a
prompt, which serving engines prefill exactly); perplexity and KL use it and say so.

The evaluation context (which ScaleBook, where to accumulate errors) is bound to the call: it
travels as the `kvc_ctx` keyword through the model's forward to the attention function, so two
evaluations never share state. The model's own attention mask is not read (transformers builds
none for a custom implementation); causality and sliding windows are rebuilt from positions.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kvcompress import reference as ref
from kvcompress.errors import UserError
from kvcompress.eval.metrics import BUCKET_EDGES, position_bucket
from kvcompress.models.observe import attention_chunk, attention_implementation
from kvcompress.scalebook import ScaleBook

EVAL_ATTN = "kvcompress_eval"
ATTN_ERROR_BATCHES = 2  # per-layer attention-output error: a diagnostic measured on the first batches
DECODE_EQUIVALENT = "decode-equivalent: every token reads the compressed past (one teacher-forced pass)"
CONTEXT_PHASE = "context-phase: the prompt attends exactly within itself, the answer is decoded over the compressed cache"
PROMPT_STEPWISE = ("decode-equivalent prompt: the prompt is fed one token per step, every token reading the compressed past "
                   "(as the custom-tier engine feeds it), and the answer is decoded over the compressed cache")


@dataclass
class LayerErrors:
    """Per-layer diagnostics accumulated over eval windows."""

    n_layers: int
    attn_err_sq: torch.Tensor = None  # sum ||o_hat - o||^2 per layer
    attn_ref_sq: torch.Tensor = None  # sum ||o||^2 per layer
    clipped: torch.Tensor = None  # clipped (saturated) K elements (compressed region) per layer
    quantized: torch.Tensor = None  # K elements stored compressed per layer
    v_clipped: torch.Tensor = None  # saturated V elements (native formats; per-token values never clip)
    v_quantized: torch.Tensor = None
    clipped_by_bucket: torch.Tensor = None  # K elements saturating, per position bucket (metrics.BUCKET_EDGES)
    quantized_by_bucket: torch.Tensor = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        z = lambda n=self.n_layers: torch.zeros(n, dtype=torch.float64)  # noqa: E731
        self.attn_err_sq, self.attn_ref_sq, self.clipped, self.quantized = z(), z(), z(), z()
        self.v_clipped, self.v_quantized = z(), z()
        self.clipped_by_bucket, self.quantized_by_bucket = z(len(BUCKET_EDGES) - 1), z(len(BUCKET_EDGES) - 1)

    def clip_rate_by_bucket(self) -> dict[int, float]:
        """{bucket: key clipping rate} for the buckets that stored compressed keys."""
        q = self.quantized_by_bucket
        return {int(b): float(self.clipped_by_bucket[b] / q[b]) for b in torch.nonzero(q > 0).flatten()}

    def rel_attn_error(self) -> list[float]:
        return (self.attn_err_sq / self.attn_ref_sq.clamp(min=1e-30)).sqrt().tolist()

    def clip_rate(self) -> float:
        return float(self.clipped.sum() / self.quantized.sum().clamp(min=1))

    def value_clip_rate(self) -> float:
        return float(self.v_clipped.sum() / self.v_quantized.sum().clamp(min=1))


@dataclass
class EvalContext:
    """What one evaluation call simulates. book=None with exact=True: nothing compressed, no fp16
    rounding (the self-check that this path reproduces the model's own forward)."""

    book: ScaleBook | None
    errors: LayerErrors | None = None
    q_block: int = 256
    exact: bool = False
    # error attribution (eval.attribute): "keys" compresses only the keys (the values read as the fp16 cache holds
    # them), "values" only the values; "" both, as the format does
    only: str = ""


def simulate_kv(key: torch.Tensor, value: torch.Tensor, book: ScaleBook, layer: int):
    """(k_hp, v_hp, k_hat, v_hat): the fp16 and the compressed view of every position.

    Native formats: k_hat = R^-1 (sigma * Q(R k / sigma)) with TensorRT-LLM's per-tensor quantizer Q
    and R the fold's RoPE-pair rotation (identity unless kv.fold_pairs chose one); this is what the
    folded checkpoint caches (q.k is unchanged by the fold, so scores are computed on the unfolded
    query against the mapped-back keys).
    """
    k_hp, v_hp = ref.to_hp(key), ref.to_hp(value)
    if book.spec.is_native:
        sk, sv, s, rot = native_factors(book, layer, key.device)
        fmt = book.spec.format
        return k_hp, v_hp, ref.native_folded_quant(k_hp, sk, s, fmt, rot).to(key.dtype), ref.native_folded_quant(v_hp, sv, s, fmt).to(value.dtype)
    spec = book.layer_spec(layer)  # per-layer formats: this layer's
    if spec.is_baseline:  # an fp16 layer of a per-layer format: the cache holds the fp16 form
        return k_hp, v_hp, k_hp.to(key.dtype), v_hp.to(value.dtype)
    g, D = spec.key.group_tokens, k_hp.shape[-1]
    if g:
        bits = book.key_bits(layer)
        bits = bits.to(k_hp.device).unsqueeze(-2) if torch.is_tensor(bits) else bits  # [H, 1, D]: per channel
        k_hat = ref.fake_quant_keys_grouped(k_hp, bits, g, spec.sink_tokens)
    elif spec.token_keys:
        k_hat = ref.fake_quant_rotated(k_hp, spec.key.bits, spec.key_group(D), True, spec.key.rotate)
    else:
        k_hat = ref.fake_quant_keys(k_hp, book.key_params(layer))
    if spec.rotated_values:
        v_hat = ref.fake_quant_rotated(v_hp, spec.value.bits, book.value_group(layer), spec.value.symmetric, spec.value.rotate, spec.coded_min)
    else:
        v_hat = ref.fake_quant_values(v_hp, spec.value.bits, book.value_group(layer))
    return k_hp, v_hp, k_hat, v_hat


def native_factors(book: ScaleBook, layer: int, device) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor | None]:
    """(key fold [H, 1, D], value fold [H, 1, D], per-tensor dequant scale, key pair angles [H, 1, D/2]
    or None) of a native ScaleBook."""
    t = book.tensors
    rot = t["fold_k_rot"][layer].to(device).unsqueeze(-2) if "fold_k_rot" in t else None
    return t["fold_k"][layer].to(device).unsqueeze(-2), t["fold_v"][layer].to(device).unsqueeze(-2), float(t["native_scale"][layer]), rot


def _count_clips(ctx: EvalContext, layer: int, k_hp: torch.Tensor, v_hp: torch.Tensor) -> None:
    """Key (and, for native formats, value) elements of the compressed region that saturate."""
    e, book = ctx.errors, ctx.book
    spec = book.layer_spec(layer)
    if spec.is_baseline:  # an fp16 layer of a per-layer format stores nothing compressed
        return
    S = k_hp.shape[2]
    pos = torch.arange(S, device=k_hp.device)
    comp = (pos >= spec.sink_tokens) & (pos <= S - 1 - spec.window)  # compressed for the last query
    if spec.is_native:
        sk, sv, s, rot = native_factors(book, layer, k_hp.device)
        kc, vc = ref.native_folded_saturated(k_hp, sk, s, spec.format, rot), ref.native_folded_saturated(v_hp, sv, s, spec.format)
        e.v_clipped[layer] += float(vc[..., comp, :].sum())
        e.v_quantized[layer] += vc[..., comp, :].numel()
    elif spec.key.group_tokens or spec.token_keys:
        kc = torch.zeros_like(k_hp, dtype=torch.bool)  # scales computed at write time from the group's own range: nothing clips
    else:
        kc = ref.key_clipped(k_hp, book.key_params(layer))
    e.clipped[layer] += float(kc[..., comp, :].sum())
    e.quantized[layer] += kc[..., comp, :].numel()
    bucket = position_bucket(pos[comp]).cpu()  # by the position the key is stored at
    per_pos = kc[..., comp, :].sum(dim=(0, 1, 3)).double().cpu()  # [positions]
    e.clipped_by_bucket.index_add_(0, bucket, per_pos)
    e.quantized_by_bucket.index_add_(0, bucket, torch.full_like(per_pos, kc.shape[0] * kc.shape[1] * kc.shape[3]))


def _eval_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    # query: [B, Hq, T, D]; key, value: [B, Hkv, S, D] post-RoPE (S == T: one teacher-forced pass)
    ctx: EvalContext | None = kwargs.pop("kvc_ctx", None)
    if ctx is None:  # compressed_attention passes it through the model's forward; some modeling code drops the keywords
        raise UserError(f"validate: {type(module).__name__} does not pass the forward's keyword arguments to transformers' attention "
                        "interface, so the evaluation context never reaches it; kvcompress cannot evaluate this model")
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")  # Gemma 2's soft cap; GPT-OSS's per-head sink logits
    layer = module.layer_idx
    chunk = attention_chunk(module.config, layer)  # Llama 4's chunked layers (transformers passes them only as a mask)
    S, T = key.shape[2], query.shape[2]
    q_pos = torch.arange(S - T, S, device=query.device)
    window = kwargs.get("sliding_window")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if ctx.exact:
        k_hp, v_hp, k_hat, v_hat, n_sink, win = key, value, key, value, 0, 0
    else:
        spec = ctx.book.spec
        k_hp, v_hp, k_hat, v_hat = simulate_kv(key, value, ctx.book, layer)
        if ctx.only == "keys":
            v_hat = v_hp.to(v_hat.dtype)
        elif ctx.only == "values":
            k_hat = k_hp.to(k_hat.dtype)
        n_sink, win = spec.sink_tokens, spec.window
    out = ref.mixed_attention(
        query, k_hp, v_hp, k_hat, v_hat, q_pos, sink_tokens=n_sink, window=win, scaling=scale, q_block=ctx.q_block, sliding_window=window,
        softcap=softcap, sink_logits=sinks, chunk=chunk,
    )  # [B, Hq, T, D] float32
    if ctx.errors is not None and not ctx.exact:
        e = ctx.errors
        _count_clips(ctx, layer, k_hp, v_hp)
        if e.extra.setdefault("attn_error_batches", {}).setdefault(layer, 0) >= ATTN_ERROR_BATCHES:
            return out.to(query.dtype).transpose(1, 2).contiguous(), None
        e.extra["attn_error_batches"][layer] += 1
        g = query.shape[1] // key.shape[1]
        exact = ref.mixed_attention(query, key, value, key, value, q_pos, sink_tokens=0, window=0, scaling=scale, q_block=ctx.q_block, sliding_window=window,
                                    softcap=softcap, sink_logits=sinks, chunk=chunk) \
            if window or softcap or chunk or sinks is not None else F.scaled_dot_product_attention(query.float(), key.float().repeat_interleave(g, 1), value.float().repeat_interleave(g, 1), is_causal=True, scale=scale)
        e.attn_err_sq[layer] += float((out - exact).pow(2).sum())
        e.attn_ref_sq[layer] += float(exact.pow(2).sum())
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register(EVAL_ATTN, _eval_attention)


ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")  # config.layer_types that keep a KV cache


def check_supported(model, name: str) -> None:
    """Refuse, right after loading and before any work, models whose cache or attention the pipeline cannot
    simulate (one line): encoder-decoders, hybrids whose layers keep a recurrent state (Qwen3-Next, Jamba, Bamba,
    Falcon-H1, Nemotron-H), layers that reuse other layers' caches (Gemma 3n), multi-head latent attention (DeepSeek-V2/V3, Kimi: the cache holds a latent, not per-head
    K/V), and models not laid out as transformers' Llama-family decoders (model.layers, lm_head: GPT-NeoX, Falcon,
    GPT-J, Bloom, MPT, OPT). Soft-capped logits (Gemma 2), attention sinks (GPT-OSS), sliding windows and
    Llama 4's chunked attention are simulated."""
    cfg = model.config
    why = []
    if getattr(cfg, "is_encoder_decoder", False):
        why.append("it is an encoder-decoder model (cross-attention)")
    other = sorted(set(getattr(cfg, "layer_types", None) or []) - set(ATTENTION_LAYER_TYPES))
    if other:
        why.append(f"it is a hybrid: config.layer_types has {', '.join(other)} layers, which keep a recurrent state, not a KV cache "
                   f"(kvcompress compresses attention caches: {', '.join(ATTENTION_LAYER_TYPES)})")
    if getattr(cfg, "num_kv_shared_layers", 0):
        why.append(f"its last {cfg.num_kv_shared_layers} layers reuse earlier layers' KV caches (num_kv_shared_layers: Gemma 3n), which "
                   "the one-pass evaluation does not follow (it differs from decoding through the compressed cache)")
    if getattr(cfg, "kv_lora_rank", None):
        why.append(f"it uses multi-head latent attention (kv_lora_rank={cfg.kv_lora_rank}): its cache holds a compressed latent per token, "
                   "not per-head keys and values")
    if not (hasattr(getattr(model, "model", None), "layers") and hasattr(model, "lm_head")):
        why.append(f"{type(model).__name__} is not laid out as transformers' Llama-family decoders (model.layers and lm_head; "
                   f"it keeps its decoder in .{getattr(model, 'base_model_prefix', '?')})")
    for m in model.modules():
        if hasattr(m, "layer_idx") and hasattr(m, "k_proj") and getattr(m, "is_causal", True) is False:
            why.append("an attention layer is not causal")
            break
    if why:
        raise UserError(f"model {name}: kvcompress cannot simulate its attention: {'; '.join(why)}")


ATTRIBUTION_SIDES = ("keys", "values")


def eval_call(book: ScaleBook | None, errors: LayerErrors | None = None, q_block: int = 256, exact: bool = False,
              only: str = "") -> tuple[str | None, dict]:
    """(attention implementation, forward keywords) of one evaluation: (None, {}) for a baseline
    book (the model's own attention), else the evaluation attention with a fresh context. only: one
    of ATTRIBUTION_SIDES compresses that side of the cache alone (EvalContext.only)."""
    if only and only not in ATTRIBUTION_SIDES:
        raise ValueError(f"only={only!r}: one of {ATTRIBUTION_SIDES} or ''")
    if not exact and (book is None or book.spec.is_baseline):
        return None, {}
    return EVAL_ATTN, {"kvc_ctx": EvalContext(book, errors, q_block, exact, only)}


@contextmanager
def compressed_attention(model, book: ScaleBook | None, errors: LayerErrors | None = None, q_block: int = 256, exact: bool = False):
    """Within the block, call the model as `model(ids, **kw)` where kw carries the evaluation context.

        with compressed_attention(model, book) as kw:
            logits = model(input_ids=ids, **kw).logits

    The model's attention reads the simulated compressed cache of `book` (decode-equivalent). A
    baseline (fp16) book leaves the model's own attention untouched. exact=True (book None): the
    evaluation path with nothing compressed, for the self-check.
    """
    impl, kw = eval_call(book, errors, q_block, exact)
    with attention_implementation(model, impl):
        yield kw
