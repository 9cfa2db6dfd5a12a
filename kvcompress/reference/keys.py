"""Keys: static per-channel (symmetric or with a zero point, outlier channels), RoPE pairs, water-filled token groups."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.reference.codes import FP16_BITS, HP_DTYPE, key_qmax, pack_codes, round_half_even, round_outward_fp16, signed_offset, unpack_codes


# ---------------------------------------------------------------- keys
@dataclass(frozen=True)
class KeyParams:
    """Static key parameters of one layer (a slice of the ScaleBook)."""

    bits: int
    scale: torch.Tensor  # [H, D] float32
    zero: torch.Tensor  # [H, D] float32
    outlier_idx: torch.Tensor  # [H, n_out] int64 (n_out may be 0)




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
    vmin = round_outward_fp16(kg.amin(-2), float("-inf"))
    scale = round_outward_fp16((kg.amax(-2) - vmin.float()) / levels, float("inf"))
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
