"""TensorRT-LLM's native KV formats (INT8, FP8, NVFP4 with per-layer scales), the fold's pair rotation."""
from __future__ import annotations

import torch

from kvcompress.reference.codes import round_half_even

# ---------------------------------------------------------------- TensorRT-LLM's native KV formats
NATIVE_QMAX = {"native_int8": 127.0, "native_fp8": 448.0, "native_nvfp4": 448.0}  # per-layer scale = amax / qmax
NVFP4_BLOCK = 16
E2M1_MAX = 6.0
E2M1_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """Round to FP4 e2m1 {0, 0.5, 1, 1.5, 2, 3, 4, 6} (sign kept), ties to even, saturating at 6."""
    a = y.abs()
    idx = torch.searchsorted(E2M1_BOUNDS.to(a.device), a.contiguous())
    idx = idx + (a.unsqueeze(-1) == E2M1_BOUNDS.to(a.device)[[1, 3, 5]]).any(-1).long()  # 0.75, 1.75, 3.5 round up to even
    return torch.where(y < 0, -1.0, 1.0) * E2M1_VALUES.to(a.device)[idx]


def nvfp4_fake_quant(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """TensorRT-LLM's NVFP4 KV cache, with the semantics of NVIDIA Model Optimizer 0.47 (its
    NVFP4 KV config: e2m1 values, dynamic per-16-element blocks along the head dim, FP8 e4m3 block
    scales; NVFP4QTensor.quantize/dequantize): global scale s2 = scale / 6 with the per-layer
    scale = amax / 448 (ModelOpt exports the KV scale as amax / 448 for NVFP4 as for FP8); block
    scale sb = e4m3(clamp(block_amax / (6 * s2), 2^-9, 448)) (1 for an all-zero block);
    x_hat = e2m1_round(x / (sb * s2)) * sb * s2. x: [..., D], D a multiple of 16."""
    s2 = torch.as_tensor(scale, dtype=torch.float32, device=x.device) / E2M1_MAX
    xb = x.float().unflatten(-1, (-1, NVFP4_BLOCK))  # [..., D/16, 16]
    sb = xb.abs().amax(-1, keepdim=True) / (E2M1_MAX * s2)
    sb = torch.where(sb == 0, torch.ones_like(sb), sb).clamp(2.0**-9, 448.0).to(torch.float8_e4m3fn).float()
    q = e2m1_round(xb / (sb * s2))
    return (q * (sb * s2)).flatten(-2).to(x.dtype)


def native_fake_quant(x: torch.Tensor, scale: float | torch.Tensor, fmt: str) -> torch.Tensor:
    """TensorRT-LLM's per-tensor KV cache: one dequant scale s per layer (kv_cache_scaling_factor).

    native_int8: q = clamp(round_half_even(x / s), -127, 127) (s = amax / 127, as its converter sets);
    native_fp8:  q = float8_e4m3fn(clamp(x / s, -448, 448)) (s = amax / 448);  x_hat = q * s;
    native_nvfp4: per-16-element FP4 blocks under the global scale s / 6 (nvfp4_fake_quant).
    """
    if fmt == "native_nvfp4":
        return nvfp4_fake_quant(x, scale)
    xf = x.float() / scale
    if fmt == "native_int8":
        q = round_half_even(xf).clamp_(-127, 127)
    elif fmt == "native_fp8":
        q = xf.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    else:
        raise ValueError(f"unknown native format {fmt!r}; allowed: {', '.join(NATIVE_QMAX)}")
    return (q * scale).to(x.dtype)


def pair_rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate each RoPE pair (x_d, x_{d+D/2}) of x [..., D] by angles [..., D/2] (radians, broadcast):
    (a, b) -> (a cos t - b sin t, a sin t + b cos t). Planar rotations commute, so this commutes with
    RoPE (which rotates the same pairs by position-dependent angles): folded into W_q and W_k it
    leaves every q.k unchanged. pair_rotate(x, -angles) undoes it. Float32 math (float64 for float64
    x), x's dtype out."""
    D = x.shape[-1]
    dt = torch.promote_types(x.dtype, torch.float32)
    a, b = x[..., : D // 2].to(dt), x[..., D // 2 :].to(dt)
    c, s = angles.cos().to(dt), angles.sin().to(dt)
    return torch.cat([a * c - b * s, a * s + b * c], -1).to(x.dtype)


def native_folded_quant(x: torch.Tensor, fold: torch.Tensor, scale: float | torch.Tensor, fmt: str, angles: torch.Tensor | None = None) -> torch.Tensor:
    """What a folded native checkpoint caches, mapped back to the unfolded model: y = R x / fold,
    x_hat = R^-1 (fold * Q(y)), Q = native_fake_quant, R = pair_rotate by `angles` (keys of
    native_fp8 with kv.fold_pairs; None: no rotation). fold, angles broadcast against x."""
    y = x if angles is None else pair_rotate(x, angles)
    out = native_fake_quant(y / fold, scale, fmt) * fold
    return (out if angles is None else pair_rotate(out, -angles)).to(x.dtype)


def native_folded_saturated(x: torch.Tensor, fold: torch.Tensor, scale: float | torch.Tensor, fmt: str, angles: torch.Tensor | None = None) -> torch.Tensor:
    """native_saturated of what the folded checkpoint caches (native_folded_quant's y)."""
    y = x if angles is None else pair_rotate(x, angles)
    return native_saturated(y / fold, scale, fmt)


def native_saturated(x: torch.Tensor, scale: float | torch.Tensor, fmt: str) -> torch.Tensor:
    """Bool mask of elements that TensorRT-LLM's per-tensor quantizer saturates (clamps). NVFP4: an
    element beyond 448 * scale lies in a block whose FP8 block scale clamps at 448 (the global range)."""
    z = (x.float() / scale).abs()
    return z > 127.5 if fmt == "native_int8" else z > NATIVE_QMAX[fmt]
