"""Integer weight-only checkpoints in compressed-tensors' `pack-quantized` format (llm-compressor's W4A16 / W8A16 exports,
e.g. the `*-quantized.w4a16` models): each quantized Linear stores, instead of `<m>.weight`,

* `<m>.weight_packed` int32 [out, ceil(in * b / 32)]: the codes q in [-2^(b-1), 2^(b-1)) stored offset-binary
  (q + 2^(b-1)), element j of a row at bits j*b .. j*b+b-1 of the row's little-endian bitstream of 32-bit words
  (for b = 4: eight codes a word, the first in the low nibble);
* `<m>.weight_scale` [out, groups] (fp16 / bf16 / fp32): one scale per output row and group of input columns
  (`strategy: group`, group_size = in / groups), per row (`channel`: groups = 1) or one for the tensor;
* `<m>.weight_zero_point` (asymmetric only) int32, the zero points [out, groups] packed the same way along the rows
  (the column of a group's zero points is one bitstream);
* `<m>.weight_shape` int [2]: (out, in);
* `<m>.weight_g_idx` int32 [in] (optional, GPTQ's activation order): the group of each input column.

The weight is w = (q - z) * s, formed in the scale's dtype as compressed-tensors' `dequantize` forms it (an exact
product of a small integer and the scale, rounded once to that dtype). Read in compressed-tensors 0.20's sources
(`compressors/pack_quantized`, `quantization/lifecycle/forward.py`); tests/test_int_weights.py checks this module
against that library's own decompressor. Pure torch: copied into the custom tier's plugin bundle beside
trtllm_network.py, which reads the source directory on the GPU host.
"""
from __future__ import annotations

import math

import torch

SUFFIX = "weight_packed"
PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")


def packed_names(entries) -> dict[str, dict[str, str | None]]:
    """{`<m>.weight`: {part: stored name or None}} for every `<m>.weight_packed` among the stored names."""
    out = {}
    for k in entries:
        if k.endswith("." + SUFFIX):
            m = k[: -len(SUFFIX)]
            out[m + "weight"] = {p: (m + p if m + p in entries else None) for p in PARTS}
    return out


def is_part(name: str) -> bool:
    """A stored tensor that is part of a packed weight (not itself a model parameter)."""
    return name.rsplit(".", 1)[-1] in PARTS


def unpack(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """int8 codes [rows, cols] (signed: the offset removed) of int32 words [rows, words] packed as described above."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed codes are stored as {packed.dtype}, not int32")
    words = packed.shape[-1]
    if words != math.ceil(cols * bits / 32):
        raise ValueError(f"{words} int32 words a row cannot hold {cols} codes of {bits} bits (needs {math.ceil(cols * bits / 32)})")
    w = packed.to(torch.int64) & 0xFFFFFFFF  # the words unsigned
    w = torch.nn.functional.pad(w, (0, 1))  # a code may straddle into the next word; the last has none after it
    start = torch.arange(cols, dtype=torch.int64) * bits
    idx, off = start // 32, start % 32
    both = w[:, idx] | (w[:, idx + 1] << 32)  # the two words a code can span, as one 64-bit value
    codes = (both >> off) & ((1 << bits) - 1)
    return (codes - (1 << (bits - 1))).to(torch.int8)


def num_bits(packed_shape, cols: int, stated: int | None = None) -> int:
    """The code width: `stated` (the quantization_config's, when all its groups agree) if it fits the packed shape, else the
    one width the shape allows; a ValueError when neither decides."""
    words = packed_shape[-1]
    fits = [b for b in range(1, 9) if math.ceil(cols * b / 32) == words]
    if stated in fits:
        return stated
    if len(fits) == 1:
        return fits[0]
    raise ValueError(f"a packed row of {words} int32 words for {cols} columns fits code widths {fits or 'none of 1..8'}"
                     + (f", not the configured {stated}" if stated else ""))


def dequantize(packed: torch.Tensor, scale: torch.Tensor, shape, zero: torch.Tensor | None = None, g_idx: torch.Tensor | None = None,
               bits: int | None = None, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
    """The weight's rows lo:hi (all by default) as float32 values of w = (q - z) * s rounded to the scale's dtype.
    packed: the stored weight_packed (all rows, or just rows lo:hi); scale, zero, g_idx: as stored (all rows)."""
    out_f, in_f = (int(x) for x in shape)
    lo, hi = lo or 0, out_f if hi is None else hi
    bits = num_bits(packed.shape, in_f, bits)
    if packed.shape[0] == out_f:
        packed = packed[lo:hi]
    q = unpack(packed, bits, in_f).to(torch.float32)
    s = scale.reshape(1, 1) if scale.numel() == 1 else scale.reshape(out_f, -1)
    groups = s.shape[1]
    if in_f % groups:
        raise ValueError(f"{groups} scale columns do not divide {in_f} input columns")
    s = s if scale.numel() == 1 else s[lo:hi]
    col_group = (g_idx.to(torch.int64) if g_idx is not None else torch.arange(in_f) // (in_f // groups))
    if int(col_group.max()) >= groups or int(col_group.min()) < 0:
        raise ValueError(f"weight_g_idx names groups outside 0..{groups - 1}")
    sf = s.to(torch.float32)[:, col_group] if groups > 1 else s.to(torch.float32)
    if zero is not None:
        z = unpack(zero.reshape(-1, groups).T.contiguous(), bits, out_f).T.to(torch.float32)[lo:hi]  # packed along the rows
        q = q - (z[:, col_group] if groups > 1 else z)
    return (q * sf).to(scale.dtype).to(torch.float32)
