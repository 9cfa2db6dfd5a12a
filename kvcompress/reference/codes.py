"""Rounding, code ranges and packing: int4 nibbles, 5..7-bit bit planes, water-filled key rows."""
from __future__ import annotations

import torch

from kvcompress.spec import PLANE_BITS

HP_DTYPE = torch.float16  # dtype of the window, sinks, outlier side store and value metadata
HP_BYTES = 2
KEY_SCALE_BYTES = 4  # static per-channel key scale and zero point (fp32)
OUTLIER_INDEX_BYTES = 8  # static outlier channel index (int64)
FP16_BITS = 16  # key_bits == value_bits == 16: an fp16 layer of a per-layer format, whose store holds the fp16 K and V


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



def round_outward_fp16(x: torch.Tensor, direction: float) -> torch.Tensor:
    """Round float32 -> float16 toward -inf (direction=-inf) or +inf (direction=+inf)."""
    h = x.to(HP_DTYPE)
    off = (h.float() > x) if direction < 0 else (h.float() < x)
    step = torch.full_like(h, direction)
    return torch.where(off, torch.nextafter(h, step), h)


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
