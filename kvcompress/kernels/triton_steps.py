"""The steps the kernel families share (triton_kv, triton_rot, triton_grp): the ring step of an append (a new token
into the sinks or the fp16 ring, the token that leaves the ring handed to the family's encoder), the online softmax,
a split's rows and fp16 sinks and window, its partials, and `decode_reduce_kernel`, which combines the splits' (max,
sum, acc), one split at a time."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def ring_step(KN, VN, SK, SV, WK, WV, bh, p, D: tl.constexpr, NS: tl.constexpr, W: tl.constexpr):
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
def online_step(s, valid, v16, m_i, l_i, acc):
    """One online-softmax step: scaled scores s [G, N] of rows valid [N] with values v16 [N, D] fp16."""
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.where(valid[None, :], tl.exp(s - m_new[:, None]), 0.0)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v16)
    return m_new, l_i, acc


@triton.jit
def attend_fp16(q16, k, v, valid, m_i, l_i, acc, sm_scale):
    """One online-softmax step over fp16 rows k, v [N, D] (valid: [N]) for queries q16 [G, D]."""
    return online_step(tl.dot(q16, tl.trans(k)) * sm_scale, valid, v, m_i, l_i, acc)


@triton.jit
def softmax_state(G_PAD: tl.constexpr, D: tl.constexpr):
    """An empty online-softmax state (running max, sum, accumulator) for G_PAD query rows."""
    return tl.full([G_PAD], float("-inf"), tl.float32), tl.zeros([G_PAD], tl.float32), tl.zeros([G_PAD, D], tl.float32)


@triton.jit
def program(LENS, H, NS: tl.constexpr, W: tl.constexpr):
    """A split program's (b, h, split, b * H + h, tokens, sinks held, compressed tokens)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(LENS + b)
    return b, h, tl.program_id(2), b * H + h, n, tl.minimum(n, NS), tl.maximum(n - NS - W, 0)


@triton.jit
def split_rows(n_comp, split, SPLITS, BLOCK_T: tl.constexpr):
    """[lo, hi): this split's share of the compressed store, whole BLOCK_T blocks."""
    per = tl.cdiv(tl.cdiv(n_comp, SPLITS), BLOCK_T) * BLOCK_T
    lo = split * per
    return lo, tl.minimum(lo + per, n_comp)


@triton.jit
def attend_sinks_window(q16, SK, SV, WK, WV, bh, n, n_sink, n_comp, m_i, l_i, acc, sm_scale,
                         D: tl.constexpr, NS: tl.constexpr, NS_PAD: tl.constexpr, W: tl.constexpr, BLOCK_T: tl.constexpr):
    """The fp16 sinks and the window ring (read by a sequence's last split)."""
    d = tl.arange(0, D)
    if NS > 0:
        srow = tl.arange(0, NS_PAD)
        smask = srow < n_sink
        ks_ = tl.load(SK + (bh * NS + srow[:, None]) * D + d[None, :], mask=smask[:, None], other=0.0)
        vs_ = tl.load(SV + (bh * NS + srow[:, None]) * D + d[None, :], mask=smask[:, None], other=0.0)
        m_i, l_i, acc = attend_fp16(q16, ks_, vs_, smask, m_i, l_i, acc, sm_scale)
    if W > 0:
        w_start = n_sink + n_comp
        for t0 in range(w_start, n, BLOCK_T):
            pos = t0 + tl.arange(0, BLOCK_T)
            wmask = pos < n
            slot = (pos - NS) % W
            kw = tl.load(WK + (bh * W + slot[:, None]) * D + d[None, :], mask=wmask[:, None], other=0.0)
            vw = tl.load(WV + (bh * W + slot[:, None]) * D + d[None, :], mask=wmask[:, None], other=0.0)
            m_i, l_i, acc = attend_fp16(q16, kw, vw, wmask, m_i, l_i, acc, sm_scale)
    return m_i, l_i, acc


@triton.jit
def store_partials(MO, LO, AO, row, gmask, split, SPLITS, m_i, l_i, acc, D: tl.constexpr):
    d = tl.arange(0, D)
    tl.store(MO + row * SPLITS + split, m_i, mask=gmask)
    tl.store(LO + row * SPLITS + split, l_i, mask=gmask)
    tl.store(AO + (row[:, None] * SPLITS + split) * D + d[None, :], acc, mask=gmask[:, None])


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
