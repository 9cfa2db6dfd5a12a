"""The rotated, per-token formats (Hadamard rotation, symmetric or asymmetric per-token groups)."""
from __future__ import annotations

import functools

import torch

from kvcompress.reference.codes import key_qmax, round_half_even, round_outward_fp16
from kvcompress.reference.keys import load_signed, store_signed
from kvcompress.reference.values import decode_values, encode_values


# ---------------------------------------------------------------- rotated, per-token formats (CompressedCache, validate, the Triton kernels)
def hadamard_signs(n: int, device=None) -> torch.Tensor:
    """The Sylvester-Hadamard sign matrix [n, n] (n a power of two), float32 entries
    (-1)**popcount(i & j): symmetric, S @ S = n I. The kernels build the same signs in registers.
    A new tensor on every call (rotate reads a shared copy, _signs)."""
    return _signs(n, str(torch.device(device or "cpu"))).clone()


@functools.lru_cache(maxsize=32)
def _signs(n: int, device: str) -> torch.Tensor:
    """hadamard_signs built once per size and device: rotate runs on every stored token of every layer (CompressedCache
    encodes and decodes through it at each generation step), and building the matrix cost more than the product.
    Shared: never modified in place."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two size; got {n}")
    i = torch.arange(n)
    x = i[:, None] & i[None, :]
    parity = torch.zeros_like(x)
    while bool(x.any()):
        parity ^= x & 1
        x = x >> 1
    return (1 - 2 * parity).float().to(device)


def hadamard(n: int, device=None) -> torch.Tensor:
    """The normalised Hadamard matrix S / sqrt(n): symmetric and orthogonal (H @ H = I), so x @ H
    rotates a head's vector and (x @ H) @ H gives it back; q.k is unchanged when both sides are rotated."""
    return hadamard_signs(n, device) * n**-0.5


def hadamard_block(n: int) -> int:
    """The size of the Hadamard blocks that rotate a head of n channels: n for a power of two, else n's largest
    power-of-two divisor (96 -> 32). The block-diagonal matrix is orthogonal and symmetric too, so the values'
    rotation folds into W_v/W_o for any even head_dim (KVSpec.check_geometry); keys (rotated in the kernels,
    with the query) and values rotated in the kernels need a power of two."""
    return n & -n


def rotate(x: torch.Tensor, how: str) -> torch.Tensor:
    """x [..., D] in the rotated basis ('hadamard': x @ H, float32) or unchanged ('none'). Its own inverse.
    Computed as (x @ S) * D**-0.5 with S the +-1 signs: the sums are of +-x (exact for fp16 inputs of
    moderate range, so any summation order agrees) and one rounding scales them, as in the kernels.
    A D that is not a power of two is rotated in blocks of hadamard_block(D) channels."""
    if how == "none":
        return x
    if how == "hadamard":
        D = x.shape[-1]
        b = hadamard_block(D)
        if b == D:
            return (x.float() @ _signs(D, str(x.device))) * D**-0.5
        return ((x.float().unflatten(-1, (D // b, b)) @ _signs(b, str(x.device))) * b**-0.5).flatten(-2)
    raise ValueError(f"unknown rotation {how!r}; allowed: none, hadamard")


def quantize_token_symmetric(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, per group of `group` channels, symmetric: scale = amax / Q (fp16, rounded up so
    nothing clips), q = clamp(round_half_even(x / scale), -Q, Q), Q = 2**(bits-1) - 1.
    x: [..., T, D] -> (int8 codes [..., T, D], fp16 scale [..., T, D // group])."""
    xg = x.float().unflatten(-1, (-1, group))
    scale = round_outward_fp16(xg.abs().amax(-1) / key_qmax(bits), float("inf"))
    s = torch.where(scale == 0, torch.ones_like(scale), scale).float().unsqueeze(-1)
    q = round_half_even(xg / s).clamp_(-key_qmax(bits), key_qmax(bits))
    return q.flatten(-2).to(torch.int8), scale


def dequantize_token_symmetric(codes: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    return (codes.float().unflatten(-1, (-1, group)) * scale.float().unsqueeze(-1)).flatten(-2)


def encode_rotated(x: torch.Tensor, bits: int, group: int, symmetric: bool, how: str, coded_min: bool = False) -> tuple[torch.Tensor, ...]:
    """Storage form of a per-token format in a rotated basis: x [..., T, D] -> symmetric: (payload, scale);
    asymmetric: (payload, scale, min) (encode_values; coded_min: the min a uint8 code).
    int4 payloads are packed (signed codes offset-binary, q + 8)."""
    xr = rotate(x, how)
    if not symmetric:
        return encode_values(xr.float(), bits, group, coded_min)
    q, scale = quantize_token_symmetric(xr, bits, group)
    return store_signed(q, bits), scale


def decode_rotated(stored: tuple[torch.Tensor, ...], bits: int, group: int, symmetric: bool, how: str) -> torch.Tensor:
    """encode_rotated's inverse up to the rounding: dequantize, then rotate back (float32)."""
    if not symmetric:
        return rotate(decode_values(*stored, bits, group), how)
    payload, scale = stored
    return rotate(dequantize_token_symmetric(load_signed(payload, bits), scale, group), how)


def fake_quant_rotated(x: torch.Tensor, bits: int, group: int, symmetric: bool, how: str, coded_min: bool = False) -> torch.Tensor:
    """A per-token format in a rotated basis: rotate, quantize per token and group (symmetric, or the
    asymmetric value quantizer), rotate back; in x's dtype. Keys: q.k_hat = (q H).(quantized k H)."""
    return decode_rotated(encode_rotated(x, bits, group, symmetric, how, coded_min), bits, group, symmetric, how).to(x.dtype)
