"""Triton kernels on the layout of kvcompress.kernels.layout (one layer per launch).

* `kv_append_kernel`: one new token per sequence; writes it to the sinks or the fp16 ring and
  encodes the token that leaves the ring (keys: static per-channel scale, round-half-even,
  outlier channels to the fp16 side store; values: per-token groups, fp16 scale/min rounded
  outward) -- the rounding points of kvcompress.reference.
* `decode_split_kernel`: one query token per sequence, all query heads of a kv head in one
  program (GQA), split-K over the compressed store (flash-decoding; the split count is a launch
  argument, kvcompress.kernels.plan chooses it). Key scales are folded into the query (q * s_k),
  the zero point into a per-query constant; int8/int4 codes and value codes are dequantized in
  registers. Each packed row is read as one contiguous run of bytes and the per-token metadata as
  one contiguous [D/G] vector, so on 16-byte-aligned buffers the payload loads compile to 128-bit
  (64-bit for narrower rows) loads (kvcompress.kernels.audit checks the SASS). Sinks and the
  window are read as fp16 by the last split.
* `decode_reduce_kernel`: combines the splits' (max, sum, acc), one split at a time.
* `kv_append_rot_kernel` / `decode_split_rot_kernel`: the per-token family (kv=rot4): keys and
  values Hadamard-rotated per head (a fast Walsh-Hadamard butterfly in registers, sums of +-x then
  one scaling, as reference.rotate) and quantized per token, symmetric, with fp16 scales rounded up
  (reference.encode_rotated); decode takes the query already rotated by the caller, multiplies the
  scores by the per-token key scale, and rotates each split's value accumulator back once.
* `kv_append_grp_kernel` / `decode_split_grp_kernel`: the grouped family (kv.key.group_tokens, kv=wf4):
  keys per channel over groups of GT compressed tokens, a group encoded whole from the ring when its
  first token leaves it, each row's codes one bitstream of per-channel widths (reference.pack_bits);
  decode folds a tile's group scale into the query and its min into a per-query constant. Values as
  the per-token family's.
No kernel writes fp16 K/V of the compressed region anywhere.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round_half_even(x):
    r = tl.floor(x + 0.5)
    tie = (r - x) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _fp16_down(x):
    """float32 -> float16 rounded toward -inf (torch.nextafter step when nearest rounded up)."""
    h = x.to(tl.float16)
    bits = h.to(tl.int16, bitcast=True)
    stepped = tl.where(h > 0, bits - 1, tl.where(h < 0, bits + 1, tl.full(bits.shape, -32767, tl.int16)))
    return tl.where(h.to(tl.float32) > x, stepped.to(tl.float16, bitcast=True), h)


@triton.jit
def _fp16_up(x):
    """float32 -> float16 rounded toward +inf."""
    h = x.to(tl.float16)
    bits = h.to(tl.int16, bitcast=True)
    stepped = tl.where(h > 0, bits + 1, tl.where(h < 0, bits - 1, tl.full(bits.shape, 1, tl.int16)))
    return tl.where(h.to(tl.float32) < x, stepped.to(tl.float16, bitcast=True), h)


@triton.jit
def _encode_token(
    k_even, k_odd, v_even, v_odd, c, bh, KS, KZ, OIDX, KP, KO, VP, VS, VM, h,
    CAP, D: tl.constexpr, N_OUT: tl.constexpr, N_OUT_PAD: tl.constexpr,
    KEY_BITS: tl.constexpr, VAL_BITS: tl.constexpr, GROUP: tl.constexpr,
):
    """Encode one fp16 token (given as even/odd channel halves, float32) at compressed index c.
    KEY_BITS == VAL_BITS == 16 (an fp16 layer of a per-layer format): the store holds the fp16 token itself."""
    HALF: tl.constexpr = D // 2
    ie = 2 * tl.arange(0, HALF)
    io = ie + 1
    if KEY_BITS == 16:
        krow = KP + (bh * CAP + c) * D
        vrow = VP + (bh * CAP + c) * D
        tl.store(krow + ie, k_even.to(tl.float16))
        tl.store(krow + io, k_odd.to(tl.float16))
        tl.store(vrow + ie, v_even.to(tl.float16))
        tl.store(vrow + io, v_odd.to(tl.float16))
    else:
        # ---- keys: q = clamp(rhe((k - z) / s), -Q, Q); outlier channels -> 0 and to the fp16 side store
        QMAX: tl.constexpr = 2 ** (KEY_BITS - 1) - 1
        qe = _round_half_even((k_even - tl.load(KZ + h * D + ie)) / tl.load(KS + h * D + ie))
        qo = _round_half_even((k_odd - tl.load(KZ + h * D + io)) / tl.load(KS + h * D + io))
        qe = tl.minimum(tl.maximum(qe, -QMAX), QMAX)
        qo = tl.minimum(tl.maximum(qo, -QMAX), QMAX)
        if N_OUT > 0:
            jo = tl.arange(0, N_OUT_PAD)
            oidx = tl.load(OIDX + h * N_OUT + jo, mask=jo < N_OUT, other=-1)
            is_out_e = tl.sum((ie[:, None] == oidx[None, :]).to(tl.int32), axis=1) > 0
            is_out_o = tl.sum((io[:, None] == oidx[None, :]).to(tl.int32), axis=1) > 0
            qe = tl.where(is_out_e, 0.0, qe)
            qo = tl.where(is_out_o, 0.0, qo)
            ko = tl.sum(tl.where(ie[:, None] == oidx[None, :], k_even[:, None], 0.0), axis=0) + tl.sum(
                tl.where(io[:, None] == oidx[None, :], k_odd[:, None], 0.0), axis=0
            )
            tl.store(KO + (bh * CAP + c) * N_OUT + jo, ko.to(tl.float16), mask=jo < N_OUT)
        _store_signed(qe, qo, KP + (bh * CAP + c) * (D * KEY_BITS // 8), D, KEY_BITS)
        _encode_asymmetric(v_even, v_odd, VP + (bh * CAP + c) * (D * VAL_BITS // 8), VS + (bh * CAP + c) * (D // GROUP),
                           VM + (bh * CAP + c) * (D // GROUP), D, VAL_BITS, GROUP, False, 1)


@triton.jit
def _store_signed(qe, qo, row, D: tl.constexpr, BITS: tl.constexpr):
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
def _group_range(x_even, x_odd, ge, go, g):
    """(min, max) of group g over a token's even and odd channels."""
    gmin = tl.minimum(tl.min(tl.where(ge == g, x_even, float("inf"))), tl.min(tl.where(go == g, x_odd, float("inf"))))
    gmax = tl.maximum(tl.max(tl.where(ge == g, x_even, float("-inf"))), tl.max(tl.where(go == g, x_odd, float("-inf"))))
    return gmin, gmax


@triton.jit
def _encode_asymmetric(x_even, x_odd, row, srow, mrow, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, CODED: tl.constexpr,
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
            sc16 = _fp16_up((tl.maximum(gmax, 0.0) - lo) / (LEVELS - 1.0 / F))
            sc = tl.where(sc16 == 0, 1.0, sc16.to(tl.float32))
            w = tl.minimum(tl.maximum(tl.floor(-lo * F / sc), 0.0), 255.0)
            w = tl.minimum(tl.where(-w * sc > lo * F, w + 1.0, w), 255.0)
            tl.store(mrow + g, w.to(tl.uint8))
            mn = -(w * sc16.to(tl.float32)) * (1.0 / F)
        else:
            mn16 = _fp16_down(gmin)
            sc16 = _fp16_up((gmax - mn16.to(tl.float32)) / LEVELS)
            sc = tl.where(sc16 == 0, 1.0, sc16.to(tl.float32))
            tl.store(mrow + g, mn16)
            mn = mn16.to(tl.float32)
        tl.store(srow + g, sc16)
        se = tl.where(ge == g, sc, se)
        so = tl.where(go == g, sc, so)
        me = tl.where(ge == g, mn, me)
        mo = tl.where(go == g, mn, mo)
    ce = tl.minimum(tl.maximum(_round_half_even((x_even - me) / se), 0.0), LEVELS)
    co = tl.minimum(tl.maximum(_round_half_even((x_odd - mo) / so), 0.0), LEVELS)
    _store_codes(ce, co, row, D, BITS)


@triton.jit
def _encode_symmetric(x_even, x_odd, row, srow, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr):
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
        sc16 = _fp16_up(amax / QMAX)
        tl.store(srow + g, sc16)
        sc = tl.where(sc16 == 0, 1.0, sc16.to(tl.float32))
        se = tl.where(ge == g, sc, se)
        so = tl.where(go == g, sc, so)
    qe = tl.minimum(tl.maximum(_round_half_even(x_even / se), -QMAX), QMAX)
    qo = tl.minimum(tl.maximum(_round_half_even(x_odd / so), -QMAX), QMAX)
    _store_signed(qe, qo, row, D, BITS)


@triton.jit
def _fwht(x, ROWS: tl.constexpr, N: tl.constexpr, LOG2N: tl.constexpr):
    """x @ S for every row of x [ROWS, N], S the Sylvester-Hadamard signs (reference.hadamard_signs):
    the fast Walsh-Hadamard butterfly, one (a + b, a - b) stage per index bit, in registers (no N x N
    matrix is built)."""
    for s in tl.static_range(LOG2N):
        y = tl.permute(tl.reshape(x, (ROWS, N // (2 << s), 2, 1 << s)), (0, 1, 3, 2))
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (ROWS, N))
    return x


@triton.jit
def _rotate_halves(x_even, x_odd, D: tl.constexpr, LOG2D: tl.constexpr, INV_SQRT_D: tl.constexpr):
    """(x @ S) * D**-0.5 for one vector given as even/odd channel halves, returned the same way
    (reference.rotate): the butterflies of the index bits above bit 0 run on each half, bit 0's
    butterfly pairs the halves; sums of +-x, then one rounding by the scale."""
    HALF: tl.constexpr = D // 2
    e = tl.reshape(_fwht(tl.reshape(x_even, (1, HALF)), 1, HALF, LOG2D - 1), (HALF,))
    o = tl.reshape(_fwht(tl.reshape(x_odd, (1, HALF)), 1, HALF, LOG2D - 1), (HALF,))
    return (e + o) * INV_SQRT_D, (e - o) * INV_SQRT_D


@triton.jit
def _ring_step(KN, VN, SK, SV, WK, WV, bh, p, D: tl.constexpr, NS: tl.constexpr, W: tl.constexpr):
    """Store the new token at position p (rounded to fp16, its stored form) in its sink slot or the
    window ring. Returns (encode?, compressed index, that token as float32 even/odd halves of k and v):
    the token leaving the ring (position p - W), or with W = 0 the new token itself."""
    HALF: tl.constexpr = D // 2
    ie = 2 * tl.arange(0, HALF)
    io = ie + 1
    kn_e = tl.load(KN + bh * D + ie).to(tl.float16)
    kn_o = tl.load(KN + bh * D + io).to(tl.float16)
    vn_e = tl.load(VN + bh * D + ie).to(tl.float16)
    vn_o = tl.load(VN + bh * D + io).to(tl.float16)
    j = p - NS
    enc = j >= W
    k_e = kn_e.to(tl.float32)
    k_o = kn_o.to(tl.float32)
    v_e = vn_e.to(tl.float32)
    v_o = vn_o.to(tl.float32)
    if p < NS:
        tl.store(SK + (bh * NS + p) * D + ie, kn_e)
        tl.store(SK + (bh * NS + p) * D + io, kn_o)
        tl.store(SV + (bh * NS + p) * D + ie, vn_e)
        tl.store(SV + (bh * NS + p) * D + io, vn_o)
    elif W > 0:
        slot = j % W
        if enc:  # read the leaving token before its slot is overwritten
            k_e = tl.load(WK + (bh * W + slot) * D + ie).to(tl.float32)
            k_o = tl.load(WK + (bh * W + slot) * D + io).to(tl.float32)
            v_e = tl.load(WV + (bh * W + slot) * D + ie).to(tl.float32)
            v_o = tl.load(WV + (bh * W + slot) * D + io).to(tl.float32)
        tl.store(WK + (bh * W + slot) * D + ie, kn_e)
        tl.store(WK + (bh * W + slot) * D + io, kn_o)
        tl.store(WV + (bh * W + slot) * D + ie, vn_e)
        tl.store(WV + (bh * W + slot) * D + io, vn_o)
    return enc, j - W, k_e, k_o, v_e, v_o


@triton.jit
def kv_append_kernel(
    KN, VN,  # [B, H, D] new tokens (any float dtype)
    KS, KZ, OIDX,  # [H, D] fp32, [H, D] fp32, [H, N_OUT] int32
    SK, SV, WK, WV,  # [B, H, NS, D], [B, H, W, D] fp16
    KP, KO, VP, VS, VM, LENS,
    H, CAP,
    D: tl.constexpr, NS: tl.constexpr, W: tl.constexpr, N_OUT: tl.constexpr, N_OUT_PAD: tl.constexpr,
    KEY_BITS: tl.constexpr, VAL_BITS: tl.constexpr, GROUP: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    bh = b * H + h
    enc, c, k_e, k_o, v_e, v_o = _ring_step(KN, VN, SK, SV, WK, WV, bh, tl.load(LENS + b), D, NS, W)
    if enc:
        _encode_token(k_e, k_o, v_e, v_o, c, bh, KS, KZ, OIDX, KP, KO, VP, VS, VM, h, CAP, D, N_OUT, N_OUT_PAD, KEY_BITS, VAL_BITS, GROUP)


@triton.jit
def kv_append_rot_kernel(
    KN, VN,  # [B, H, D] new tokens (any float dtype)
    SK, SV, WK, WV,  # [B, H, NS, D], [B, H, W, D] fp16
    KP, KSC, VP, VS, VM, LENS,  # KSC: per-token key scales [B, H, CAP, D / KGROUP] fp16; VM unused if V_SYM, uint8 if V_CODE
    H, CAP,
    D: tl.constexpr, NS: tl.constexpr, W: tl.constexpr, KEY_BITS: tl.constexpr, KGROUP: tl.constexpr, ROT_K: tl.constexpr,
    VAL_BITS: tl.constexpr, GROUP: tl.constexpr, V_SYM: tl.constexpr, ROT_V: tl.constexpr, V_CODE: tl.constexpr, MIN_STEP: tl.constexpr,
    LOG2D: tl.constexpr, INV_SQRT_D: tl.constexpr,
):
    """The per-token family (kv.key.granularity=token): keys (Hadamard-rotated if ROT_K) quantized
    per token, symmetric, one fp16 scale per KGROUP channels; values symmetric (V_SYM) or asymmetric,
    rotated if ROT_V, with the min a uint8 code if V_CODE (reference.value_meta_coded; its step
    MIN_STEP = reference.min_code_step, passed by the host). No static
    key parameters."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    bh = b * H + h
    enc, c, k_e, k_o, v_e, v_o = _ring_step(KN, VN, SK, SV, WK, WV, bh, tl.load(LENS + b), D, NS, W)
    if enc:
        if ROT_K:
            k_e, k_o = _rotate_halves(k_e, k_o, D, LOG2D, INV_SQRT_D)
        if ROT_V:
            v_e, v_o = _rotate_halves(v_e, v_o, D, LOG2D, INV_SQRT_D)
        _encode_symmetric(k_e, k_o, KP + (bh * CAP + c) * (D * KEY_BITS // 8), KSC + (bh * CAP + c) * (D // KGROUP), D, KEY_BITS, KGROUP)
        _encode_value_token(v_e, v_o, bh * CAP + c, VP, VS, VM, D, VAL_BITS, GROUP, V_SYM, V_CODE, MIN_STEP)


@triton.jit
def _encode_value_token(v_e, v_o, r, VP, VS, VM, D: tl.constexpr, VAL_BITS: tl.constexpr, GROUP: tl.constexpr, V_SYM: tl.constexpr,
                        V_CODE: tl.constexpr, MIN_STEP: tl.constexpr):
    """A value (already rotated if the format rotates values) into store row r: symmetric (V_SYM) or
    asymmetric, the min an fp16 or (V_CODE) a uint8 code."""
    vrow = VP + r * (D * VAL_BITS // 8)
    if V_SYM:
        _encode_symmetric(v_e, v_o, vrow, VS + r * (D // GROUP), D, VAL_BITS, GROUP)
    else:
        _encode_asymmetric(v_e, v_o, vrow, VS + r * (D // GROUP), VM + r * (D // GROUP), D, VAL_BITS, GROUP, V_CODE, MIN_STEP)


@triton.jit
def _encode_key_group(WK, KP, KB, KOFF, KGS, KGM, bh, h, c, CAP, CAPG, D: tl.constexpr, W: tl.constexpr, GT: tl.constexpr, KROW: tl.constexpr,
                      RB: tl.constexpr):
    """Token-grouped keys (reference.quantize_keys_grouped + pack_bits): the group of compressed rows [c, c + GT),
    read from the ring (slots (c + t) % W), per channel min (fp16 rounded down) and scale = (max - min) /
    (2**bits - 1) (fp16 rounded up), codes clamp(rhe((x - min) / scale), 0, 2**bits - 1), each row's codes
    packed LSB first at the channel's bit offset (a code may straddle two bytes). Two passes over the group
    in chunks of RB rows (range, then codes), so no [GT, D] tile is live."""
    d = tl.arange(0, D)
    r = tl.arange(0, RB)
    mn = tl.full([D], float("inf"), tl.float32)
    mx = tl.full([D], float("-inf"), tl.float32)
    for r0 in range(0, GT, RB):
        x = tl.load(WK + (bh * W + (c + r0 + r[:, None]) % W) * D + d[None, :]).to(tl.float32)  # [RB, D]
        mn = tl.minimum(mn, tl.min(x, axis=0))
        mx = tl.maximum(mx, tl.max(x, axis=0))
    bits = tl.load(KB + h * D + d)
    off = tl.load(KOFF + h * D + d)
    levels = ((1 << bits) - 1).to(tl.float32)
    mn16 = _fp16_down(mn)
    sc16 = _fp16_up((mx - mn16.to(tl.float32)) / levels)
    g = bh * CAPG + c // GT
    tl.store(KGS + g * D + d, sc16)
    tl.store(KGM + g * D + d, mn16)
    sc = tl.where(sc16 == 0, 1.0, sc16.to(tl.float32))
    wo = (off // 32)[None, :]
    NW: tl.constexpr = KROW // 4  # the row as 32-bit little-endian words (whole words: KVSpec.check_geometry), bit i in word i // 32
    for r0 in range(0, GT, RB):
        x = tl.load(WK + (bh * W + (c + r0 + r[:, None]) % W) * D + d[None, :]).to(tl.float32)
        code = tl.minimum(tl.maximum(_round_half_even((x - mn16.to(tl.float32)[None, :]) / sc[None, :]), 0.0), levels[None, :]).to(tl.int64)
        v = code << (off % 32)[None, :].to(tl.int64)  # at most 39 bits: the low 32 go to word off // 32, the rest to the next
        lo = v & 0xFFFFFFFF
        hi = v >> 32
        row = (KP + (bh * CAP + c + r0 + r) * KROW).to(tl.pointer_type(tl.uint32))
        for j in tl.static_range(NW):
            word = tl.sum(tl.where(wo == j, lo, 0) + tl.where(wo + 1 == j, hi, 0), axis=1)  # bits never overlap: the sum is an OR
            tl.store(row + j, word.to(tl.uint32))


@triton.jit
def kv_append_grp_kernel(
    KN, VN,  # [B, H, D] new tokens (any float dtype)
    SK, SV, WK, WV,  # [B, H, NS, D], [B, H, W, D] fp16
    KP, KB, KOFF, KGS, KGM,  # KP [B, H, CAPG * GT, KROW] uint8; KB, KOFF [H, D] int32 bits and bit offsets; KGS, KGM [B, H, CAPG, D] fp16
    VP, VS, VM, LENS,
    H, CAP, CAPG,
    D: tl.constexpr, NS: tl.constexpr, W: tl.constexpr, GT: tl.constexpr, KROW: tl.constexpr,
    VAL_BITS: tl.constexpr, GROUP: tl.constexpr, V_SYM: tl.constexpr, ROT_V: tl.constexpr, V_CODE: tl.constexpr, MIN_STEP: tl.constexpr,
    LOG2D: tl.constexpr, INV_SQRT_D: tl.constexpr,
):
    """The grouped family (kv.key.group_tokens, kv=wf4): before the ring step, when the token leaving the ring
    starts a group (compressed index c a multiple of GT), the whole group is encoded from the ring; the
    leaving token's value is encoded as in the per-token family."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    bh = b * H + h
    p = tl.load(LENS + b)
    c = p - NS - W
    if (p >= NS) & (c >= 0):
        if c % GT == 0:
            _encode_key_group(WK, KP, KB, KOFF, KGS, KGM, bh, h, c, CAP, CAPG, D, W, GT, KROW, 8)
    enc, cc, k_e, k_o, v_e, v_o = _ring_step(KN, VN, SK, SV, WK, WV, bh, p, D, NS, W)
    if enc:
        if ROT_V:
            v_e, v_o = _rotate_halves(v_e, v_o, D, LOG2D, INV_SQRT_D)
        _encode_value_token(v_e, v_o, bh * CAP + cc, VP, VS, VM, D, VAL_BITS, GROUP, V_SYM, V_CODE, MIN_STEP)


@triton.jit
def _load_codes(base, rows, mask, BITS: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, SIGNED: tl.constexpr):
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
def _load_group_meta(base, rows, mask, D: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr):
    """A token's per-group fp16 metadata [BLOCK_T, D // GROUP], read contiguously, broadcast to [BLOCK_T, D]."""
    NG: tl.constexpr = D // GROUP
    if NG == 1:  # one value per token: a [BLOCK_T] vector, broadcast along the channels
        return tl.broadcast_to(tl.load(base + rows, mask=mask, other=0.0).to(tl.float32)[:, None], (BLOCK_T, D))
    m = tl.load(base + rows[:, None] * NG + tl.arange(0, NG)[None, :], mask=mask[:, None], other=0.0).to(tl.float32)
    return tl.reshape(tl.broadcast_to(m[:, :, None], (BLOCK_T, NG, GROUP)), (BLOCK_T, D))


@triton.jit
def _online_step(s, valid, v16, m_i, l_i, acc):
    """One online-softmax step: scaled scores s [G, N] of rows valid [N] with values v16 [N, D] fp16."""
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.where(valid[None, :], tl.exp(s - m_new[:, None]), 0.0)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v16)
    return m_new, l_i, acc


@triton.jit
def _attend_fp16(q16, k, v, valid, m_i, l_i, acc, sm_scale):
    """One online-softmax step over fp16 rows k, v [N, D] (valid: [N]) for queries q16 [G, D]."""
    return _online_step(tl.dot(q16, tl.trans(k)) * sm_scale, valid, v, m_i, l_i, acc)


@triton.jit
def _softmax_state(G_PAD: tl.constexpr, D: tl.constexpr):
    """An empty online-softmax state (running max, sum, accumulator) for G_PAD query rows."""
    return tl.full([G_PAD], float("-inf"), tl.float32), tl.zeros([G_PAD], tl.float32), tl.zeros([G_PAD, D], tl.float32)


@triton.jit
def _program(LENS, H, NS: tl.constexpr, W: tl.constexpr):
    """A split program's (b, h, split, b * H + h, tokens, sinks held, compressed tokens)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(LENS + b)
    return b, h, tl.program_id(2), b * H + h, n, tl.minimum(n, NS), tl.maximum(n - NS - W, 0)


@triton.jit
def _split_rows(n_comp, split, SPLITS, BLOCK_T: tl.constexpr):
    """[lo, hi): this split's share of the compressed store, whole BLOCK_T blocks."""
    per = tl.cdiv(tl.cdiv(n_comp, SPLITS), BLOCK_T) * BLOCK_T
    lo = split * per
    return lo, tl.minimum(lo + per, n_comp)


@triton.jit
def decode_split_kernel(
    Q,  # [B, HQ, D]
    KS, KZM, OIDX,  # key scale [H, D] fp32; zero with outlier channels zeroed [H, D] fp32; [H, N_OUT] int32
    SK, SV, WK, WV, KP, KO, VP, VS, VM, LENS,
    MO, LO, AO,  # [B, HQ, SPLITS] fp32, [B, HQ, SPLITS] fp32, [B, HQ, SPLITS, D] fp32
    sm_scale, H, CAP, SPLITS,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, NS: tl.constexpr, NS_PAD: tl.constexpr, W: tl.constexpr,
    N_OUT: tl.constexpr, N_OUT_PAD: tl.constexpr, KEY_BITS: tl.constexpr, VAL_BITS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    b, h, split, bh, n, n_sink, n_comp = _program(LENS, H, NS, W)
    d = tl.arange(0, D)
    gi = tl.arange(0, G_PAD)
    gmask = gi < G
    q = tl.load(Q + ((b * H + h) * G + gi[:, None]) * D + d[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
    qs = (q * tl.load(KS + h * D + d)[None, :]).to(tl.float16)  # key scale folded into the query
    qz = tl.sum(q * tl.load(KZM + h * D + d)[None, :], axis=1)  # zero point: one constant per query
    m_i, l_i, acc = _softmax_state(G_PAD, D)
    # ---- the compressed store: this split's share
    lo, hi = _split_rows(n_comp, split, SPLITS, BLOCK_T)
    if N_OUT > 0:
        jo = tl.arange(0, N_OUT_PAD)
        oidx = tl.load(OIDX + h * N_OUT + jo, mask=jo < N_OUT, other=0)
        q_out = tl.load(Q + ((b * H + h) * G + gi[:, None]) * D + oidx[None, :], mask=gmask[:, None] & (jo < N_OUT)[None, :], other=0.0).to(tl.float32)
    for t0 in range(lo, hi, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        tmask = rows < hi
        if KEY_BITS == 16:  # an fp16 layer: the store holds fp16 rows, read as the window is
            kf = tl.load(KP + (bh * CAP + rows[:, None]) * D + d[None, :], mask=tmask[:, None], other=0.0)
            vf = tl.load(VP + (bh * CAP + rows[:, None]) * D + d[None, :], mask=tmask[:, None], other=0.0)
            m_i, l_i, acc = _attend_fp16(q.to(tl.float16), kf, vf, tmask, m_i, l_i, acc, sm_scale)
        else:
            kq = _load_codes(KP, bh * CAP + rows, tmask, KEY_BITS, D, BLOCK_T, True)
            s = tl.dot(qs, tl.trans(kq.to(tl.float16)))  # [G_PAD, BLOCK_T]
            if N_OUT > 0:
                for j in tl.static_range(N_OUT):  # one fp16 outlier channel at a time: q_j * k_j (fp32)
                    q_j = tl.sum(tl.where((jo == j)[None, :], q_out, 0.0), axis=1)
                    k_j = tl.load(KO + (bh * CAP + rows) * N_OUT + j, mask=tmask, other=0.0).to(tl.float32)
                    s += q_j[:, None] * k_j[None, :]
            vc = _load_codes(VP, bh * CAP + rows, tmask, VAL_BITS, D, BLOCK_T, False)
            vsc = _load_group_meta(VS, bh * CAP + rows, tmask, D, GROUP, BLOCK_T)
            vmn = _load_group_meta(VM, bh * CAP + rows, tmask, D, GROUP, BLOCK_T)
            v = (vc * vsc + vmn).to(tl.float16)  # dequantized in registers
            m_i, l_i, acc = _online_step((s + qz[:, None]) * sm_scale, tmask, v, m_i, l_i, acc)
    # ---- fp16 sinks and window: the last split
    if split == SPLITS - 1:
        m_i, l_i, acc = _attend_sinks_window(q.to(tl.float16), SK, SV, WK, WV, bh, n, n_sink, n_comp, m_i, l_i, acc, sm_scale, D, NS, NS_PAD, W, BLOCK_T)
    _store_partials(MO, LO, AO, (b * H + h) * G + gi, gmask, split, SPLITS, m_i, l_i, acc, D)


@triton.jit
def _attend_sinks_window(q16, SK, SV, WK, WV, bh, n, n_sink, n_comp, m_i, l_i, acc, sm_scale,
                         D: tl.constexpr, NS: tl.constexpr, NS_PAD: tl.constexpr, W: tl.constexpr, BLOCK_T: tl.constexpr):
    """The fp16 sinks and the window ring (read by a sequence's last split)."""
    d = tl.arange(0, D)
    if NS > 0:
        srow = tl.arange(0, NS_PAD)
        smask = srow < n_sink
        ks_ = tl.load(SK + (bh * NS + srow[:, None]) * D + d[None, :], mask=smask[:, None], other=0.0)
        vs_ = tl.load(SV + (bh * NS + srow[:, None]) * D + d[None, :], mask=smask[:, None], other=0.0)
        m_i, l_i, acc = _attend_fp16(q16, ks_, vs_, smask, m_i, l_i, acc, sm_scale)
    if W > 0:
        w_start = n_sink + n_comp
        for t0 in range(w_start, n, BLOCK_T):
            pos = t0 + tl.arange(0, BLOCK_T)
            wmask = pos < n
            slot = (pos - NS) % W
            kw = tl.load(WK + (bh * W + slot[:, None]) * D + d[None, :], mask=wmask[:, None], other=0.0)
            vw = tl.load(WV + (bh * W + slot[:, None]) * D + d[None, :], mask=wmask[:, None], other=0.0)
            m_i, l_i, acc = _attend_fp16(q16, kw, vw, wmask, m_i, l_i, acc, sm_scale)
    return m_i, l_i, acc


@triton.jit
def _store_partials(MO, LO, AO, row, gmask, split, SPLITS, m_i, l_i, acc, D: tl.constexpr):
    d = tl.arange(0, D)
    tl.store(MO + row * SPLITS + split, m_i, mask=gmask)
    tl.store(LO + row * SPLITS + split, l_i, mask=gmask)
    tl.store(AO + (row[:, None] * SPLITS + split) * D + d[None, :], acc, mask=gmask[:, None])


@triton.jit
def _load_values(VP, VS, VM, r, tmask, D: tl.constexpr, VAL_BITS: tl.constexpr, GROUP: tl.constexpr, V_SYM: tl.constexpr, V_CODE: tl.constexpr,
                 MIN_STEP: tl.constexpr, BLOCK_T: tl.constexpr):
    """Dequantized values [BLOCK_T, D] float32 of store rows r: symmetric codes * scale, or codes * scale + min
    (V_CODE: the min a byte w, -w * scale / F, reference.coded_min; exact in fp32)."""
    vsc = _load_group_meta(VS, r, tmask, D, GROUP, BLOCK_T)
    if V_SYM:
        return _load_codes(VP, r, tmask, VAL_BITS, D, BLOCK_T, True) * vsc
    elif V_CODE:
        mn = -(_load_group_meta(VM, r, tmask, D, GROUP, BLOCK_T) * vsc) * (1.0 / MIN_STEP)
        return _load_codes(VP, r, tmask, VAL_BITS, D, BLOCK_T, False) * vsc + mn
    else:
        return _load_codes(VP, r, tmask, VAL_BITS, D, BLOCK_T, False) * vsc + _load_group_meta(VM, r, tmask, D, GROUP, BLOCK_T)


@triton.jit
def decode_split_rot_kernel(
    Q, QR,  # [B, HQ, D]: the query, and (ROT_K) the query rotated by the caller, q @ H (reference.rotate)
    SK, SV, WK, WV, KP, KSC, VP, VS, VM, LENS,  # KSC: per-token key scales [B, H, CAP, D / KGROUP] fp16
    MO, LO, AO,  # [B, HQ, SPLITS] fp32, [B, HQ, SPLITS] fp32, [B, HQ, SPLITS, D] fp32
    sm_scale, H, CAP, SPLITS,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, NS: tl.constexpr, NS_PAD: tl.constexpr, W: tl.constexpr,
    KEY_BITS: tl.constexpr, KGROUP: tl.constexpr, ROT_K: tl.constexpr, VAL_BITS: tl.constexpr, GROUP: tl.constexpr,
    V_SYM: tl.constexpr, ROT_V: tl.constexpr, V_CODE: tl.constexpr, MIN_STEP: tl.constexpr, LOG2D: tl.constexpr, INV_SQRT_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """decode_split_kernel for the per-token family (kv_append_rot_kernel's layout). The caller
    rotates the query once per step (ROT_K: QR = q @ H, so q.k needs no per-token rotation; done in
    the kernel it cost 30 registers per thread); with one key scale per token
    (KGROUP = D) it multiplies the scores, not the keys. Values are accumulated in the rotated basis
    and the split's accumulator is rotated back once (ROT_V: acc @ H, fp32) before the fp16 sinks and
    window, which are stored unrotated (a fast Walsh-Hadamard butterfly in registers)."""
    b, h, split, bh, n, n_sink, n_comp = _program(LENS, H, NS, W)
    d = tl.arange(0, D)
    gi = tl.arange(0, G_PAD)
    gmask = gi < G
    q = tl.load(Q + ((b * H + h) * G + gi[:, None]) * D + d[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
    if ROT_K:
        qr = tl.load(QR + ((b * H + h) * G + gi[:, None]) * D + d[None, :], mask=gmask[:, None], other=0.0).to(tl.float16)
    else:
        qr = q.to(tl.float16)
    m_i, l_i, acc = _softmax_state(G_PAD, D)
    lo, hi = _split_rows(n_comp, split, SPLITS, BLOCK_T)
    for t0 in range(lo, hi, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        tmask = rows < hi
        kc = _load_codes(KP, bh * CAP + rows, tmask, KEY_BITS, D, BLOCK_T, True)
        if KGROUP == D:  # one scale per token: scale the scores
            s = tl.dot(qr, tl.trans(kc.to(tl.float16))) * tl.load(KSC + bh * CAP + rows, mask=tmask, other=0.0).to(tl.float32)[None, :]
        else:
            k = kc * _load_group_meta(KSC, bh * CAP + rows, tmask, D, KGROUP, BLOCK_T)
            s = tl.dot(qr, tl.trans(k.to(tl.float16)))
        v = _load_values(VP, VS, VM, bh * CAP + rows, tmask, D, VAL_BITS, GROUP, V_SYM, V_CODE, MIN_STEP, BLOCK_T)
        m_i, l_i, acc = _online_step(s * sm_scale, tmask, v.to(tl.float16), m_i, l_i, acc)
    if ROT_V:  # back to the values' own basis (fp32)
        acc = _fwht(acc, G_PAD, D, LOG2D) * INV_SQRT_D
    if split == SPLITS - 1:
        m_i, l_i, acc = _attend_sinks_window(q.to(tl.float16), SK, SV, WK, WV, bh, n, n_sink, n_comp, m_i, l_i, acc, sm_scale, D, NS, NS_PAD, W, BLOCK_T)
    _store_partials(MO, LO, AO, (b * H + h) * G + gi, gmask, split, SPLITS, m_i, l_i, acc, D)


@triton.jit
def decode_split_grp_kernel(
    Q,  # [B, HQ, D]
    SK, SV, WK, WV, KP, KB, KOFF, KGS, KGM, VP, VS, VM, LENS,  # kv_append_grp_kernel's layout
    MO, LO, AO,  # [B, HQ, SPLITS] fp32, [B, HQ, SPLITS] fp32, [B, HQ, SPLITS, D] fp32
    sm_scale, H, CAP, CAPG, SPLITS,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, NS: tl.constexpr, NS_PAD: tl.constexpr, W: tl.constexpr,
    GT: tl.constexpr, KROW: tl.constexpr, NW_PAD: tl.constexpr, VAL_BITS: tl.constexpr, GROUP: tl.constexpr,
    V_SYM: tl.constexpr, ROT_V: tl.constexpr, V_CODE: tl.constexpr, MIN_STEP: tl.constexpr, LOG2D: tl.constexpr, INV_SQRT_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """decode_split_kernel for the grouped family. BLOCK_T divides GT, so a tile lies in one key group: its
    per-channel scale is folded into the query (q * s) and its min into one constant per query (q . min), as
    the static family folds its scales. Scores and the accumulator are computed transposed (tokens x queries,
    channels x queries): fewer registers per thread than queries x tokens (measured once with the SASS audit when introduced:
    232 -> 178 at head dim 128, wf5).
    A tile's key rows are loaded whole as 32-bit words (wide loads) and
    each channel's code is cut from the two words around its bit offset (tl.gather in registers; widths 1..8,
    per channel, static per layer). A row of NW = KROW // 4 words is read as NW_PAD > NW words, the ones past the
    row masked off (ops.grouped_decode_words), so a code's second word is always in the tile (past the row's last
    word: a masked-off 0)."""
    b, h, split, bh, n, n_sink, n_comp = _program(LENS, H, NS, W)
    d = tl.arange(0, D)
    gi = tl.arange(0, G_PAD)
    gmask = gi < G
    q = tl.load(Q + ((b * H + h) * G + gi[:, None]) * D + d[None, :], mask=gmask[:, None], other=0.0).to(tl.float16)
    bits = tl.load(KB + h * D + d)
    off = tl.load(KOFF + h * D + d)
    NW: tl.constexpr = KROW // 4  # a key row as 32-bit words, loaded whole (wide loads); each code cut from two of them
    wd = tl.arange(0, NW_PAD)
    wi = off // 32
    wi1 = wi + 1  # the row's last word is followed by a masked-off one (NW_PAD > NW)
    sh = (off % 32).to(tl.uint32)
    cmask = ((1 << bits) - 1).to(tl.uint32)
    m_i, l_i, acc = _softmax_state(G_PAD, D)
    accT = tl.trans(acc)  # [D, G_PAD]
    qT = tl.trans(q)  # [D, G_PAD] fp16
    lo, hi = _split_rows(n_comp, split, SPLITS, BLOCK_T)
    for t0 in range(lo, hi, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        tmask = rows < hi
        gidx = (bh * CAPG + t0 // GT) * D + d
        qsT = qT * tl.load(KGS + gidx)[:, None]  # the group's scale folded into the query (an fp16 product: rounded once, as in fp32)
        qz = tl.sum(qT.to(tl.float32) * tl.load(KGM + gidx).to(tl.float32)[:, None], axis=0)  # its min: one constant per query
        wmask = tmask[:, None] & (wd < NW)[None, :]
        words = tl.load((KP + (bh * CAP + rows[:, None]) * KROW).to(tl.pointer_type(tl.uint32)) + wd[None, :], mask=wmask, other=0)
        w0 = tl.gather(words, tl.broadcast_to(wi[None, :], (BLOCK_T, D)), axis=1)
        w1 = tl.gather(words, tl.broadcast_to(wi1[None, :], (BLOCK_T, D)), axis=1)
        # 32-bit funnel shift: the high word's bits enter above the low word's (two shifts, each < 32, so sh = 0 adds nothing)
        code = ((w0 >> sh[None, :]) | ((w1 << 1) << (31 - sh)[None, :])) & cmask[None, :]
        sT = tl.where(tmask[:, None], (tl.dot(code.to(tl.float16), qsT) + qz[None, :]) * sm_scale, float("-inf"))  # [BLOCK_T, G_PAD]
        v = _load_values(VP, VS, VM, bh * CAP + rows, tmask, D, VAL_BITS, GROUP, V_SYM, V_CODE, MIN_STEP, BLOCK_T)
        # _online_step, transposed: tokens along axis 0, queries along axis 1
        m_new = tl.maximum(m_i, tl.max(sT, axis=0))
        alpha = tl.exp(m_i - m_new)
        pT = tl.where(tmask[:, None], tl.exp(sT - m_new[None, :]), 0.0)
        l_i = l_i * alpha + tl.sum(pT, axis=0)
        accT = accT * alpha[None, :] + tl.dot(tl.trans(v.to(tl.float16)), pT.to(tl.float16))
        m_i = m_new
    acc = tl.trans(accT)
    if ROT_V:  # back to the values' own basis (fp32)
        acc = _fwht(acc, G_PAD, D, LOG2D) * INV_SQRT_D
    if split == SPLITS - 1:
        m_i, l_i, acc = _attend_sinks_window(q, SK, SV, WK, WV, bh, n, n_sink, n_comp, m_i, l_i, acc, sm_scale, D, NS, NS_PAD, W, BLOCK_T)
    _store_partials(MO, LO, AO, (b * H + h) * G + gi, gmask, split, SPLITS, m_i, l_i, acc, D)


@triton.jit
def decode_reduce_kernel(MO, LO, AO, OUT, SPLITS, D: tl.constexpr):
    """out = sum_i exp(m_i - m) acc_i / sum_i exp(m_i - m) l_i  over the SPLITS splits of one query
    row, merged one split at a time (online, so any split count runs with the same registers)."""
    row = tl.program_id(0)
    d = tl.arange(0, D)
    m = tl.load(MO + row * SPLITS)
    den = tl.load(LO + row * SPLITS)
    num = tl.load(AO + row * SPLITS * D + d)
    for i in range(1, SPLITS):
        m_i = tl.load(MO + row * SPLITS + i)
        m_new = tl.maximum(m, m_i)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_safe))
        b = tl.where(m_i == float("-inf"), 0.0, tl.exp(m_i - m_safe))
        den = den * a + tl.load(LO + row * SPLITS + i) * b
        num = num * a + tl.load(AO + (row * SPLITS + i) * D + d) * b
        m = m_new
    tl.store(OUT + row * D + d, num / tl.where(den == 0.0, 1.0, den))
