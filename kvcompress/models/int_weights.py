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

compressed-tensors' `int-quantized` format (llm-compressor's W8A8 int8 exports, e.g. the `*-quantized.w8a8` models, and
8-bit weight-only ones) stores the same codes unpacked: `<m>.weight` int8 [out, in] (signed, no offset) beside
`<m>.weight_scale` (per row, group or tensor, as above) and, if asymmetric, `<m>.weight_zero_point` int8 [out, groups];
`int8_names` finds them and `dequantize_codes` is the same arithmetic.

The weight is w = (q - z) * s, formed in the scale's dtype as compressed-tensors' `dequantize` forms it (an exact
product of a small integer and the scale, rounded once to that dtype). Read in compressed-tensors 0.20's sources
(`compressors/pack_quantized`, `quantization/lifecycle/forward.py`); tests/test_int_weights.py checks this module
against that library's own decompressor.

Two more layouts of the same arithmetic, as their quantizers write them (quant_method "gptq" and "awq"):

* GPTQ (AutoGPTQ / GPTQModel, `checkpoint_format` "gptq", the default, or "gptq_v2"): `<m>.qweight` int32
  [in * b / 32, out], each column's codes (unsigned, 0 .. 2^b - 1) a little-endian bitstream down the input rows;
  `<m>.qzeros` int32 [groups, out * b / 32], the zero points a bitstream along the output columns, stored minus one
  in the "gptq" format (its dequantization adds the one back; "gptq_v2" stores them as they are); `<m>.scales`
  [groups, out] fp16; `<m>.g_idx` int32 [in] (activation order), else column j is in group j // group_size.
* AWQ (AutoAWQ's GEMM layout, `version` "gemm", 4 bits): `<m>.qweight` int32 [in, out / 8] and `<m>.qzeros` int32
  [groups, out / 8], eight output columns a word, column 8w + j in nibble AWQ_NIBBLE[j]; `<m>.scales` [groups, out].

Both give w[out, in] = (q - z) * s in the scale's dtype (the transpose of their [in, out] layout). Read in auto-round
0.16's sources (its torch QuantLinear for GPTQ and its AWQ packer and `dequantize_gemm`), which the tests run as the
reference. Pure torch: copied into the custom tier's plugin bundle beside trtllm_network.py, which reads the source
directory on the GPU host.
"""
from __future__ import annotations

import math

import torch

SUFFIX = "weight_packed"
PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
INT8_PARTS = ("weight_scale", "weight_zero_point", "weight_g_idx", "input_scale", "input_zero_point")  # beside an int-quantized weight


def config_bits(q: dict | None) -> int | None:
    """The code width a quantization_config states: GPTQ's and AWQ's `bits`; compressed-tensors' `num_bits` when all its
    config groups state the same one; else None."""
    q = q or {}
    if q.get("bits"):
        return int(q["bits"])
    bits = {int((g.get("weights") or {}).get("num_bits", 0)) for g in (q.get("config_groups") or {}).values()}
    return bits.pop() if len(bits) == 1 else None


def packed_names(entries) -> dict[str, dict[str, str | None]]:
    """{`<m>.weight`: {part: stored name or None}} for every `<m>.weight_packed` among the stored names, except compressed-tensors'
    NVFP4 weights (uint8 codes under the same name, with a `<m>.weight_global_scale` no integer weight has: nvfp4_weights)."""
    out = {}
    for k in entries:
        if k.endswith("." + SUFFIX) and k[: -len(SUFFIX)] + "weight_global_scale" not in entries:
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


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [rows, ceil(cols * bits / 32)] of signed codes [rows, cols] in [-2^(b-1), 2^(b-1)): unpack's inverse
    (offset-binary, each row one little-endian bitstream)."""
    rows, cols = codes.shape
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if codes.numel() and (int(codes.min()) < lo or int(codes.max()) > hi):
        raise ValueError(f"codes outside {lo}..{hi} do not fit {bits} bits")
    words = math.ceil(cols * bits / 32)
    start = torch.arange(cols, dtype=torch.int64) * bits
    v = (codes.to(torch.int64) + (1 << (bits - 1))) << (start % 32)  # a code's bits, shifted into its first word (may spill into the next)
    out = torch.zeros(rows, words + 1, dtype=torch.int64)
    out.index_add_(1, start // 32, v & 0xFFFFFFFF)  # the codes' bit ranges are disjoint: adding is or-ing
    out.index_add_(1, start // 32 + 1, v >> 32)
    out = out[:, :words]
    return torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)


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
    groups = 1 if scale.numel() == 1 else scale.reshape(out_f, -1).shape[1]
    z = None if zero is None else unpack(zero.reshape(-1, groups).T.contiguous(), bits, out_f).T  # packed along the rows
    return dequantize_codes(unpack(packed, bits, in_f), scale, shape, z, g_idx, lo, hi)


def dequantize_codes(q: torch.Tensor, scale: torch.Tensor, shape, zero: torch.Tensor | None = None, g_idx: torch.Tensor | None = None,
                     lo: int | None = None, hi: int | None = None) -> torch.Tensor:
    """float32 rows lo:hi of w = (q - z) * s rounded to the scale's dtype, from signed codes q (rows lo:hi, or all rows),
    the scale (all rows: one, [out] / [out, 1] per row, or [out, groups]), signed zero points [out, groups] (all rows) or
    None, and g_idx (the group of each input column) or None (column j in group j // (in / groups))."""
    out_f, in_f = (int(x) for x in shape)
    lo, hi = lo or 0, out_f if hi is None else hi
    if q.shape[0] == out_f:
        q = q[lo:hi]
    q = q.to(torch.float32)
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
        z = zero.reshape(out_f, groups).to(torch.float32)[lo:hi]
        q = q - (z[:, col_group] if groups > 1 else z)
    return (q * sf).to(scale.dtype).to(torch.float32)


def int8_names(entries) -> dict[str, dict[str, str | None]]:
    """{`<m>.weight`: {part: stored name or None}} for every weight stored as int8 codes (compressed-tensors' int-quantized)
    beside a `<m>.weight_scale`; parts: INT8_PARTS (the static activation scale and zero point of W8A8 with static inputs
    are not the weight's, but travel with it). entries: stored name -> Checkpoint entry (path, header, start), safetensors
    header entry or tensor."""
    def dtype(e):  # not models.st_dtypes.entry_dtype: this module is copied into the bundle alone (targets.bundle.WEIGHT_READERS)
        if isinstance(e, torch.Tensor):
            return "I8" if e.dtype == torch.int8 else None
        return (e[1] if isinstance(e, tuple) else e).get("dtype")

    out = {}
    for k, e in entries.items():
        m = k.removesuffix("weight")
        if k.endswith(".weight") and dtype(e) == "I8" and m + "weight_scale" in entries:
            out[k] = {p: (m + p if m + p in entries else None) for p in INT8_PARTS}
    return out


def read_int8(parts: dict[str, str | None], key: str, shape, read_stored, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
    """float32 rows lo:hi (all if None) of the int8 weight `key` of `shape` [out, in] (int8_names' parts); read_stored(name,
    lo, hi) gives a stored tensor's rows (name alone: the whole tensor)."""
    opt = {p: read_stored(parts[p]) if parts[p] else None for p in ("weight_zero_point", "weight_g_idx")}
    return dequantize_codes(read_stored(key, lo, hi), read_stored(parts["weight_scale"]), shape, opt["weight_zero_point"], opt["weight_g_idx"], lo, hi)


# --------------------------------------------------------------------------------------- GPTQ and AWQ layouts

GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)  # output column 8w + j sits in nibble AWQ_NIBBLE[j] of word w


def layout(q: dict | None) -> str | None:
    """Which packed-integer layout a quantization_config describes: "pack-quantized" (compressed-tensors), "gptq" (zero
    points stored minus one), "gptq_v2", "awq" (GEMM); None for anything else."""
    q = q or {}
    method = str(q.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return "pack-quantized"
    if method == "gptq":
        fmt = str(q.get("checkpoint_format") or "gptq").lower()
        return {"gptq": "gptq", "gptq_v2": "gptq_v2"}.get(fmt)
    if method == "awq" and str(q.get("version") or "gemm").lower() == "gemm" and int(q.get("bits", 4)) == 4:
        return "awq"
    return None


def qweight_names(entries) -> dict[str, dict[str, str | None]]:
    """{`<m>.weight`: {part: stored name or None}} for every `<m>.qweight` (GPTQ, AWQ) among the stored names."""
    out = {}
    for k in entries:
        if k.endswith(".qweight"):
            m = k[: -len("qweight")]
            out[m + "weight"] = {p: (m + p if m + p in entries else None) for p in GPTQ_PARTS}
    return out


def is_qweight_part(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in GPTQ_PARTS


def _unsigned(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The n unsigned codes of each row of int32 words, read as one little-endian bitstream per row."""
    return unpack(packed, bits, n).to(torch.int32) + (1 << (bits - 1))


def gptq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None, bits: int,
                    v1: bool = True) -> torch.Tensor:
    """w [out, in] float32, (q - z) * s rounded to the scales' dtype, of a GPTQ layer."""
    groups, out_f = scales.shape
    in_f = qweight.shape[0] * 32 // bits
    q = _unsigned(qweight.T.contiguous(), bits, in_f)  # [out, in]
    z = _unsigned(qzeros, bits, out_f) + (1 if v1 else 0)  # [groups, out]
    col_group = g_idx.to(torch.int64) if g_idx is not None else torch.arange(in_f) // (in_f // groups)
    if col_group.numel() != in_f or int(col_group.max()) >= groups or int(col_group.min()) < 0:
        raise ValueError(f"g_idx of {col_group.numel()} entries for {in_f} input columns and {groups} groups")
    w = (q - z.T[:, col_group]).to(torch.float32) * scales.T.to(torch.float32)[:, col_group]
    return w.to(scales.dtype).to(torch.float32)


def _awq_codes(t: torch.Tensor, out_f: int) -> torch.Tensor:
    """The unsigned 4-bit codes [rows, out] of AWQ GEMM words [rows, out / 8] (output column 8w + j in nibble AWQ_NIBBLE[j])."""
    cols = (torch.arange(out_f // 8)[:, None] * 8 + torch.tensor(AWQ_NIBBLE)[None, :]).reshape(-1)  # the nibble holding each column
    return _unsigned(t, 4, t.shape[1] * 8)[:, cols]


def awq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """w [out, in] float32, (q - z) * s rounded to the scales' dtype, of an AWQ (GEMM) layer."""
    if bits != 4:
        raise ValueError(f"AWQ's GEMM layout is 4-bit; this one is {bits}")
    groups, out_f = scales.shape
    in_f = qweight.shape[0]
    q, z = _awq_codes(qweight, out_f), _awq_codes(qzeros, out_f)  # [in, out], [groups, out]
    w = (q - z.repeat_interleave(in_f // groups, 0)).to(torch.float32) * scales.to(torch.float32).repeat_interleave(in_f // groups, 0)
    return w.to(scales.dtype).to(torch.float32).T.contiguous()


def dequantize_layer(fmt: str, parts: dict, read, bits: int) -> torch.Tensor:
    """A GPTQ / AWQ layer's weight [out, in] (float32) from its stored parts; read(name) -> tensor."""
    for p in ("qweight", "qzeros", "scales"):
        if parts.get(p) is None:
            raise ValueError(f"{parts['qweight']} has no {p} beside it")
    qw, qz, sc = (read(parts[p]) for p in ("qweight", "qzeros", "scales"))
    if fmt == "awq":
        return awq_dequantize(qw, qz, sc, bits)
    return gptq_dequantize(qw, qz, sc, read(parts["g_idx"]) if parts.get("g_idx") else None, bits, v1=fmt == "gptq")


# --------------------------------------------------------------------------------------- GPTQ / AWQ as pack-quantized

REPACK_BITS = (4, 8)  # the code widths servers run compressed-tensors' pack-quantized weights at (vLLM's WNA16 kernels)


def repack_obstacle(q: dict | None) -> str | None:
    """Why a GPTQ / AWQ checkpoint's layers are not written as compressed-tensors pack-quantized by the export (None: they
    are): a code width servers do not run, or GPTQ's activation order (compressed-tensors removed weight_g_idx)."""
    q = q or {}
    fmt, bits = layout(q), config_bits(q)
    if fmt not in ("gptq", "gptq_v2", "awq"):
        return f"quant_method {q.get('quant_method')!r} is not GPTQ or AWQ"
    if bits not in REPACK_BITS:
        return f"{bits}-bit codes (servers run pack-quantized weights at {' or '.join(map(str, REPACK_BITS))} bits)"
    if fmt != "awq" and q.get("desc_act"):
        return "GPTQ's activation order (desc_act: compressed-tensors, which vLLM reads, no longer stores a column-to-group map)"
    return None


def repack_symmetric(q: dict) -> bool:
    """Whether the pack-quantized layers are written symmetric (no zero points): GPTQ's `sym`, AWQ without `zero_point`."""
    return not q.get("zero_point", True) if layout(q) == "awq" else bool(q.get("sym", True))


def pack_quantized_config(q: dict, ignore: list[str]) -> dict:
    """compressed-tensors' quantization_config of a GPTQ / AWQ checkpoint's layers written pack-quantized (repack): every
    Linear outside `ignore`, the source's code width, group size (-1 or none: per channel) and symmetry."""
    gs = int(q.get("group_size") or -1)
    weights = {"num_bits": config_bits(q), "type": "int", "symmetric": repack_symmetric(q), "strategy": "group" if gs > 0 else "channel",
               "group_size": gs if gs > 0 else None, "dynamic": False, "actorder": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None, "output_activations": None,
                                          "format": "pack-quantized"}},
            "ignore": list(ignore)}


def repacked_shapes(out_f: int, in_f: int, groups: int, bits: int, symmetric: bool, scale_dtype: torch.dtype) -> dict[str, tuple]:
    """{part: (dtype, shape)} of a layer written pack-quantized (repack's tensors)."""
    out = {"weight_packed": (torch.int32, (out_f, math.ceil(in_f * bits / 32))), "weight_scale": (scale_dtype, (out_f, groups)),
           "weight_shape": (torch.int64, (2,))}
    if not symmetric:
        out["weight_zero_point"] = (torch.int32, (math.ceil(out_f * bits / 32), groups))
    return out


def repack(fmt: str, parts: dict, read, bits: int, symmetric: bool) -> dict[str, torch.Tensor]:
    """A GPTQ / AWQ layer as compressed-tensors pack-quantized tensors (weight_packed, weight_scale, weight_zero_point
    unless symmetric, weight_shape): the same codes, zero points and scales shifted to the signed range, so that
    `dequantize` of them is `dequantize_layer` of the source, bit for bit. A ValueError where that cannot be: columns
    not in group order (activation order), a zero point outside the signed range (GPTQ's v1 format stores zero - 1 and
    cannot hold 0), or one that is not the midpoint in a symmetric layer."""
    for p in ("qweight", "qzeros", "scales"):
        if parts.get(p) is None:
            raise ValueError(f"{parts['qweight']} has no {p} beside it")
    qw, qz, sc = (read(parts[p]) for p in ("qweight", "qzeros", "scales"))
    groups, out_f = sc.shape
    mid = 1 << (bits - 1)
    if fmt == "awq":
        in_f = qw.shape[0]
        q, z = _awq_codes(qw, out_f).T, _awq_codes(qz, out_f)  # [out, in], [groups, out]
    else:
        in_f = qw.shape[0] * 32 // bits
        q, z = _unsigned(qw.T.contiguous(), bits, in_f), _unsigned(qz, bits, out_f) + (1 if fmt == "gptq" else 0)
        if parts.get("g_idx") is not None and not torch.equal(read(parts["g_idx"]).to(torch.int64), torch.arange(in_f) // (in_f // groups)):
            raise ValueError(f"{parts['qweight']}: its g_idx puts columns out of group order (activation order)")
    out = {"weight_packed": pack(q - mid, bits), "weight_scale": sc.T.contiguous(), "weight_shape": torch.tensor([out_f, in_f], dtype=torch.int64)}
    if symmetric:
        if bool((z != mid).any()):
            raise ValueError(f"{parts['qweight']}: zero points other than {mid} in a layer its config calls symmetric")
        return out
    if int(z.max()) >= 2 * mid:
        raise ValueError(f"{parts['qweight']}: a zero point of {int(z.max())} does not fit {bits} bits")
    return out | {"weight_zero_point": pack((z - mid).contiguous(), bits).T.contiguous()}
