"""The packed codes of kvcompress.kernels.layout in Triton, shared by the kernel families (triton_kv, triton_rot,
triton_grp): the rounding points of kvcompress.reference (round-half-even codes, fp16 scales and mins rounded
outward), the stores of a token's codes (int8, nibbles, bit planes), the Hadamard butterfly, and the loads that turn
a tile of payload rows back into codes and dequantized values in registers (contiguous runs of bytes, so the loads
vectorize on 16-byte-aligned buffers; kvcompress.kernels.audit checks the SASS)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_half_even(x):
    r = tl.floor(x + 0.5)
    tie = (r - x) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def fp16_down(x):
    """float32 -> float16 rounded toward -inf (torch.nextafter step when nearest rounded up)."""
    h = x.to(tl.float16)
    bits = h.to(tl.int16, bitcast=True)
    stepped = tl.where(h > 0, bits - 1, tl.where(h < 0, bits + 1, tl.full(bits.shape, -32767, tl.int16)))
    return tl.where(h.to(tl.float32) > x, stepped.to(tl.float16, bitcast=True), h)


@triton.jit
def fp16_up(x):
    """float32 -> float16 rounded toward +inf."""
    h = x.to(tl.float16)
    bits = h.to(tl.int16, bitcast=True)
    stepped = tl.where(h > 0, bits + 1, tl.where(h < 0, bits - 1, tl.full(bits.shape, 1, tl.int16)))
    return tl.where(h.to(tl.float32) < x, stepped.to(tl.float16, bitcast=True), h)


@triton.jit
def _store_codes(ce, co, row, D: tl.constexpr, BITS: tl.constexpr):
    """Unsigned codes in [0, 2**BITS) (even/odd channel halves, float32) -> one payload row of D * BITS / 8
    bytes (reference.pack_codes): bytes; int4 two per byte, the even channel in the low nibble; 5..7 bits the
    low nibbles so, then one plane of D/8 bytes per further bit (channel d at bit d % 8 of byte d // 8); 3 bits
    three such planes alone."""
    HALF: tl.constexpr = D // 2
    ie = 2 * tl.arange(0, HALF)
    if BITS == 8:
        tl.store(row + ie, ce.to(tl.uint8))
        tl.store(row + ie + 1, co.to(tl.uint8))
    elif BITS == 4:
        tl.store(row + tl.arange(0, HALF), ce.to(tl.uint8) | (co.to(tl.uint8) << 4))
    else:
        E: tl.constexpr = D // 8
        LOW: tl.constexpr = 4 if BITS > 4 else 0  # bits held in nibbles; 3-bit codes are three planes alone
        START: tl.constexpr = HALF if BITS > 4 else 0
        ci_e = ce.to(tl.int32)
        ci_o = co.to(tl.int32)
        if BITS > 4:
            tl.store(row + tl.arange(0, HALF), ((ci_e & 15) | ((ci_o & 15) << 4)).to(tl.uint8))
        sh = 2 * (tl.arange(0, HALF) % 4)  # channel 2k sits at bit 2k % 8 of its plane byte, channel 2k + 1 above it
        for p in tl.static_range(BITS - LOW):
            b = (((ci_e >> (LOW + p)) & 1) << sh) | (((ci_o >> (LOW + p)) & 1) << (sh + 1))
            byte = tl.sum(tl.reshape(b, (E, 4)), axis=1)  # four channel pairs per byte; bits never overlap: the sum is an OR
            tl.store(row + START + p * E + tl.arange(0, E), byte.to(tl.uint8))


@triton.jit
def store_signed(qe, qo, row, D: tl.constexpr, BITS: tl.constexpr):
    """Signed codes (even/odd halves) -> one payload row: int8, or offset-binary (q + 2**(BITS-1)) packed by
    _store_codes (reference.store_signed)."""
    HALF: tl.constexpr = D // 2
    ie = 2 * tl.arange(0, HALF)
    if BITS == 8:
        tl.store(row + ie, qe.to(tl.int8))
        tl.store(row + ie + 1, qo.to(tl.int8))
    else:
        _store_codes(qe + 2 ** (BITS - 1), qo + 2 ** (BITS - 1), row, D, BITS)


@triton.jit
def _group_range(x_even, x_odd, ge, go, g):
    """(min, max) of group g over a token's even and odd channels."""
    gmin = tl.minimum(tl.min(tl.where(ge == g, x_even, float("inf"))), tl.min(tl.where(go == g, x_odd, float("inf"))))
    gmax = tl.maximum(tl.max(tl.where(ge == g, x_even, float("-inf"))), tl.max(tl.where(go == g, x_odd, float("-inf"))))
    return gmin, gmax


@triton.jit
def encode_asymmetric(x_even, x_odd, row, srow, mrow, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, CODED: tl.constexpr,
                       F: tl.constexpr):
    """Values (reference.encode_values): per group min (fp16 rounded down), scale = (max - min) / levels
    (fp16 rounded up), codes clamp(rhe((x - min) / scale), 0, levels) into payload row `row`.
    CODED (reference.value_meta_coded): the range widened to include 0, scale = (max - min) / (levels - 1/F)
    (fp16 rounded up), the min stored as a uint8 w (min = -w * scale / F, rounded down; F = reference.min_code_step)."""
    HALF: tl.constexpr = D // 2
    NG: tl.constexpr = D // GROUP
    LEVELS: tl.constexpr = 2**BITS - 1
    ie = 2 * tl.arange(0, HALF)
    io = ie + 1
    ge = ie // GROUP
    go = io // GROUP
    se = tl.zeros([HALF], tl.float32)
    so = tl.zeros([HALF], tl.float32)
    me = tl.zeros([HALF], tl.float32)
    mo = tl.zeros([HALF], tl.float32)
    for g in tl.static_range(NG):
        gmin, gmax = _group_range(x_even, x_odd, ge, go, g)
        if CODED:
            lo = tl.minimum(gmin, 0.0)
            sc16 = fp16_up((tl.maximum(gmax, 0.0) - lo) / (LEVELS - 1.0 / F))
            sc = tl.where(sc16 == 0, 1.0, sc16.to(tl.float32))
            w = tl.minimum(tl.maximum(tl.floor(-lo * F / sc), 0.0), 255.0)
            w = tl.minimum(tl.where(-w * sc > lo * F, w + 1.0, w), 255.0)
            tl.store(mrow + g, w.to(tl.uint8))
            mn = -(w * sc16.to(tl.float32)) * (1.0 / F)
        else:
            mn16 = fp16_down(gmin)
            sc16 = fp16_up((gmax - mn16.to(tl.float32)) / LEVELS)
            sc = tl.where(sc16 == 0, 1.0, sc16.to(tl.float32))
            tl.store(mrow + g, mn16)
            mn = mn16.to(tl.float32)
        tl.store(srow + g, sc16)
        se = tl.where(ge == g, sc, se)
        so = tl.where(go == g, sc, so)
        me = tl.where(ge == g, mn, me)
        mo = tl.where(go == g, mn, mo)
    ce = tl.minimum(tl.maximum(round_half_even((x_even - me) / se), 0.0), LEVELS)
    co = tl.minimum(tl.maximum(round_half_even((x_odd - mo) / so), 0.0), LEVELS)
    _store_codes(ce, co, row, D, BITS)


@triton.jit
def encode_symmetric(x_even, x_odd, row, srow, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr):
    """Per-token symmetric codes (reference.quantize_token_symmetric): per group of GROUP channels,
    scale = amax / Q (fp16 rounded up, so nothing clips), q = clamp(rhe(x / scale), -Q, Q)."""
    HALF: tl.constexpr = D // 2
    NG: tl.constexpr = D // GROUP
    QMAX: tl.constexpr = 2 ** (BITS - 1) - 1
    ie = 2 * tl.arange(0, HALF)
    ge = ie // GROUP
    go = (ie + 1) // GROUP
    se = tl.zeros([HALF], tl.float32)
    so = tl.zeros([HALF], tl.float32)
    for g in tl.static_range(NG):
        amax = tl.maximum(tl.max(tl.where(ge == g, tl.abs(x_even), 0.0)), tl.max(tl.where(go == g, tl.abs(x_odd), 0.0)))
        sc16 = fp16_up(amax / QMAX)
        tl.store(srow + g, sc16)
        sc = tl.where(sc16 == 0, 1.0, sc16.to(tl.float32))
        se = tl.where(ge == g, sc, se)
        so = tl.where(go == g, sc, so)
    qe = tl.minimum(tl.maximum(round_half_even(x_even / se), -QMAX), QMAX)
    qo = tl.minimum(tl.maximum(round_half_even(x_odd / so), -QMAX), QMAX)
    store_signed(qe, qo, row, D, BITS)


@triton.jit
def fwht(x, ROWS: tl.constexpr, N: tl.constexpr, LOG2N: tl.constexpr):
    """x @ S for every row of x [ROWS, N], S the Sylvester-Hadamard signs (reference.hadamard_signs):
    the fast Walsh-Hadamard butterfly, one (a + b, a - b) stage per index bit, in registers (no N x N
    matrix is built)."""
    for s in tl.static_range(LOG2N):
        y = tl.permute(tl.reshape(x, (ROWS, N // (2 << s), 2, 1 << s)), (0, 1, 3, 2))
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (ROWS, N))
    return x


@triton.jit
def rotate_halves(x_even, x_odd, D: tl.constexpr, LOG2D: tl.constexpr, INV_SQRT_D: tl.constexpr):
    """(x @ S) * D**-0.5 for one vector given as even/odd channel halves, returned the same way
    (reference.rotate): the butterflies of the index bits above bit 0 run on each half, bit 0's
    butterfly pairs the halves; sums of +-x, then one rounding by the scale."""
    HALF: tl.constexpr = D // 2
    e = tl.reshape(fwht(tl.reshape(x_even, (1, HALF)), 1, HALF, LOG2D - 1), (HALF,))
    o = tl.reshape(fwht(tl.reshape(x_odd, (1, HALF)), 1, HALF, LOG2D - 1), (HALF,))
    return (e + o) * INV_SQRT_D, (e - o) * INV_SQRT_D


@triton.jit
def encode_value_token(v_e, v_o, r, VP, VS, VM, D: tl.constexpr, VAL_BITS: tl.constexpr, GROUP: tl.constexpr, V_SYM: tl.constexpr,
                        V_CODE: tl.constexpr, MIN_STEP: tl.constexpr):
    """A value (already rotated if the format rotates values) into store row r: symmetric (V_SYM) or
    asymmetric, the min an fp16 or (V_CODE) a uint8 code."""
    vrow = VP + r * (D * VAL_BITS // 8)
    if V_SYM:
        encode_symmetric(v_e, v_o, vrow, VS + r * (D // GROUP), D, VAL_BITS, GROUP)
    else:
        encode_asymmetric(v_e, v_o, vrow, VS + r * (D // GROUP), VM + r * (D // GROUP), D, VAL_BITS, GROUP, V_CODE, MIN_STEP)


@triton.jit
def load_codes(base, rows, mask, BITS: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, SIGNED: tl.constexpr):
    """[BLOCK_T, D] float32 codes from payload rows of D * BITS / 8 bytes (reference.pack_codes): int8 (signed)
    or uint8 bytes, packed int4 (low nibble = even channel), 5..7 bits as the nibbles and one D/8-byte plane
    per further bit, or 3 bits as three D/8-byte planes alone (read as the four plane slots, the last masked).
    SIGNED: offset-binary codes below 8 bits get their offset 2**(BITS-1) removed.

    Rows are read as contiguous runs of bytes, so the loads vectorize (aligned buffers): 5..7-bit rows
    (D/2 < ROW < D bytes) as two D/2-byte halves, the nibbles and the four D/8-byte plane slots (the second
    half's tail masked: the last slot, and with 5 or 6 bits the unused ones, read as 0); nibbles are split and
    interleaved back to channel order, the plane slots' bytes of each column combined into one 32-bit word
    and each of its bits spread over its channel."""
    HALF: tl.constexpr = D // 2
    if BITS == 8:
        return tl.load(base + rows[:, None] * D + tl.arange(0, D)[None, :], mask=mask[:, None], other=0).to(tl.float32)
    if BITS == 4:
        byte = tl.load(base + rows[:, None] * HALF + tl.arange(0, HALF)[None, :], mask=mask[:, None], other=0)
        code = tl.reshape(tl.join(byte & 0xF, byte >> 4), (BLOCK_T, D)).to(tl.float32)
    elif BITS == 3:
        # three D/8-byte planes alone, read as the four plane slots of the 5..7-bit rows' second half (the last masked)
        ROW3: tl.constexpr = D * 3 // 8
        E3: tl.constexpr = D // 8
        c3 = tl.arange(0, HALF)
        pl = tl.load(base + rows[:, None] * ROW3 + c3[None, :], mask=mask[:, None] & (c3 < ROW3)[None, :], other=0)
        # the plane bytes j of each slot into one 32-bit word per column (plane p in byte p). Two equivalent forms,
        # chosen by the registers ptxas gives them (SASS audit, kv=wf3, 2026-12-06): at head dim 128 the slots
        # split apart (tl.split) fit the 168-register cap without spills (summed: spills), at 64 summing takes 139
        # registers (split apart: 179)
        if D >= 128:
            even, odd = tl.split(tl.reshape(tl.permute(tl.reshape(pl, (BLOCK_T, 4, E3)), (0, 2, 1)), (BLOCK_T, E3, 2, 2)))
            p0, p2 = tl.split(even)  # slots 0 and 2
            p1, p3 = tl.split(odd)  # slots 1 and 3 (masked off)
            w3 = p0.to(tl.int32) | (p1.to(tl.int32) << 8) | (p2.to(tl.int32) << 16)  # [BLOCK_T, E]
        else:
            w3 = tl.sum(tl.reshape(pl, (BLOCK_T, 4, E3)).to(tl.int32) << (8 * tl.arange(0, 4))[None, :, None], axis=1)  # [BLOCK_T, E]
        # channel 8 j + i is bit i of each plane byte j: halve the bytes three times (nibbles, pairs, bits), each half joined
        # after the previous, so the channels come out in order (as the 4-bit nibbles are split)
        x3 = tl.reshape(tl.join(w3 & 0x0F0F0F, (w3 >> 4) & 0x0F0F0F), (BLOCK_T, 2 * E3))
        x3 = tl.reshape(tl.join(x3 & 0x030303, (x3 >> 2) & 0x030303), (BLOCK_T, 4 * E3))
        x3 = tl.reshape(tl.join(x3 & 0x010101, (x3 >> 1) & 0x010101), (BLOCK_T, D))
        code = ((x3 & 1) | ((x3 >> 7) & 2) | ((x3 >> 14) & 4)).to(tl.float32)
    else:
        ROW: tl.constexpr = D * BITS // 8
        E: tl.constexpr = D // 8
        c = tl.arange(0, HALF)
        nib = tl.load(base + rows[:, None] * ROW + c[None, :], mask=mask[:, None], other=0)
        hi = tl.load(base + rows[:, None] * ROW + HALF + c[None, :], mask=mask[:, None] & (c < ROW - HALF)[None, :], other=0)
        code = tl.reshape(tl.join(nib & 0xF, nib >> 4), (BLOCK_T, D)).to(tl.int32)
        # the four plane slots' bytes j as one 32-bit word (plane p in byte p; slots beyond the planes are masked to 0)
        w = tl.sum(tl.reshape(hi, (BLOCK_T, 4, E)).to(tl.int32) << (8 * tl.arange(0, 4))[None, :, None], axis=1)  # [BLOCK_T, E]
        x = w[:, :, None] >> tl.arange(0, 8)[None, None, :]  # channel 8 j + i: bit i of each plane byte j
        h = x & 1
        if BITS > 5:
            h = h | ((x >> 7) & 2)
        if BITS > 6:
            h = h | ((x >> 14) & 4)
        code = (code | (tl.reshape(h, (BLOCK_T, D)) << 4)).to(tl.float32)
    if SIGNED:
        code = code - 2 ** (BITS - 1)
    return code


@triton.jit
def load_group_meta(base, rows, mask, D: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr):
    """A token's per-group fp16 metadata [BLOCK_T, D // GROUP], read contiguously, broadcast to [BLOCK_T, D]."""
    NG: tl.constexpr = D // GROUP
    if NG == 1:  # one value per token: a [BLOCK_T] vector, broadcast along the channels
        return tl.broadcast_to(tl.load(base + rows, mask=mask, other=0.0).to(tl.float32)[:, None], (BLOCK_T, D))
    m = tl.load(base + rows[:, None] * NG + tl.arange(0, NG)[None, :], mask=mask[:, None], other=0.0).to(tl.float32)
    return tl.reshape(tl.broadcast_to(m[:, :, None], (BLOCK_T, NG, GROUP)), (BLOCK_T, D))


@triton.jit
def load_values(VP, VS, VM, r, tmask, D: tl.constexpr, VAL_BITS: tl.constexpr, GROUP: tl.constexpr, V_SYM: tl.constexpr, V_CODE: tl.constexpr,
                 MIN_STEP: tl.constexpr, BLOCK_T: tl.constexpr):
    """Dequantized values [BLOCK_T, D] float32 of store rows r: symmetric codes * scale, or codes * scale + min
    (V_CODE: the min a byte w, -w * scale / F, reference.coded_min; exact in fp32)."""
    vsc = load_group_meta(VS, r, tmask, D, GROUP, BLOCK_T)
    if V_SYM:
        return load_codes(VP, r, tmask, VAL_BITS, D, BLOCK_T, True) * vsc
    elif V_CODE:
        mn = -(load_group_meta(VM, r, tmask, D, GROUP, BLOCK_T) * vsc) * (1.0 / MIN_STEP)
        return load_codes(VP, r, tmask, VAL_BITS, D, BLOCK_T, False) * vsc + mn
    else:
        return load_codes(VP, r, tmask, VAL_BITS, D, BLOCK_T, False) * vsc + load_group_meta(VM, r, tmask, D, GROUP, BLOCK_T)
