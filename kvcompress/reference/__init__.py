"""The single reference for every kvcompress number format (DESIGN §2).

Fitting, validation, the transformers cache, the export and the kernels are all tested
against these functions; their rounding points are the kernels' rounding points.

Layout conventions (one layer):
    k, v          : [..., H_kv, T, D]   float (post-RoPE keys, values)
    key scale     : [H_kv, D] float32   static, from the ScaleBook
    key zero      : [H_kv, D] float32   static offset (0 when symmetric)
    outlier index : [H_kv, n_out] int64 key channels kept in fp16
    value meta    : [..., H_kv, T, D // G] float16 (scale and min per token per group)

Rounding: round-half-to-even everywhere (torch.round). fp16 metadata is rounded outward
(min down, scale up) so that a group's range is always covered and nothing is clipped.

int4 packing: two codes per byte along the last dim; element 2i goes to the LOW nibble,
element 2i+1 to the HIGH nibble. Signed int4 key codes q in [-7, 7] are stored
offset-binary as q + 8 (so 0 encodes to 8). int8 key codes are stored as int8.
5..7-bit codes (the per-token family; pack_codes): a row of D * bits / 8 bytes, the low nibbles
packed as int4, then one D/8-byte plane per further bit; signed codes offset-binary (q + 2**(bits-1)).

The package, one concept per module (import from kvcompress.reference; the modules are its sections):
    codes      rounding, code ranges, fp16 outward rounding, packing (int4 nibbles, bit planes, water-filled rows)
    keys       static per-channel keys (zero point, outliers), RoPE pairs, water-filled token-grouped keys
    values     per-token values in channel groups (fp16 scale and min, or the coded min)
    rotated    the Hadamard-rotated per-token formats
    native     TensorRT-LLM's INT8 / FP8 / NVFP4 KV formats with per-layer scales, the fold's pair rotation
    window     the fp16 sink tokens and recent window: which source each query position reads
    nbytes     byte accounting of a compressed cache
    attention  attention over a compressed cache (the CPU oracle of the kernels)
"""
from __future__ import annotations

from kvcompress.reference.attention import (  # noqa: F401
    mixed_attention,
)
from kvcompress.reference.codes import (  # noqa: F401
    FP16_BITS,
    HP_BYTES,
    HP_DTYPE,
    KEY_SCALE_BYTES,
    OUTLIER_INDEX_BYTES,
    bit_offsets,
    key_qmax,
    pack_bits,
    pack_codes,
    pack_int4,
    pack_key_codes,
    round_half_even,
    round_outward_fp16,
    row_bits,
    row_width,
    signed_offset,
    to_hp,
    unpack_bits,
    unpack_codes,
    unpack_int4,
    unpack_key_codes,
    value_levels,
)
from kvcompress.reference.keys import (  # noqa: F401
    KEY_CHANNEL_BITS,
    KeyParams,
    decode_keys,
    dequantize_keys,
    dequantize_keys_grouped,
    encode_keys,
    fake_quant_keys,
    fake_quant_keys_grouped,
    fp16_key_params,
    is_half_split,
    key_clipped,
    load_signed,
    pair_halves,
    pair_spread,
    quantize_keys,
    quantize_keys_grouped,
    rope_pairs,
    split_outliers,
    store_signed,
    waterfill_bits,
)
from kvcompress.reference.native import (  # noqa: F401
    E2M1_BOUNDS,
    E2M1_MAX,
    E2M1_VALUES,
    NATIVE_QMAX,
    NVFP4_BLOCK,
    e2m1_round,
    native_fake_quant,
    native_folded_quant,
    native_folded_saturated,
    native_saturated,
    nvfp4_fake_quant,
    pair_rotate,
)
from kvcompress.reference.nbytes import (  # noqa: F401
    cache_nbytes,
    spec_cache_nbytes,
)
from kvcompress.reference.rotated import (  # noqa: F401
    decode_rotated,
    dequantize_token_symmetric,
    encode_rotated,
    fake_quant_rotated,
    hadamard,
    hadamard_block,
    hadamard_signs,
    quantize_token_symmetric,
    rotate,
)
from kvcompress.reference.values import (  # noqa: F401
    coded_min,
    decode_values,
    dequantize_values,
    encode_values,
    fake_quant_values,
    min_code_step,
    quantize_values,
    value_meta,
    value_meta_coded,
)
from kvcompress.reference.window import (  # noqa: F401
    context_phase_sources,
    fp16_mask,
    region_sizes,
)
from kvcompress.spec import PLANE_BITS  # noqa: F401  (ref.PLANE_BITS: the widths stored as bit planes)
