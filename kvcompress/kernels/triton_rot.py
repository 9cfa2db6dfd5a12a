"""The per-token family's kernels (kv=rot4, rot8k_int4v, rot7k_int5v; the layout of kvcompress.kernels.layout).

* `kv_append_rot_kernel` / `decode_split_rot_kernel`: keys and values Hadamard-rotated per head (a fast Walsh-Hadamard
  butterfly in registers, sums of +-x then one scaling, as reference.rotate) and quantized per token, symmetric, with
  fp16 scales rounded up (reference.encode_rotated); decode takes the query already rotated by the caller, multiplies
  the scores by the per-token key scale, and rotates each split's value accumulator back once. The splits are combined
  by triton_steps.decode_reduce_kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcompress.kernels.triton_codes import encode_symmetric, encode_value_token, fwht, load_codes, load_group_meta, load_values, rotate_halves
from kvcompress.kernels.triton_steps import attend_sinks_window, online_step, program, ring_step, softmax_state, split_rows, store_partials


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
    enc, c, k_e, k_o, v_e, v_o = ring_step(KN, VN, SK, SV, WK, WV, bh, tl.load(LENS + b), D, NS, W)
    if enc:
        if ROT_K:
            k_e, k_o = rotate_halves(k_e, k_o, D, LOG2D, INV_SQRT_D)
        if ROT_V:
            v_e, v_o = rotate_halves(v_e, v_o, D, LOG2D, INV_SQRT_D)
        encode_symmetric(k_e, k_o, KP + (bh * CAP + c) * (D * KEY_BITS // 8), KSC + (bh * CAP + c) * (D // KGROUP), D, KEY_BITS, KGROUP)
        encode_value_token(v_e, v_o, bh * CAP + c, VP, VS, VM, D, VAL_BITS, GROUP, V_SYM, V_CODE, MIN_STEP)


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
    b, h, split, bh, n, n_sink, n_comp = program(LENS, H, NS, W)
    d = tl.arange(0, D)
    gi = tl.arange(0, G_PAD)
    gmask = gi < G
    q = tl.load(Q + ((b * H + h) * G + gi[:, None]) * D + d[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
    if ROT_K:
        qr = tl.load(QR + ((b * H + h) * G + gi[:, None]) * D + d[None, :], mask=gmask[:, None], other=0.0).to(tl.float16)
    else:
        qr = q.to(tl.float16)
    m_i, l_i, acc = softmax_state(G_PAD, D)
    lo, hi = split_rows(n_comp, split, SPLITS, BLOCK_T)
    for t0 in range(lo, hi, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        tmask = rows < hi
        kc = load_codes(KP, bh * CAP + rows, tmask, KEY_BITS, D, BLOCK_T, True)
        if KGROUP == D:  # one scale per token: scale the scores
            s = tl.dot(qr, tl.trans(kc.to(tl.float16))) * tl.load(KSC + bh * CAP + rows, mask=tmask, other=0.0).to(tl.float32)[None, :]
        else:
            k = kc * load_group_meta(KSC, bh * CAP + rows, tmask, D, KGROUP, BLOCK_T)
            s = tl.dot(qr, tl.trans(k.to(tl.float16)))
        v = load_values(VP, VS, VM, bh * CAP + rows, tmask, D, VAL_BITS, GROUP, V_SYM, V_CODE, MIN_STEP, BLOCK_T)
        m_i, l_i, acc = online_step(s * sm_scale, tmask, v.to(tl.float16), m_i, l_i, acc)
    if ROT_V:  # back to the values' own basis (fp32)
        acc = fwht(acc, G_PAD, D, LOG2D) * INV_SQRT_D
    if split == SPLITS - 1:
        m_i, l_i, acc = attend_sinks_window(q.to(tl.float16), SK, SV, WK, WV, bh, n, n_sink, n_comp, m_i, l_i, acc, sm_scale, D, NS, NS_PAD, W, BLOCK_T)
    store_partials(MO, LO, AO, (b * H + h) * G + gi, gmask, split, SPLITS, m_i, l_i, acc, D)
