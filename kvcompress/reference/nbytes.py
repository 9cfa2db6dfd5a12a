"""Byte accounting of a compressed cache (every payload, scale and fp16 region counted)."""
from __future__ import annotations

import dataclasses

from kvcompress.reference.codes import HP_BYTES, KEY_SCALE_BYTES, OUTLIER_INDEX_BYTES
from kvcompress.reference.native import NVFP4_BLOCK
from kvcompress.reference.window import region_sizes


# ---------------------------------------------------------------- byte accounting
def cache_nbytes(
    *,
    n_layers: int,
    n_kv_heads: int,
    head_dim: int,
    key_bits: int,
    value_bits: int,
    value_group: int,
    outlier_channels: int,
    sink_tokens: int,
    window: int,
    n_tokens: int,
    batch: int = 1,
    key_group_tokens: int = 0,
    key_token_group: int = 0,
    value_symmetric: bool = False,
    value_coded_min: bool = False,
    key_channel_bits: bool = False,
) -> dict[str, int]:
    """Exact bytes of every tensor a compressed cache holding n_tokens per sequence allocates.

    Per layer, per kv-head, per sequence:
      compressed token: D*kbits/8 key payload + n_out*2 outliers + D*vbits/8 value payload
                        + (D/G)*2*2 value scale+min;
      fp16 token (sink or window): 2*D*2 (K and V).
    Static (per model, not per sequence): key scale D*4, zero D*4 and n_out*8 outlier index
    per layer-head.
    A 16-bit spec means the plain fp16 cache: every token is 2*D*2.
    Per-token keys (key_token_group=Gk): (D/Gk)*2 key scale per compressed token, no static scales;
    token-grouped keys (key_group_tokens=G): whole groups of key payload, D*2*2 scale+min per group, static
    D bytes of per-channel bits per layer-head when key_channel_bits (kv.key.alloc=waterfill);
    symmetric values: (D/G)*2 (a scale, no min); a coded min: (D/G)*(2+1) (fp16 scale, uint8 min code).
    """
    n_sink, n_comp, n_win = region_sizes(n_tokens, sink_tokens, window)
    lh = n_layers * n_kv_heads * batch
    if key_bits == "native":  # TensorRT-LLM INT8/FP8: one byte per element, one fp32 scale per layer
        return {"key_payload": lh * n_tokens * head_dim, "value_payload": lh * n_tokens * head_dim, "static": n_layers * 4}
    if key_bits == "native_nvfp4":  # 4 bits per element + one FP8 scale per 16 elements (K and V), a global scale per layer
        return {"key_payload": lh * n_tokens * head_dim // 2, "value_payload": lh * n_tokens * head_dim // 2,
                "block_scales": 2 * lh * n_tokens * (head_dim // NVFP4_BLOCK), "static": n_layers * 4}
    if key_bits == 16:
        return {"fp16_tokens": lh * n_tokens * 2 * head_dim * HP_BYTES, "static": 0}
    out = {
        "key_payload": lh * n_comp * head_dim * key_bits // 8,
        "key_outliers": lh * n_comp * outlier_channels * HP_BYTES,
        "value_payload": lh * n_comp * head_dim * value_bits // 8,
        "value_meta": lh * n_comp * (head_dim // value_group) * (HP_BYTES + 1 if value_coded_min else (1 if value_symmetric else 2) * HP_BYTES),
        "sinks": lh * n_sink * 2 * head_dim * HP_BYTES,
        "window": lh * n_win * 2 * head_dim * HP_BYTES,
        "static": n_layers * n_kv_heads * (head_dim * 2 * KEY_SCALE_BYTES + outlier_channels * OUTLIER_INDEX_BYTES),
    }
    if key_group_tokens:  # token-grouped keys: fp16 scale + min per channel per group of tokens, no static scales; a group is
        n_groups = -(-n_comp // key_group_tokens)  # written whole (when its first token leaves the window), so the payload holds whole groups
        out["key_payload"] = lh * n_groups * key_group_tokens * head_dim * key_bits // 8
        out["key_meta"] = lh * n_groups * head_dim * 2 * HP_BYTES
        out["static"] = n_layers * n_kv_heads * head_dim if key_channel_bits else 0  # the bits of each channel (uint8), kv.key.alloc=waterfill
    if key_token_group:  # per-token keys: an fp16 scale per token per group of channels, no static scales
        out["key_meta"] = lh * n_comp * (head_dim // key_token_group) * HP_BYTES
        out["static"] = 0
    return out


def spec_cache_nbytes(spec, geometry, n_tokens: int, batch: int = 1) -> dict[str, int]:
    """cache_nbytes for a KVSpec and a model geometry (see kvcompress.models.base.Geometry);
    per-layer formats, and models with sliding-window layers (a sliding layer holds at most its
    window of tokens, as a serving engine's rolling buffer does; kvcompress's CompressedCache, a
    quality reference, keeps every token): the sum over layers of each layer's own accounting."""
    sliding = any(getattr(geometry, "sliding_windows", ()) or ())
    if spec.is_mixed or sliding:
        out: dict[str, int] = {}
        for i in range(geometry.n_layers):
            one = dataclasses.replace(geometry.layer(i), sliding_windows=())
            f = spec.layer(i) if spec.is_mixed else spec
            for k, v in spec_cache_nbytes(f, one, geometry.stored_tokens(i, n_tokens), batch).items():
                out[k] = out.get(k, 0) + v
        return out
    return cache_nbytes(
        n_layers=geometry.n_layers,
        n_kv_heads=geometry.n_kv_heads,
        head_dim=geometry.head_dim,
        key_bits=("native_nvfp4" if spec.format == "native_nvfp4" else "native") if spec.is_native else spec.key.bits,
        value_bits=spec.value.bits,
        value_group=spec.value_group(geometry.head_dim),
        outlier_channels=spec.outlier_channels,
        sink_tokens=spec.sink_tokens,
        window=spec.window,
        n_tokens=n_tokens,
        batch=batch,
        key_group_tokens=0 if spec.is_native else spec.key.group_tokens,
        key_token_group=spec.key_group(geometry.head_dim) if spec.token_keys else 0,
        value_symmetric=spec.value.symmetric and not spec.is_native,
        value_coded_min=spec.coded_min,
        key_channel_bits=spec.key.alloc == "waterfill" and not spec.is_native,
    )
