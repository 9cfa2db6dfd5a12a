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
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from kvcompress.spec import PLANE_BITS

HP_DTYPE = torch.float16  # dtype of the window, sinks, outlier side store and value metadata
HP_BYTES = 2
KEY_SCALE_BYTES = 4  # static per-channel key scale and zero point (fp32)
OUTLIER_INDEX_BYTES = 8  # static outlier channel index (int64)


def round_half_even(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties to even (torch.round's rule)."""
    return torch.round(x)


def key_qmax(bits: int) -> int:
    """Largest symmetric key code: 127 for int8, 7 for int4."""
    return 2 ** (bits - 1) - 1


def value_levels(bits: int) -> int:
    """Number of steps of an unsigned value code: 255 for int8, 15 for int4."""
    return 2**bits - 1


def to_hp(x: torch.Tensor) -> torch.Tensor:
    """What the fp16 parts of the cache hand back: x rounded through float16, in x's dtype."""
    return x.to(HP_DTYPE).to(x.dtype)


# ---------------------------------------------------------------- int4 packing
def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in [0, 15], last dim even -> uint8 bytes, last dim halved (low nibble = even index)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs an even last dim, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: uint8 [..., D/2] -> uint8 codes [..., D]."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


# PLANE_BITS (kvcompress.spec): code widths stored in bit planes (pack_codes: 3 bits as planes alone, 5..7 a nibble plus planes); 4 and 8 pack as int4 and bytes


def row_width(head_dim: int, bits: int) -> int:
    """Elements of one stored row of a head's codes: fp16 rows (bits 16) hold head_dim halves, codes of
    4..8 bits head_dim * bits / 8 bytes (pack_codes)."""
    return head_dim if bits == FP16_BITS else head_dim * bits // 8


def row_bits(head_dim: int, width: int, dtype: torch.dtype) -> int:
    """row_width's inverse: a stored row's code width from its element count and dtype."""
    return FP16_BITS if dtype == torch.float16 else width * 8 // head_dim


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes uint8 [..., D] < 2**bits -> one stored row of D * bits / 8 bytes: 8 bits as bytes,
    4 bits as pack_int4; 5..7 bits (PLANE_BITS) as the low nibbles packed as pack_int4 (D/2 bytes) followed
    by bits - 4 planes of D/8 bytes, plane p holding bit 4 + p of channel d at bit d % 8 of byte d // 8
    (LSB first); 3 bits as three such planes alone, plane p holding bit p. D must be a multiple of 8 for the planes."""
    if bits == 8:
        return codes
    if bits == 4:
        return pack_int4(codes)
    if bits not in PLANE_BITS or codes.shape[-1] % 8:
        raise ValueError(f"pack_codes: bits must be 3..8 and, for 3 and 5..7 bits, the last dim a multiple of 8; got bits={bits}, D={codes.shape[-1]}")
    c = codes.to(torch.int64)
    weights = 2 ** torch.arange(8, device=codes.device)
    low = 0 if bits < 4 else 4  # the bits held in the nibbles
    planes = [(((c >> (low + p)) & 1).unflatten(-1, (-1, 8)) * weights).sum(-1).to(torch.uint8) for p in range(bits - low)]
    return torch.cat(planes if bits < 4 else [pack_int4(codes & 0x0F), *planes], -1)


def unpack_codes(payload: torch.Tensor, bits: int) -> torch.Tensor:
    """pack_codes' inverse: a stored row -> uint8 codes [..., D]."""
    if bits == 8:
        return payload
    D = payload.shape[-1] * 8 // bits
    low = 0 if bits < 4 else 4
    if bits < 4:
        codes = torch.zeros(*payload.shape[:-1], D, dtype=torch.uint8, device=payload.device)
    else:
        codes = unpack_int4(payload[..., : D // 2])
    if bits == 4:
        return codes
    start = D // 2 if low else 0
    for p in range(bits - low):
        plane = payload[..., start + p * (D // 8) : start + (p + 1) * (D // 8)].to(torch.int64)
        bit = (plane.unsqueeze(-1) >> torch.arange(8, device=payload.device)) & 1
        codes = codes | (bit.flatten(-2) << (low + p)).to(torch.uint8)
    return codes


def signed_offset(bits: int) -> int:
    """The offset of signed codes stored offset-binary (q + 2**(bits-1), bits < 8); int8 codes are stored as they are."""
    return 2 ** (bits - 1)


# ---------------------------------------------------------------- keys
@dataclass(frozen=True)
class KeyParams:
    """Static key parameters of one layer (a slice of the ScaleBook)."""

    bits: int
    scale: torch.Tensor  # [H, D] float32
    zero: torch.Tensor  # [H, D] float32
    outlier_idx: torch.Tensor  # [H, n_out] int64 (n_out may be 0)


FP16_BITS = 16  # key_bits == value_bits == 16: an fp16 layer of a per-layer format, whose store holds the fp16 K and V


def fp16_key_params(n_kv_heads: int, head_dim: int) -> KeyParams:
    """The static family's key parameters for an fp16 layer (key_bits 16): scale 1, zero 0, no outlier
    channels. The kernels read none of them for such a layer; the plugins still take the inputs."""
    return KeyParams(FP16_BITS, torch.ones(n_kv_heads, head_dim), torch.zeros(n_kv_heads, head_dim), torch.zeros(n_kv_heads, 0, dtype=torch.long))


def _bcast(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # p: [H, D] -> [H, 1, D] so that it broadcasts against x: [..., H, T, D]
    return p.to(device=x.device, dtype=torch.float32).unsqueeze(-2)


def quantize_keys(k: torch.Tensor, p: KeyParams) -> torch.Tensor:
    """k: [..., H, T, D] -> int codes in [-Q, Q] (int8 tensor), outlier channels set to 0."""
    qmax = key_qmax(p.bits)
    q = round_half_even((k.float() - _bcast(p.zero, k)) / _bcast(p.scale, k)).clamp_(-qmax, qmax)
    if p.outlier_idx.numel():
        q.scatter_(-1, _expand_idx(p.outlier_idx, q), 0.0)
    return q.to(torch.int8)


def dequantize_keys(q: torch.Tensor, p: KeyParams, k_outliers: torch.Tensor | None = None) -> torch.Tensor:
    """int codes [..., H, T, D] (+ fp16 outliers [..., H, T, n_out]) -> float32 keys."""
    k = q.float() * _bcast(p.scale, q) + _bcast(p.zero, q)
    if p.outlier_idx.numel():
        k.scatter_(-1, _expand_idx(p.outlier_idx, k), k_outliers.float())
    return k


def key_clipped(k: torch.Tensor, p: KeyParams) -> torch.Tensor:
    """Bool mask of key elements outside the representable range (clipped), outliers excluded."""
    qmax = key_qmax(p.bits)
    z = (k.float() - _bcast(p.zero, k)) / _bcast(p.scale, k)
    clipped = z.abs() > qmax + 0.5
    if p.outlier_idx.numel():
        clipped.scatter_(-1, _expand_idx(p.outlier_idx, clipped), False)
    return clipped


def _expand_idx(idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # idx: [H, n_out] -> [..., H, T, n_out] matching x: [..., H, T, D]
    idx = idx.to(x.device).unsqueeze(-2)
    return idx.expand(*x.shape[:-1], idx.shape[-1])


def split_outliers(k: torch.Tensor, p: KeyParams) -> torch.Tensor:
    """The fp16 side store: k[..., H, T, idx] -> [..., H, T, n_out] float16."""
    return torch.gather(k, -1, _expand_idx(p.outlier_idx, k)).to(HP_DTYPE)


def store_signed(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed codes -> payload: int8 [.., D] as is; 4..7 bits offset-binary (q + 2**(bits-1), signed_offset)
    packed by pack_codes (int4: uint8 [.., D/2])."""
    return q if bits == 8 else pack_codes((q + signed_offset(bits)).to(torch.uint8), bits)


def load_signed(payload: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of store_signed: signed integer codes [.., D]."""
    return payload if bits == 8 else unpack_codes(payload, bits).to(torch.int16) - signed_offset(bits)


def encode_keys(k: torch.Tensor, p: KeyParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Storage form of keys: (payload, outliers). payload is int8 [.., D] or packed uint8 [.., D/2]."""
    return store_signed(quantize_keys(k, p), p.bits), split_outliers(k, p)


def decode_keys(payload: torch.Tensor, outliers: torch.Tensor, p: KeyParams) -> torch.Tensor:
    """Inverse of encode_keys (up to quantization): float32 keys [..., H, T, D]."""
    return dequantize_keys(load_signed(payload, p.bits), p, outliers)


def fake_quant_keys(k: torch.Tensor, p: KeyParams) -> torch.Tensor:
    """decode(encode(k)) in k's dtype: what the compressed cache hands back for a stored key."""
    return decode_keys(*encode_keys(k, p), p).to(k.dtype)


KEY_CHANNEL_BITS = (1, 8)  # kv.key.alloc=waterfill: the fewest and most bits one key channel gets


def rope_pairs(head_dim: int, rotary_dim: int | None = None) -> torch.Tensor:
    """[2, head_dim/2] int64: the channels (a[j], b[j]) of pair j, the two channels RoPE rotates together.
    Full rotary (GPT-NeoX layout, Llama, Qwen, Mistral): (j, j + D/2). Partial rotary (Phi, GPT-NeoX, StableLM:
    only the first r channels rotate): (j, j + r/2) for j < r/2, then the D - r pass-through channels paired among
    themselves, (r + m, r + (D - r)/2 + m). A pass-through pair never rotates, so tying or rotating it is exact too."""
    D, r = head_dim, rotary_dim or head_dim
    if D % 2 or r % 2 or (D - r) % 2 or not 0 < r <= D:
        raise ValueError(f"rope_pairs: needs even head_dim and rotary_dim with 0 < rotary_dim <= head_dim; got {D}, {r}")
    h, p = r // 2, (D - r) // 2
    a = torch.cat([torch.arange(h), r + torch.arange(p)])
    return torch.stack([a, torch.cat([torch.arange(h) + h, r + p + torch.arange(p)])])


def is_half_split(pairs: torch.Tensor | None) -> bool:
    """Whether `pairs` (rope_pairs) is the full-rotary layout (j, j + D/2) (None: it is, by default)."""
    return pairs is None or torch.equal(pairs, rope_pairs(2 * pairs.shape[-1]))


def pair_halves(x: torch.Tensor, pairs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x[..., a], x[..., b]) [..., D/2] each: the first and second channel of every RoPE pair."""
    if pairs is None:
        D = x.shape[-1]
        return x[..., : D // 2], x[..., D // 2 :]
    return x[..., pairs[0].to(x.device)], x[..., pairs[1].to(x.device)]


def pair_spread(p: torch.Tensor, pairs: torch.Tensor | None = None, other: torch.Tensor | None = None) -> torch.Tensor:
    """[..., D] with both channels of pair j set to p[..., j] (or the second to other[..., j])."""
    q = p if other is None else other
    if pairs is None:
        return torch.cat([p, q], -1)
    out = p.new_empty(*p.shape[:-1], 2 * p.shape[-1])
    out[..., pairs[0].to(p.device)] = p
    out[..., pairs[1].to(p.device)] = q
    return out


def waterfill_bits(weight: torch.Tensor, mean_bits: int, lo: int = KEY_CHANNEL_BITS[0], hi: int = KEY_CHANNEL_BITS[1],
                   pairs: torch.Tensor | None = None) -> torch.Tensor:
    """Bits per key channel (kv.key.alloc=waterfill): int64 [..., D] with the two channels of a RoPE pair
    (rope_pairs; default (d, d + D/2)) equal, each in [lo, hi], mean exactly mean_bits.

    weight [..., D]: the q.k score error each channel adds per unit of squared step, E[q_d^2] * E[range_d^2]
    (calibration queries' second moment times the squared range of the channel's token groups). A channel
    with b bits adds weight * 4**-b (its step halves per bit), so the greedy reverse water-filling below,
    one bit at a time to the pair whose error it cuts most (ties: the lower index), minimises the sum."""
    D = weight.shape[-1]
    if D % 2 or not lo <= mean_bits <= hi:
        raise ValueError(f"waterfill_bits: needs an even head dim and lo <= mean_bits <= hi; got D={D}, mean_bits={mean_bits}, [{lo}, {hi}]")
    wa, wb = pair_halves(weight, pairs)
    wp = (wa + wb).double()
    b = torch.full(wp.shape, lo, dtype=torch.int64)
    for _ in range((mean_bits - lo) * (D // 2)):
        gain = (wp * torch.pow(4.0, -b.double())).masked_fill(b >= hi, -1.0)
        idx = gain.argmax(-1, keepdim=True)
        b.scatter_add_(-1, idx, torch.ones_like(idx))
    return pair_spread(b, pairs)


def quantize_keys_grouped(k: torch.Tensor, bits, group_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys per channel over groups of `group_tokens` tokens (kv.key.group_tokens), asymmetric, the group's
    fp16 scale and min rounded outward (nothing clips): the value quantizer applied along tokens.
    k [..., T, D] with T a multiple of G; bits an int or int tensor broadcastable to [..., 1, D] (per channel).
    -> (codes uint8 [..., T, D] in [0, 2**bits - 1], scale fp16 [..., T/G, D], min fp16 [..., T/G, D])."""
    levels = (2 ** torch.as_tensor(bits, device=k.device) - 1).float()  # [..., 1, D] or scalar
    kg = k.float().unflatten(-2, (-1, group_tokens))  # [..., n, G, D]
    vmin = _round_outward_fp16(kg.amin(-2), float("-inf"))
    scale = _round_outward_fp16((kg.amax(-2) - vmin.float()) / levels, float("inf"))
    s = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    q = round_half_even((kg - vmin.float().unsqueeze(-2)) / s.unsqueeze(-2)).clamp_(min=0).minimum(levels.unsqueeze(-2) if levels.dim() else levels)
    return q.flatten(-3, -2).to(torch.uint8), scale, vmin


def dequantize_keys_grouped(codes: torch.Tensor, scale: torch.Tensor, vmin: torch.Tensor, group_tokens: int) -> torch.Tensor:
    """codes uint8 [..., T, D], scale/min [..., T/G, D] -> float32 [..., T, D]: q * scale + min."""
    q = codes.float().unflatten(-2, (-1, group_tokens))
    return (q * scale.float().unsqueeze(-2) + vmin.float().unsqueeze(-2)).flatten(-3, -2)


def fake_quant_keys_grouped(k: torch.Tensor, bits, group_tokens: int, start: int = 0) -> torch.Tensor:
    """Token-grouped keys as the cache hands them back, in k's dtype: groups of `group_tokens` positions
    aligned at `start` (the first compressed position: sink_tokens), [start + G*j, start + G*j + G), each
    quantized when written (quantize_keys_grouped); positions before `start` come back unchanged (fp16
    sinks). k: [..., T, D]; a last partial group is quantized over the tokens it has (in the one-pass
    evaluation it is always inside the fp16 window, so its values are never read)."""
    head, body = k[..., :start, :], k[..., start:, :]
    T = body.shape[-2]
    pad = (-T) % group_tokens
    if pad:
        body = torch.cat([body, body[..., -1:, :].expand(*body.shape[:-2], pad, body.shape[-1])], -2)  # repeat the last token: no effect on min/max
    out = dequantize_keys_grouped(*quantize_keys_grouped(body, bits, group_tokens), group_tokens)[..., :T, :]
    return torch.cat([head, out.to(k.dtype)], -2)


def bit_offsets(bits: torch.Tensor) -> torch.Tensor:
    """Where each channel's code starts in a packed row (pack_bits): the exclusive prefix sum of the widths [..., D]."""
    return bits.cumsum(-1) - bits


def _bit_layout(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(channel, bit) of every bit of a packed row, LSB first: channel d holds bits [off_d, off_d + bits_d) of
    the row, off the exclusive prefix sum of bits; and the row's byte count."""
    b = [int(x) for x in bits.tolist()]
    ch = torch.tensor([d for d, n in enumerate(b) for _ in range(n)], dtype=torch.int64)
    bit = torch.tensor([j for n in b for j in range(n)], dtype=torch.int64)
    return ch, bit, -(-sum(b) // 8)


def pack_bits(codes: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Codes of varying width per channel into a bitstream per row: codes uint8 [..., D], bits int [D]
    (channel d's code < 2**bits[d]) -> uint8 [..., ceil(sum(bits) / 8)]. Channel d occupies bits
    [off_d, off_d + bits_d) of the row, off = the exclusive prefix sum of bits; bit i of the row is bit
    i % 8 of byte i // 8 (LSB first). A code may straddle two bytes. Unused tail bits are 0."""
    ch, bit, nbytes = _bit_layout(bits)
    stream = (codes[..., ch].to(torch.int64) >> bit) & 1  # [..., total bits]
    stream = torch.nn.functional.pad(stream, (0, nbytes * 8 - stream.shape[-1]))
    return (stream.unflatten(-1, (nbytes, 8)) << torch.arange(8)).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """pack_bits' inverse: uint8 [..., nbytes] -> uint8 codes [..., D]."""
    ch, bit, _ = _bit_layout(bits)
    stream = ((packed.to(torch.int64).unsqueeze(-1) >> torch.arange(8)) & 1).flatten(-2)[..., : ch.numel()]
    out = torch.zeros(*packed.shape[:-1], bits.numel(), dtype=torch.int64)
    out.index_add_(-1, ch, stream << bit)
    return out.to(torch.uint8)


def pack_key_codes(codes: torch.Tensor, bits) -> torch.Tensor:
    """Token-grouped key codes uint8 [..., H, n, D] as stored: with per-channel widths bits [H, D] one bitstream
    per row and head (pack_bits), with an int width 4-bit codes two per byte (pack_int4), 8-bit codes as bytes."""
    if torch.is_tensor(bits):
        return torch.stack([pack_bits(codes[..., h, :, :].cpu(), bits[h].cpu()) for h in range(bits.shape[0])], -3).to(codes.device)
    return pack_int4(codes) if bits == 4 else codes


def unpack_key_codes(payload: torch.Tensor, bits) -> torch.Tensor:
    """pack_key_codes' inverse: the stored payload [..., H, n, bytes] -> uint8 codes [..., H, n, D]."""
    if torch.is_tensor(bits):
        return torch.stack([unpack_bits(payload[..., h, :, :].cpu(), bits[h].cpu()) for h in range(bits.shape[0])], -3).to(payload.device)
    return unpack_int4(payload) if bits == 4 else payload


# ---------------------------------------------------------------- values
def _round_outward_fp16(x: torch.Tensor, direction: float) -> torch.Tensor:
    """Round float32 -> float16 toward -inf (direction=-inf) or +inf (direction=+inf)."""
    h = x.to(HP_DTYPE)
    off = (h.float() > x) if direction < 0 else (h.float() < x)
    step = torch.full_like(h, direction)
    return torch.where(off, torch.nextafter(h, step), h)


def value_meta(v: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-group (scale, min) in float16, rounded outward. v: [..., T, D] -> [..., T, D//G] each."""
    vg = v.float().unflatten(-1, (-1, group))  # [..., T, D//G, G]
    vmin = _round_outward_fp16(vg.amin(-1), float("-inf"))
    vmax = vg.amax(-1)
    scale = _round_outward_fp16((vmax - vmin.float()) / value_levels(bits), float("inf"))
    return scale, vmin


def min_code_step(bits: int) -> int:
    """F of the coded min (kv.value.min=code): the min is -w * scale / F, w a uint8; F = 2**(8 - bits):
    16 for 4-bit values, 8 for 5-bit, 1 for 8-bit (the largest power of two with F * (levels - 1/F) <= 255)."""
    return 2 ** (8 - bits)


def value_meta_coded(v: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Values with a coded min (kv.value.min=code): per token, per group an fp16 scale and a uint8 w,
    the group's min being -w * scale / F (min_code_step): 3 bytes per group instead of 4. The range
    is widened to include 0 (so w >= 0 fits a byte) and the scale is (max - min) / (levels - 1/F),
    fp16 rounded up, so the min rounded down to a multiple of scale / F still reaches the max.
    v: [..., T, D] -> (scale fp16, w uint8), [..., T, D//G] each."""
    F = min_code_step(bits)
    vg = v.float().unflatten(-1, (-1, group))
    lo, hi = vg.amin(-1).clamp(max=0.0), vg.amax(-1).clamp(min=0.0)
    scale = _round_outward_fp16((hi - lo) / (value_levels(bits) - 1.0 / F), float("inf"))
    s = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    w = torch.floor(-lo * float(F) / s).clamp_(0, 255)  # -w s / F <= lo: the min rounded down
    w = torch.where(-w * s > lo * F, w + 1, w).clamp_(0, 255)  # guard the division's rounding
    return scale, w.to(torch.uint8)


def coded_min(w: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """A coded min, float32: -w * scale / F (exact: a byte times an fp16 times a power of two)."""
    return -(w.float() * scale.float()) * (1.0 / min_code_step(bits))


def _min_f32(vmin: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """The min as float32: fp16 as stored, or a uint8 code (value_meta_coded)."""
    return coded_min(vmin, scale, bits) if vmin.dtype == torch.uint8 else vmin.float()


def quantize_values(v: torch.Tensor, bits: int, group: int, coded_min: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """v: [..., T, D] -> (codes uint8 [..., T, D] in [0, 2**bits-1], scale fp16, min [..., T, D//G]):
    the min fp16 (value_meta), or with coded_min a uint8 code (value_meta_coded)."""
    scale, vmin = (value_meta_coded if coded_min else value_meta)(v, bits, group)
    s = torch.where(scale == 0, torch.ones_like(scale), scale).float().unsqueeze(-1)
    vg = v.float().unflatten(-1, (-1, group))
    q = round_half_even((vg - _min_f32(vmin, scale, bits).unsqueeze(-1)) / s).clamp_(0, value_levels(bits))
    return q.flatten(-2).to(torch.uint8), scale, vmin


def dequantize_values(codes: torch.Tensor, scale: torch.Tensor, vmin: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """codes uint8 [..., T, D], meta [..., T, D//G] -> float32 [..., T, D]:  q * scale + min
    (a uint8 min is a code: value_meta_coded, which needs the value bits)."""
    q = codes.float().unflatten(-1, (-1, group))
    return (q * scale.float().unsqueeze(-1) + _min_f32(vmin, scale, bits).unsqueeze(-1)).flatten(-2)


def encode_values(v: torch.Tensor, bits: int, group: int, coded_min: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Storage form of values: (payload uint8 [.., D * bits / 8] (pack_codes), scale fp16, min fp16 or uint8 code)."""
    codes, scale, vmin = quantize_values(v, bits, group, coded_min)
    return pack_codes(codes, bits), scale, vmin


def decode_values(payload: torch.Tensor, scale: torch.Tensor, vmin: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    return dequantize_values(unpack_codes(payload, bits), scale, vmin, group, bits)


def fake_quant_values(v: torch.Tensor, bits: int, group: int, coded_min: bool = False) -> torch.Tensor:
    """decode(encode(v)) in v's dtype."""
    return decode_values(*encode_values(v, bits, group, coded_min), bits, group).to(v.dtype)


# ---------------------------------------------------------------- rotated, per-token formats (CompressedCache, validate, the Triton kernels)
def hadamard_signs(n: int, device=None) -> torch.Tensor:
    """The Sylvester-Hadamard sign matrix [n, n] (n a power of two), float32 entries
    (-1)**popcount(i & j): symmetric, S @ S = n I. The kernels build the same signs in registers.
    A new tensor on every call (rotate reads a shared copy, _signs)."""
    return _signs(n, str(torch.device(device or "cpu"))).clone()


@functools.lru_cache(maxsize=32)
def _signs(n: int, device: str) -> torch.Tensor:
    """hadamard_signs built once per size and device: rotate runs on every stored token of every layer (CompressedCache
    encodes and decodes through it at each generation step), and building the matrix cost more than the product.
    Shared: never modified in place."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two size; got {n}")
    i = torch.arange(n)
    x = i[:, None] & i[None, :]
    parity = torch.zeros_like(x)
    while bool(x.any()):
        parity ^= x & 1
        x = x >> 1
    return (1 - 2 * parity).float().to(device)


def hadamard(n: int, device=None) -> torch.Tensor:
    """The normalised Hadamard matrix S / sqrt(n): symmetric and orthogonal (H @ H = I), so x @ H
    rotates a head's vector and (x @ H) @ H gives it back; q.k is unchanged when both sides are rotated."""
    return hadamard_signs(n, device) * n**-0.5


def hadamard_block(n: int) -> int:
    """The size of the Hadamard blocks that rotate a head of n channels: n for a power of two, else n's largest
    power-of-two divisor (96 -> 32). The block-diagonal matrix is orthogonal and symmetric too, so the values'
    rotation folds into W_v/W_o for any even head_dim (KVSpec.check_geometry); keys (rotated in the kernels,
    with the query) and values rotated in the kernels need a power of two."""
    return n & -n


def rotate(x: torch.Tensor, how: str) -> torch.Tensor:
    """x [..., D] in the rotated basis ('hadamard': x @ H, float32) or unchanged ('none'). Its own inverse.
    Computed as (x @ S) * D**-0.5 with S the +-1 signs: the sums are of +-x (exact for fp16 inputs of
    moderate range, so any summation order agrees) and one rounding scales them, as in the kernels.
    A D that is not a power of two is rotated in blocks of hadamard_block(D) channels."""
    if how == "none":
        return x
    if how == "hadamard":
        D = x.shape[-1]
        b = hadamard_block(D)
        if b == D:
            return (x.float() @ _signs(D, str(x.device))) * D**-0.5
        return ((x.float().unflatten(-1, (D // b, b)) @ _signs(b, str(x.device))) * b**-0.5).flatten(-2)
    raise ValueError(f"unknown rotation {how!r}; allowed: none, hadamard")


def quantize_token_symmetric(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, per group of `group` channels, symmetric: scale = amax / Q (fp16, rounded up so
    nothing clips), q = clamp(round_half_even(x / scale), -Q, Q), Q = 2**(bits-1) - 1.
    x: [..., T, D] -> (int8 codes [..., T, D], fp16 scale [..., T, D // group])."""
    xg = x.float().unflatten(-1, (-1, group))
    scale = _round_outward_fp16(xg.abs().amax(-1) / key_qmax(bits), float("inf"))
    s = torch.where(scale == 0, torch.ones_like(scale), scale).float().unsqueeze(-1)
    q = round_half_even(xg / s).clamp_(-key_qmax(bits), key_qmax(bits))
    return q.flatten(-2).to(torch.int8), scale


def dequantize_token_symmetric(codes: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    return (codes.float().unflatten(-1, (-1, group)) * scale.float().unsqueeze(-1)).flatten(-2)


def encode_rotated(x: torch.Tensor, bits: int, group: int, symmetric: bool, how: str, coded_min: bool = False) -> tuple[torch.Tensor, ...]:
    """Storage form of a per-token format in a rotated basis: x [..., T, D] -> symmetric: (payload, scale);
    asymmetric: (payload, scale, min) (encode_values; coded_min: the min a uint8 code).
    int4 payloads are packed (signed codes offset-binary, q + 8)."""
    xr = rotate(x, how)
    if not symmetric:
        return encode_values(xr.float(), bits, group, coded_min)
    q, scale = quantize_token_symmetric(xr, bits, group)
    return store_signed(q, bits), scale


def decode_rotated(stored: tuple[torch.Tensor, ...], bits: int, group: int, symmetric: bool, how: str) -> torch.Tensor:
    """encode_rotated's inverse up to the rounding: dequantize, then rotate back (float32)."""
    if not symmetric:
        return rotate(decode_values(*stored, bits, group), how)
    payload, scale = stored
    return rotate(dequantize_token_symmetric(load_signed(payload, bits), scale, group), how)


def fake_quant_rotated(x: torch.Tensor, bits: int, group: int, symmetric: bool, how: str, coded_min: bool = False) -> torch.Tensor:
    """A per-token format in a rotated basis: rotate, quantize per token and group (symmetric, or the
    asymmetric value quantizer), rotate back; in x's dtype. Keys: q.k_hat = (q H).(quantized k H)."""
    return decode_rotated(encode_rotated(x, bits, group, symmetric, how, coded_min), bits, group, symmetric, how).to(x.dtype)


# ---------------------------------------------------------------- TensorRT-LLM's native KV formats
NATIVE_QMAX = {"native_int8": 127.0, "native_fp8": 448.0, "native_nvfp4": 448.0}  # per-layer scale = amax / qmax
NVFP4_BLOCK = 16
E2M1_MAX = 6.0
E2M1_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """Round to FP4 e2m1 {0, 0.5, 1, 1.5, 2, 3, 4, 6} (sign kept), ties to even, saturating at 6."""
    a = y.abs()
    idx = torch.searchsorted(E2M1_BOUNDS.to(a.device), a.contiguous())
    idx = idx + (a.unsqueeze(-1) == E2M1_BOUNDS.to(a.device)[[1, 3, 5]]).any(-1).long()  # 0.75, 1.75, 3.5 round up to even
    return torch.where(y < 0, -1.0, 1.0) * E2M1_VALUES.to(a.device)[idx]


def nvfp4_fake_quant(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """TensorRT-LLM's NVFP4 KV cache, with the semantics of NVIDIA Model Optimizer 0.47 (its
    NVFP4 KV config: e2m1 values, dynamic per-16-element blocks along the head dim, FP8 e4m3 block
    scales; NVFP4QTensor.quantize/dequantize): global scale s2 = scale / 6 with the per-layer
    scale = amax / 448 (ModelOpt exports the KV scale as amax / 448 for NVFP4 as for FP8); block
    scale sb = e4m3(clamp(block_amax / (6 * s2), 2^-9, 448)) (1 for an all-zero block);
    x_hat = e2m1_round(x / (sb * s2)) * sb * s2. x: [..., D], D a multiple of 16."""
    s2 = torch.as_tensor(scale, dtype=torch.float32, device=x.device) / E2M1_MAX
    xb = x.float().unflatten(-1, (-1, NVFP4_BLOCK))  # [..., D/16, 16]
    sb = xb.abs().amax(-1, keepdim=True) / (E2M1_MAX * s2)
    sb = torch.where(sb == 0, torch.ones_like(sb), sb).clamp(2.0**-9, 448.0).to(torch.float8_e4m3fn).float()
    q = e2m1_round(xb / (sb * s2))
    return (q * (sb * s2)).flatten(-2).to(x.dtype)


def native_fake_quant(x: torch.Tensor, scale: float | torch.Tensor, fmt: str) -> torch.Tensor:
    """TensorRT-LLM's per-tensor KV cache: one dequant scale s per layer (kv_cache_scaling_factor).

    native_int8: q = clamp(round_half_even(x / s), -127, 127) (s = amax / 127, as its converter sets);
    native_fp8:  q = float8_e4m3fn(clamp(x / s, -448, 448)) (s = amax / 448);  x_hat = q * s;
    native_nvfp4: per-16-element FP4 blocks under the global scale s / 6 (nvfp4_fake_quant).
    """
    if fmt == "native_nvfp4":
        return nvfp4_fake_quant(x, scale)
    xf = x.float() / scale
    if fmt == "native_int8":
        q = round_half_even(xf).clamp_(-127, 127)
    elif fmt == "native_fp8":
        q = xf.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    else:
        raise ValueError(f"unknown native format {fmt!r}; allowed: {', '.join(NATIVE_QMAX)}")
    return (q * scale).to(x.dtype)


def pair_rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate each RoPE pair (x_d, x_{d+D/2}) of x [..., D] by angles [..., D/2] (radians, broadcast):
    (a, b) -> (a cos t - b sin t, a sin t + b cos t). Planar rotations commute, so this commutes with
    RoPE (which rotates the same pairs by position-dependent angles): folded into W_q and W_k it
    leaves every q.k unchanged. pair_rotate(x, -angles) undoes it. Float32 math (float64 for float64
    x), x's dtype out."""
    D = x.shape[-1]
    dt = torch.promote_types(x.dtype, torch.float32)
    a, b = x[..., : D // 2].to(dt), x[..., D // 2 :].to(dt)
    c, s = angles.cos().to(dt), angles.sin().to(dt)
    return torch.cat([a * c - b * s, a * s + b * c], -1).to(x.dtype)


def native_folded_quant(x: torch.Tensor, fold: torch.Tensor, scale: float | torch.Tensor, fmt: str, angles: torch.Tensor | None = None) -> torch.Tensor:
    """What a folded native checkpoint caches, mapped back to the unfolded model: y = R x / fold,
    x_hat = R^-1 (fold * Q(y)), Q = native_fake_quant, R = pair_rotate by `angles` (keys of
    native_fp8 with kv.fold_pairs; None: no rotation). fold, angles broadcast against x."""
    y = x if angles is None else pair_rotate(x, angles)
    out = native_fake_quant(y / fold, scale, fmt) * fold
    return (out if angles is None else pair_rotate(out, -angles)).to(x.dtype)


def native_folded_saturated(x: torch.Tensor, fold: torch.Tensor, scale: float | torch.Tensor, fmt: str, angles: torch.Tensor | None = None) -> torch.Tensor:
    """native_saturated of what the folded checkpoint caches (native_folded_quant's y)."""
    y = x if angles is None else pair_rotate(x, angles)
    return native_saturated(y / fold, scale, fmt)


def native_saturated(x: torch.Tensor, scale: float | torch.Tensor, fmt: str) -> torch.Tensor:
    """Bool mask of elements that TensorRT-LLM's per-tensor quantizer saturates (clamps). NVFP4: an
    element beyond 448 * scale lies in a block whose FP8 block scale clamps at 448 (the global range)."""
    z = (x.float() / scale).abs()
    return z > 127.5 if fmt == "native_int8" else z > NATIVE_QMAX[fmt]


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
