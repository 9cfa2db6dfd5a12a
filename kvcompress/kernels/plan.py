"""The decode kernel's tile sizes and split heuristic, chosen from the bytes model (one place).

Tiles (per kv format and head dim, fixed at compile time):
  * warps: 4 for head dim <= 64, else 8 (a [BLOCK_T, D] tile per iteration; 8 warps keep the
    fp32 accumulator of G <= 16 query rows x 128 channels in registers without spills); the
    per-token family (decode_split_rot_kernel) always 4: its Walsh-Hadamard butterfly on the
    accumulator needs a stack frame at head dim 128 with 8 warps (ptxas), none with 4, and 4 warps x
    127 registers still fit 4 CTAs (16 warps) per SM, as many warps as 2 CTAs of 8.
  * BLOCK_T: tokens per main-loop iteration, so that every thread's share of the narrowest packed
    payload row block (the values: BLOCK_T * D * value_bits / 8 bytes) is one 128-bit load:
    BLOCK_T = 16 B * threads / (D * value_bits / 8), at least 32 (tl.dot's minimum of 16, and
    one warp's rows), at most 128. E.g. D=128 int4 values, 8 warps: 64; D=64, 4 warps: 64.
Splits (per launch, a runtime argument; flash-decoding's split-K over the compressed store):
  * fill: enough programs (batch x kv heads x splits) for CTAS_PER_SM resident CTAs on every SM
    of the target GPU (132 on H100/H200): a decode step at batch 1 has only n_kv_heads programs;
  * traffic: each split writes G * (D + 2) fp32 partials that the reduce kernel reads back; they
    stay below MAX_PARTIAL_FRAC of the payload a kv head reads (so modelled bytes stay within a few
    percent of the format's byte accounting);
  * never more splits than main-loop blocks, never fewer than 1.
"""
from __future__ import annotations

import math

PAYLOAD_LOAD_BYTES = 16  # one 128-bit load per thread per payload row block
MIN_BLOCK_T, MAX_BLOCK_T = 32, 128
CTAS_PER_SM = 2  # target resident decode CTAs per SM (the audit checks the compiled kernels reach it)
MAX_PARTIAL_FRAC = 0.05  # split partial traffic (write + read) <= 5% of the kv head's payload
MAX_SPLITS = 64
SM_COUNT = {"H100": 132, "H200": 132, "A100": 108}
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.04e12}  # bytes/s, published HBM peak


def decode_warps(head_dim: int, per_token: bool = False) -> int:
    return 4 if head_dim <= 64 or per_token else 8


GROUPED_BLOCK_T_D128 = 16  # the grouped family at head dim >= 128 (see block_t)
GROUPED_MAXNREG_D128 = 168  # see decode_maxnreg


def decode_maxnreg(head_dim: int, grouped: bool = False, gqa: int = 1) -> int | None:
    """The register cap of a decode kernel (Triton's maxnreg; None: ptxas's choice). The grouped family at head dim
    128 with at most 16 query heads per kv head: 168 per thread, so 3 CTAs of 4 warps fit an SM's 65536 registers
    (65536 / (128 x 168) = 3.05); left to itself ptxas takes ~178 (2 CTAs), and at 168 it spills nothing (the SASS
    audit checks both, tests/test_kernel_audit.py). Above 16 query heads (a 32-row query tile) or at head dim 256 it would
    spill: no cap there.
    8 warps capped at 128 would also fit without spills (2 CTAs, 16 warps), but a 16-token tile then gives each thread 4
    bytes of values (32-bit loads) and an SM holds 2 tiles in flight instead of 3; 32-token tiles spill at that cap.
    3-bit values (kv=wf3) fit the same cap without spills since their plane slots are split apart in registers
    (triton_codes.load_codes; summed, they spilled at 168 and took ~255 registers uncapped, 2 CTAs per SM)."""
    return GROUPED_MAXNREG_D128 if grouped and head_dim == 128 and gqa <= 16 else None


STAGES = 2  # num_stages of every kernel but decode_stages' exceptions
APPEND_WARPS = {"static": 2, "per_token": 2, "grouped": 4}  # kv_append / kv_append_rot / kv_append_grp
REDUCE_WARPS = 1  # decode_reduce_kernel: one query row per program, D lanes


def append_warps(per_token: bool, grouped: bool) -> int:
    """num_warps of a family's append kernel, the same in the AOT builds and the JIT launches (kvcompress.kernels.ops)."""
    return APPEND_WARPS["grouped" if grouped else "per_token" if per_token else "static"]


def decode_stages(arch: str, head_dim: int, grouped: bool = False) -> int:
    """Software-pipelining stages of a decode kernel's main loop (Triton's num_stages), the same in the AOT builds and the
    JIT launches (kvcompress.kernels.ops): 2, except the grouped family at head dim <= 64 on sm_80, where 3 stages took 168
    registers without spills against 244 (wf4) and 255 (wf3) with 2: 3 CTAs (12 warps) per SM instead of 2 (SASS audit,
    2026-12-06). Elsewhere 3 stages bought no registers (sm_90's static int4 decode spilled with them) and doubled the
    shared memory."""
    return 3 if arch == "sm_80" and grouped and head_dim <= 64 else STAGES


def device_arch(device) -> str:
    """"sm_<major><minor>" of a CUDA device (decode_stages' arch); "cpu" elsewhere (the interpreter ignores stages)."""
    import torch

    if getattr(device, "type", str(device)) != "cuda":
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def block_t(head_dim: int, value_bits: int, warps: int | None = None, group_tokens: int = 0) -> int:
    """Tokens per main-loop iteration (see the module docstring). The grouped family (group_tokens > 0):
    a tile lies in one key group, and at head dim >= 128 a tile is 16 tokens (at head dim 128 a 32-token tile needs ~226
    registers, 2 CTAs of 4 warps per SM, or spills under decode_maxnreg's 168; a 16-token tile fits 168 without spills)."""
    threads = 32 * (warps or decode_warps(head_dim))
    row = head_dim * value_bits // 8
    t = PAYLOAD_LOAD_BYTES * threads // max(row, 1)
    t = max(MIN_BLOCK_T, min(MAX_BLOCK_T, 1 << (t.bit_length() - 1)))
    if group_tokens:
        t = min(t, group_tokens, GROUPED_BLOCK_T_D128 if head_dim >= 128 else t)
    return t


def partial_bytes_per_split(gqa: int, head_dim: int) -> int:
    """Bytes one split of one kv head adds: (max, sum, acc[D]) fp32 per query row, written then read."""
    return 2 * gqa * (head_dim + 2) * 4


def choose_splits(batch: int, n_kv_heads: int, n_comp: int, gqa: int, head_dim: int, token_bytes: float,
                  block: int, sm_count: int = 132, ctas_per_sm: int = CTAS_PER_SM) -> int:
    """Split count of one decode launch (see the module docstring). token_bytes: bytes a compressed
    token of one kv head occupies (payload + metadata)."""
    fill = math.ceil(sm_count * ctas_per_sm / max(1, batch * n_kv_heads))
    traffic = math.floor(MAX_PARTIAL_FRAC * n_comp * token_bytes / partial_bytes_per_split(gqa, head_dim))
    blocks = math.ceil(n_comp / block)
    return max(1, min(fill, traffic, blocks, MAX_SPLITS))
