"""Host side of the Triton kernels: launch parameters and the reference they are tested against.

On a CPU tensor the kernels run under Triton's interpreter (set TRITON_INTERPRET=1 before
triton is imported); on a CUDA tensor they run natively.
"""
from __future__ import annotations

import torch
import triton

from kvcompress import reference as ref
from kvcompress.kernels import plan
from kvcompress.kernels.bytes_model import CacheFormat
from kvcompress.kernels.layout import PackedKV
from kvcompress.kernels.triton_grp import decode_split_grp_kernel, kv_append_grp_kernel
from kvcompress.kernels.triton_kv import decode_split_kernel, kv_append_kernel
from kvcompress.kernels.triton_rot import decode_split_rot_kernel, kv_append_rot_kernel
from kvcompress.kernels.triton_steps import decode_reduce_kernel
from kvcompress.reference import KeyParams

MIN_DOT = 16  # tl.dot needs every dimension >= 16 on tensor cores


def _pad(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(max(n, 1)))


def kernel_key_params(p: KeyParams, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale, zero, zero with outlier channels zeroed, outlier idx int32) on `device`."""
    scale = p.scale.to(device, torch.float32).contiguous()
    zero = p.zero.to(device, torch.float32).contiguous()
    zm = zero.clone()
    if p.outlier_idx.numel():
        zm.scatter_(-1, p.outlier_idx.to(device), 0.0)
    idx = p.outlier_idx.to(device, torch.int32).contiguous()
    return scale, zero, zm, idx


def per_token_constants(D: int, key_bits: int, key_group: int, key_rotate: bool, value_bits: int, group: int,
                        value_symmetric: bool, value_rotate: bool, value_coded_min: bool = False) -> dict:
    """The per-token family's constexprs (kv_append_rot_kernel, decode_split_rot_kernel), for the
    launches here and the AOT build alike."""
    return dict(D=D, KEY_BITS=key_bits, KGROUP=key_group, ROT_K=int(key_rotate), VAL_BITS=value_bits, GROUP=group,
                V_SYM=int(value_symmetric), ROT_V=int(value_rotate), V_CODE=int(value_coded_min),
                MIN_STEP=ref.min_code_step(value_bits), LOG2D=D.bit_length() - 1, INV_SQRT_D=D**-0.5)


def _packed_constants(kv: PackedKV, D: int) -> dict:
    if kv.grouped:
        return grouped_constants(D, kv.key_group_tokens, kv.key_bits, kv.value_bits, kv.group, kv.value_symmetric, kv.value_rotate, kv.value_coded_min)
    return per_token_constants(D, kv.key_bits, kv.key_group, kv.key_rotate, kv.value_bits, kv.group, kv.value_symmetric, kv.value_rotate, kv.value_coded_min)


def grouped_constants(D: int, group_tokens: int, key_bits: int, value_bits: int, group: int, value_symmetric: bool, value_rotate: bool,
                      value_coded_min: bool = False) -> dict:
    """The grouped family's constexprs (kv_append_grp_kernel, decode_split_grp_kernel): key_bits is the
    mean width (a row is D * key_bits / 8 bytes)."""
    out = per_token_constants(D, key_bits, D, False, value_bits, group, value_symmetric, value_rotate, value_coded_min)
    for k in ("KEY_BITS", "KGROUP", "ROT_K"):
        del out[k]
    return dict(out, GT=group_tokens, KROW=D * key_bits // 8)  # bytes per key row, whole 32-bit words (KVSpec.check_geometry)


def grouped_decode_words(consts: dict) -> dict:
    """decode_split_grp_kernel's NW_PAD: the words of a tile row, the power of two (tl.arange's length) above the key
    row's NW = KROW // 4 (mean widths 4..7: 8, 10, 12, 14 words at head dim 64, 16, 20, 24, 28 at 128), and at least
    D / 4 (mean width 3, kv=wf3: 6 and 12 words read as 16 and 32): a code in the row's last word finds a masked-off 0
    as its second word. The words past the row are masked off (never read). Fewer words per tile row took more
    registers per thread (SASS audit, measured when introduced: at head dim 128 a 16-word row read as 16 words took 239
    against 177 read as 32, wf4; kv=wf3's rows of 12 and 6 words, read as 16 and 8, took 241 and 208 registers uncapped at
    head dims 128 and 64 against 178 and 139 read as 32 and 16, 2026-12-06)."""
    return {"NW_PAD": max(_pad(consts["KROW"] // 4 + 1), consts["D"] // 4)}


def _grouped_tables(kv: PackedKV) -> tuple[torch.Tensor, torch.Tensor]:
    return kv.key_bits_table.to(torch.int32).contiguous(), kv.key_bit_offsets.contiguous()


def append(kv: PackedKV, k_new: torch.Tensor, v_new: torch.Tensor, p: KeyParams) -> None:
    """Append one token per sequence (k_new, v_new: [B, H, D]) in place; lens += 1.
    The per-token family (kv.key_group > 0) reads no static key parameters (p may be None)."""
    B, H, D = k_new.shape
    if kv.grouped:
        kv_append_grp_kernel[(B, H)](
            k_new.contiguous(), v_new.contiguous(), kv.sink_k, kv.sink_v, kv.win_k, kv.win_v, kv.k_payload, *_grouped_tables(kv), kv.k_gscale, kv.k_gmin,
            kv.v_payload, kv.v_scale, kv.v_min, kv.lens, H, kv.k_payload.shape[2], kv.k_gscale.shape[2],
            NS=kv.n_sink, W=kv.window, **_packed_constants(kv, D), num_warps=plan.append_warps(False, True), num_stages=plan.STAGES,
        )
        kv.lens += 1
        return
    if kv.per_token:
        kv_append_rot_kernel[(B, H)](
            k_new.contiguous(), v_new.contiguous(), kv.sink_k, kv.sink_v, kv.win_k, kv.win_v, kv.k_payload, kv.k_scale,
            kv.v_payload, kv.v_scale, kv.v_min, kv.lens, H, kv.k_payload.shape[2],
            NS=kv.n_sink, W=kv.window, **_packed_constants(kv, D), num_warps=plan.append_warps(True, False), num_stages=plan.STAGES,
        )
        kv.lens += 1
        return
    scale, zero, _, idx = kernel_key_params(p, k_new.device)
    n_out = idx.shape[-1]
    kv_append_kernel[(B, H)](
        k_new.contiguous(), v_new.contiguous(), scale, zero, idx,
        kv.sink_k, kv.sink_v, kv.win_k, kv.win_v, kv.k_payload, kv.k_outliers, kv.v_payload, kv.v_scale, kv.v_min, kv.lens,
        H, kv.k_payload.shape[2],
        D=D, NS=kv.n_sink, W=kv.window, N_OUT=n_out, N_OUT_PAD=_pad(n_out),
        KEY_BITS=kv.key_bits, VAL_BITS=kv.value_bits, GROUP=kv.group, num_warps=plan.append_warps(False, False), num_stages=plan.STAGES,
    )
    kv.lens += 1


def decode_launch_params(G: int, n_sink: int, n_out: int, block_t: int, per_token: bool = False) -> dict:
    """Tile constexprs of a split kernel (decode_split_rot_kernel has no outlier channels)."""
    out = dict(G=G, G_PAD=_pad(G, MIN_DOT), NS_PAD=_pad(n_sink, MIN_DOT), N_OUT_PAD=_pad(n_out), BLOCK_T=block_t)
    if per_token:
        del out["N_OUT_PAD"]
    return out


def decode_attention(q: torch.Tensor, kv: PackedKV, p: KeyParams, sm_scale: float, splits: int | None = None, block_t: int | None = None,
                     prepared=None, num_warps: int | None = None, launched: list | None = None) -> torch.Tensor:
    """q: [B, HQ, D] one query per sequence -> [B, HQ, D] float32, over sinks + compressed + window.

    Tile sizes and the split count default to kvcompress.kernels.plan's choice for this shape.
    `prepared` = kernel_key_params(p, device), to keep that host work out of a timed loop.
    `launched`: a list the split kernel's launch handle is appended to (Triton's compiled kernel on a GPU, with its
    registers and shared memory: the benchmark's residency; None under the interpreter).
    """
    B, HQ, D = q.shape
    H = kv.sink_k.shape[1]
    warps = num_warps or plan.decode_warps(D, kv.per_token or kv.grouped)
    stages = plan.decode_stages(plan.device_arch(q.device), D, kv.grouped)  # as the AOT builds
    block_t = block_t or plan.block_t(D, kv.value_bits, warps, kv.key_group_tokens)
    if kv.grouped:  # a tile must lie in one key group
        block_t = min(block_t, kv.key_group_tokens)
        if kv.key_group_tokens % block_t:
            raise ValueError(f"block_t={block_t} must divide the key group ({kv.key_group_tokens} tokens)")
    if splits is None:
        n_comp = max(0, int(kv.lens.max()) - kv.n_sink - kv.window)
        tok = CacheFormat("", kv.key_bits, kv.value_bits, kv.group, kv.n_sink, kv.window, kv.k_outliers.shape[-1],
                          kv.key_group, kv.value_symmetric, coded_min=kv.value_coded_min).token_bytes(D)
        splits = plan.choose_splits(B, H, n_comp, HQ // H, D, tok, block_t)
    mo = torch.empty(B, HQ, splits, dtype=torch.float32, device=q.device)
    lo = torch.empty_like(mo)
    ao = torch.empty(B, HQ, splits, D, dtype=torch.float32, device=q.device)
    if kv.grouped:
        handle = decode_split_grp_kernel[(B, H, splits)](
            q.contiguous(), kv.sink_k, kv.sink_v, kv.win_k, kv.win_v, kv.k_payload, *_grouped_tables(kv), kv.k_gscale, kv.k_gmin,
            kv.v_payload, kv.v_scale, kv.v_min, kv.lens, mo, lo, ao, sm_scale, H, kv.k_payload.shape[2], kv.k_gscale.shape[2], splits,
            NS=kv.n_sink, W=kv.window, **(c := _packed_constants(kv, D)), **grouped_decode_words(c),
            **decode_launch_params(HQ // H, kv.n_sink, 0, block_t, per_token=True), num_warps=warps, num_stages=stages,
            **({"maxnreg": r} if (r := plan.decode_maxnreg(D, True, HQ // H)) else {}),
        )
        return _reduce(mo, lo, ao, splits, handle, launched)
    if kv.per_token:
        qr = ref.rotate(q, kv.key_how).contiguous()  # the query in the keys' basis, once per step
        handle = decode_split_rot_kernel[(B, H, splits)](
            q.contiguous(), qr, kv.sink_k, kv.sink_v, kv.win_k, kv.win_v, kv.k_payload, kv.k_scale, kv.v_payload, kv.v_scale, kv.v_min, kv.lens,
            mo, lo, ao, sm_scale, H, kv.k_payload.shape[2], splits,
            NS=kv.n_sink, W=kv.window, **_packed_constants(kv, D), **decode_launch_params(HQ // H, kv.n_sink, 0, block_t, per_token=True),
            num_warps=warps, num_stages=stages,
        )
        return _reduce(mo, lo, ao, splits, handle, launched)
    scale, _, zm, idx = prepared or kernel_key_params(p, q.device)
    handle = decode_split_kernel[(B, H, splits)](
        q.contiguous(), scale, zm, idx,
        kv.sink_k, kv.sink_v, kv.win_k, kv.win_v, kv.k_payload, kv.k_outliers, kv.v_payload, kv.v_scale, kv.v_min, kv.lens,
        mo, lo, ao, sm_scale, H, kv.k_payload.shape[2], splits,
        D=D, NS=kv.n_sink, W=kv.window, N_OUT=idx.shape[-1], KEY_BITS=kv.key_bits, VAL_BITS=kv.value_bits, GROUP=kv.group,
        **decode_launch_params(HQ // H, kv.n_sink, idx.shape[-1], block_t), num_warps=warps, num_stages=stages,
    )
    return _reduce(mo, lo, ao, splits, handle, launched)


def _reduce(mo: torch.Tensor, lo: torch.Tensor, ao: torch.Tensor, splits: int, handle=None, launched: list | None = None) -> torch.Tensor:
    if launched is not None:
        launched.append(handle)
    B, HQ, _, D = ao.shape
    out = torch.empty(B, HQ, D, dtype=torch.float32, device=ao.device)
    decode_reduce_kernel[(B * HQ,)](mo, lo, ao, out, splits, D=D, num_warps=plan.REDUCE_WARPS, num_stages=plan.STAGES)
    return out


def unpack_reference(kv: PackedKV, p: KeyParams, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence b's keys and values [H, n, D] float32, decoded with the reference numerics."""
    n = int(kv.lens[b])
    ns, nc, nw = ref.region_sizes(n, kv.n_sink, kv.window)
    ks = [kv.sink_k[b, :, :ns].float()]
    vs = [kv.sink_v[b, :, :ns].float()]
    if nc and kv.grouped:
        bits, GT = kv.key_bits_table.long().cpu(), kv.key_group_tokens
        ng = -(-nc // GT)
        codes = ref.unpack_key_codes(kv.k_payload[b, :, : ng * GT], bits)
        ks.append(ref.dequantize_keys_grouped(codes, kv.k_gscale[b, :, :ng], kv.k_gmin[b, :, :ng], GT)[:, :nc])
        v_parts = (kv.v_payload[b, :, :nc], kv.v_scale[b, :, :nc]) + (() if kv.value_symmetric else (kv.v_min[b, :, :nc],))
        vs.append(ref.decode_rotated(v_parts, kv.value_bits, kv.group, kv.value_symmetric, kv.value_how))
    elif nc and kv.per_token:
        ks.append(ref.decode_rotated((kv.k_payload[b, :, :nc], kv.k_scale[b, :, :nc]), kv.key_bits, kv.key_group, True, kv.key_how))
        v_parts = (kv.v_payload[b, :, :nc], kv.v_scale[b, :, :nc]) + (() if kv.value_symmetric else (kv.v_min[b, :, :nc],))
        vs.append(ref.decode_rotated(v_parts, kv.value_bits, kv.group, kv.value_symmetric, kv.value_how))
    elif nc and kv.key_bits == ref.FP16_BITS:  # an fp16 layer: the store holds the tokens
        ks.append(kv.k_payload[b, :, :nc].float())
        vs.append(kv.v_payload[b, :, :nc].float())
    elif nc:
        ks.append(ref.decode_keys(kv.k_payload[b, :, :nc], kv.k_outliers[b, :, :nc], p))
        vs.append(ref.decode_values(kv.v_payload[b, :, :nc], kv.v_scale[b, :, :nc], kv.v_min[b, :, :nc], kv.value_bits, kv.group))
    slots = [(pos - kv.n_sink) % kv.window for pos in range(ns + nc, n)] if kv.window else []
    if slots:
        ks.append(kv.win_k[b, :, slots].float())
        vs.append(kv.win_v[b, :, slots].float())
    return torch.cat(ks, 1), torch.cat(vs, 1)


def decode_attention_reference(q: torch.Tensor, kv: PackedKV, p: KeyParams, sm_scale: float) -> torch.Tensor:
    """What decode_attention must compute: softmax(q k_hat^T * scale) v_hat per sequence, float32."""
    B, HQ, D = q.shape
    out = torch.zeros(B, HQ, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        k, v = unpack_reference(kv, p, b)  # [H, n, D]
        if k.shape[1] == 0:
            continue
        g = HQ // k.shape[0]
        kk, vv = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        w = torch.softmax((q[b].float().unsqueeze(1) @ kk.transpose(1, 2)).squeeze(1) * sm_scale, -1)  # [HQ, n]
        out[b] = (w.unsqueeze(1) @ vv).squeeze(1)
    return out
