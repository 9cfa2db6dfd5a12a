"""The grouped family's kernels (kv.key.group_tokens: kv=wf3..wf6, kivi_int4; the layout of kvcompress.kernels.layout).

* `kv_append_grp_kernel` / `decode_split_grp_kernel`: keys per channel over groups of GT compressed tokens, a group
  encoded whole from the ring when its first token leaves it, each row's codes one bitstream of per-channel widths
  (reference.pack_bits); decode folds a tile's group scale into the query and its min into a per-query constant.
  Values as the per-token family's. The splits are combined by triton_steps.decode_reduce_kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcompress.kernels.triton_codes import encode_value_token, fp16_down, fp16_up, fwht, load_values, rotate_halves, round_half_even
from kvcompress.kernels.triton_steps import attend_sinks_window, program, ring_step, softmax_state, split_rows, store_partials


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
    mn16 = fp16_down(mn)
    sc16 = fp16_up((mx - mn16.to(tl.float32)) / levels)
    g = bh * CAPG + c // GT
    tl.store(KGS + g * D + d, sc16)
    tl.store(KGM + g * D + d, mn16)
    sc = tl.where(sc16 == 0, 1.0, sc16.to(tl.float32))
    wo = (off // 32)[None, :]
    NW: tl.constexpr = KROW // 4  # the row as 32-bit little-endian words (whole words: KVSpec.check_geometry), bit i in word i // 32
    for r0 in range(0, GT, RB):
        x = tl.load(WK + (bh * W + (c + r0 + r[:, None]) % W) * D + d[None, :]).to(tl.float32)
        code = tl.minimum(tl.maximum(round_half_even((x - mn16.to(tl.float32)[None, :]) / sc[None, :]), 0.0), levels[None, :]).to(tl.int64)
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
    enc, cc, k_e, k_o, v_e, v_o = ring_step(KN, VN, SK, SV, WK, WV, bh, p, D, NS, W)
    if enc:
        if ROT_V:
            v_e, v_o = rotate_halves(v_e, v_o, D, LOG2D, INV_SQRT_D)
        encode_value_token(v_e, v_o, bh * CAP + cc, VP, VS, VM, D, VAL_BITS, GROUP, V_SYM, V_CODE, MIN_STEP)


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
    b, h, split, bh, n, n_sink, n_comp = program(LENS, H, NS, W)
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
    m_i, l_i, acc = softmax_state(G_PAD, D)
    accT = tl.trans(acc)  # [D, G_PAD]
    qT = tl.trans(q)  # [D, G_PAD] fp16
    lo, hi = split_rows(n_comp, split, SPLITS, BLOCK_T)
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
        v = load_values(VP, VS, VM, bh * CAP + rows, tmask, D, VAL_BITS, GROUP, V_SYM, V_CODE, MIN_STEP, BLOCK_T)
        # online_step, transposed: tokens along axis 0, queries along axis 1
        m_new = tl.maximum(m_i, tl.max(sT, axis=0))
        alpha = tl.exp(m_i - m_new)
        pT = tl.where(tmask[:, None], tl.exp(sT - m_new[None, :]), 0.0)
        l_i = l_i * alpha + tl.sum(pT, axis=0)
        accT = accT * alpha[None, :] + tl.dot(tl.trans(v.to(tl.float16)), pT.to(tl.float16))
        m_i = m_new
    acc = tl.trans(accT)
    if ROT_V:  # back to the values' own basis (fp32)
        acc = fwht(acc, G_PAD, D, LOG2D) * INV_SQRT_D
    if split == SPLITS - 1:
        m_i, l_i, acc = attend_sinks_window(q, SK, SV, WK, WV, bh, n, n_sink, n_comp, m_i, l_i, acc, sm_scale, D, NS, NS_PAD, W, BLOCK_T)
    store_partials(MO, LO, AO, (b * H + h) * G + gi, gmask, split, SPLITS, m_i, l_i, acc, D)
