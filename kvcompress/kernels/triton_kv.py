"""Triton kernels on the layout of kvcompress.kernels.layout (one layer per launch): the static family here, the
per-token family in triton_rot, the grouped family in triton_grp; what they share in triton_codes (the packed codes:
rounding, stores, loads) and triton_steps (the ring step, online softmax, split partials, `decode_reduce_kernel`).

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
  window are read as fp16 by the last split. triton_steps.decode_reduce_kernel combines the splits.
No kernel of any family writes fp16 K/V of the compressed region anywhere.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcompress.kernels.triton_codes import encode_asymmetric, load_codes, load_group_meta, round_half_even, store_signed
from kvcompress.kernels.triton_steps import attend_fp16, attend_sinks_window, online_step, program, ring_step, softmax_state, split_rows, store_partials


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
        qe = round_half_even((k_even - tl.load(KZ + h * D + ie)) / tl.load(KS + h * D + ie))
        qo = round_half_even((k_odd - tl.load(KZ + h * D + io)) / tl.load(KS + h * D + io))
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
        store_signed(qe, qo, KP + (bh * CAP + c) * (D * KEY_BITS // 8), D, KEY_BITS)
        encode_asymmetric(v_even, v_odd, VP + (bh * CAP + c) * (D * VAL_BITS // 8), VS + (bh * CAP + c) * (D // GROUP),
                           VM + (bh * CAP + c) * (D // GROUP), D, VAL_BITS, GROUP, False, 1)


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
    enc, c, k_e, k_o, v_e, v_o = ring_step(KN, VN, SK, SV, WK, WV, bh, tl.load(LENS + b), D, NS, W)
    if enc:
        _encode_token(k_e, k_o, v_e, v_o, c, bh, KS, KZ, OIDX, KP, KO, VP, VS, VM, h, CAP, D, N_OUT, N_OUT_PAD, KEY_BITS, VAL_BITS, GROUP)


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
    b, h, split, bh, n, n_sink, n_comp = program(LENS, H, NS, W)
    d = tl.arange(0, D)
    gi = tl.arange(0, G_PAD)
    gmask = gi < G
    q = tl.load(Q + ((b * H + h) * G + gi[:, None]) * D + d[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
    qs = (q * tl.load(KS + h * D + d)[None, :]).to(tl.float16)  # key scale folded into the query
    qz = tl.sum(q * tl.load(KZM + h * D + d)[None, :], axis=1)  # zero point: one constant per query
    m_i, l_i, acc = softmax_state(G_PAD, D)
    # ---- the compressed store: this split's share
    lo, hi = split_rows(n_comp, split, SPLITS, BLOCK_T)
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
            m_i, l_i, acc = attend_fp16(q.to(tl.float16), kf, vf, tmask, m_i, l_i, acc, sm_scale)
        else:
            kq = load_codes(KP, bh * CAP + rows, tmask, KEY_BITS, D, BLOCK_T, True)
            s = tl.dot(qs, tl.trans(kq.to(tl.float16)))  # [G_PAD, BLOCK_T]
            if N_OUT > 0:
                for j in tl.static_range(N_OUT):  # one fp16 outlier channel at a time: q_j * k_j (fp32)
                    q_j = tl.sum(tl.where((jo == j)[None, :], q_out, 0.0), axis=1)
                    k_j = tl.load(KO + (bh * CAP + rows) * N_OUT + j, mask=tmask, other=0.0).to(tl.float32)
                    s += q_j[:, None] * k_j[None, :]
            vc = load_codes(VP, bh * CAP + rows, tmask, VAL_BITS, D, BLOCK_T, False)
            vsc = load_group_meta(VS, bh * CAP + rows, tmask, D, GROUP, BLOCK_T)
            vmn = load_group_meta(VM, bh * CAP + rows, tmask, D, GROUP, BLOCK_T)
            v = (vc * vsc + vmn).to(tl.float16)  # dequantized in registers
            m_i, l_i, acc = online_step((s + qz[:, None]) * sm_scale, tmask, v, m_i, l_i, acc)
    # ---- fp16 sinks and window: the last split
    if split == SPLITS - 1:
        m_i, l_i, acc = attend_sinks_window(q.to(tl.float16), SK, SV, WK, WV, bh, n, n_sink, n_comp, m_i, l_i, acc, sm_scale, D, NS, NS_PAD, W, BLOCK_T)
    store_partials(MO, LO, AO, (b * H + h) * G + gi, gmask, split, SPLITS, m_i, l_i, acc, D)
