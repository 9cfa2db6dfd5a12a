"""Triton kernels against the reference numerics (interpreter on CPU, native on a GPU)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from kvcompress import reference as ref
from kvcompress.kernels import ops
from kvcompress.kernels.layout import PackedKV
from kvcompress.reference import KeyParams, key_qmax

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
W = 16  # window used by these tests; lengths below cross it
# Decode attention runs its dots on fp16 inputs (q * s_k, probabilities, dequantized values:
# relative rounding 2^-11 each) with fp32 accumulation; outputs are O(1): 3e-3 covers that.
DECODE_TOL = dict(atol=3e-3, rtol=3e-3)


def make_params(H, D, key_bits, n_out, ks, asym=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    absmax = torch.stack([k.abs().amax(1) for k in ks]).amax(0)  # [H, D]
    zero = (torch.rand(H, D, generator=g) - 0.5) * 0.2 if asym else torch.zeros(H, D)
    scale = 0.9 * (absmax + zero.abs()) / key_qmax(key_bits)  # 0.9: some values clip, as after an MSE fit
    idx = torch.stack([torch.randperm(D, generator=g)[:n_out].sort().values for _ in range(H)]) if n_out else torch.zeros(H, 0, dtype=torch.long)
    return KeyParams(key_bits, scale, zero, idx)


def make_seqs(lens, H, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    ks = [torch.randn(H, n, D, generator=g) * 2 for n in lens]
    for k in ks:
        if k.shape[1]:
            k[:, :, 3] *= 8  # an outlier-like channel
    vs = [torch.randn(H, n, D, generator=g) for n in lens]
    return ks, vs


DECODE_CASES = [
    # lens (a batch of mixed lengths), H_kv, GQA, D, key bits, value bits, group, outliers, sinks
    ([1, 7, W - 1, W, W + 1], 2, 3, 64, 8, 4, 32, 0, 4),
    ([1, 7, W - 1, W, W + 1], 2, 3, 64, 8, 4, 32, 2, 0),
    ([1170, 5], 1, 8, 128, 8, 4, 32, 0, 4),
    ([1170], 2, 1, 128, 4, 4, 32, 2, 4),
    ([3001, 40], 1, 8, 128, 8, 4, 32, 0, 4),
    ([300, 21], 3, 1, 64, 8, 8, 64, 0, 0),
    ([W + 1, 2 * W + 3], 1, 8, 64, 4, 8, 64, 1, 2),
]


@pytest.mark.parametrize("lens,H,G,D,kb,vb,group,n_out,n_sink", DECODE_CASES)
def test_decode_attention_matches_reference(lens, H, G, D, kb, vb, group, n_out, n_sink):
    ks, vs = make_seqs(lens, H, D)
    p = make_params(H, D, kb, n_out, ks)
    kv = PackedKV.from_reference(ks, vs, p, n_sink=n_sink, window=W, value_bits=vb, group=group)
    kv = _to(kv, DEVICE)
    q = torch.randn(len(lens), H * G, D, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    out = ops.decode_attention(q, kv, p, D**-0.5, splits=4, block_t=32)
    torch.testing.assert_close(out, ops.decode_attention_reference(q, kv, p, D**-0.5), **DECODE_TOL)


@pytest.mark.parametrize("lens,H,G,D,kb,vb,group,n_out,n_sink", [DECODE_CASES[i] for i in (0, 3, 4, 6)])
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_decode_with_the_plans_tiles_and_any_split_count(lens, H, G, D, kb, vb, group, n_out, n_sink, splits):
    """What ships: kvcompress.kernels.plan's BLOCK_T and warps, the heuristic's split count (None)
    or any other (the split count is a launch argument), against the reference."""
    ks, vs = make_seqs(lens, H, D, seed=3)
    p = make_params(H, D, kb, n_out, ks)
    kv = _to(PackedKV.from_reference(ks, vs, p, n_sink=n_sink, window=W, value_bits=vb, group=group), DEVICE)
    q = torch.randn(len(lens), H * G, D, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    torch.testing.assert_close(ops.decode_attention(q, kv, p, D**-0.5, splits=splits), ops.decode_attention_reference(q, kv, p, D**-0.5), **DECODE_TOL)


def test_decode_asymmetric_keys_fold_the_zero_point():
    lens, H, D = [100, 33], 2, 64
    ks, vs = make_seqs(lens, H, D)
    p = make_params(H, D, 8, 2, ks, asym=True)
    kv = _to(PackedKV.from_reference(ks, vs, p, n_sink=4, window=W, value_bits=4, group=32), DEVICE)
    q = torch.randn(2, H * 3, D).to(DEVICE)
    torch.testing.assert_close(ops.decode_attention(q, kv, p, 0.125, splits=3), ops.decode_attention_reference(q, kv, p, 0.125), **DECODE_TOL)


def test_decode_never_reads_a_wrong_region():
    """Guard: zeroing the compressed payload must change the output (the kernel reads it)."""
    ks, vs = make_seqs([200], 1, 64)
    p = make_params(1, 64, 8, 0, ks)
    kv = _to(PackedKV.from_reference(ks, vs, p, n_sink=4, window=W, value_bits=4, group=32), DEVICE)
    q = torch.randn(1, 3, 64).to(DEVICE)
    before = ops.decode_attention(q, kv, p, 0.125)
    kv.v_payload.zero_()
    assert (ops.decode_attention(q, kv, p, 0.125) - before).abs().max() > 1e-2


APPEND_CASES = [
    # key bits, value bits, group, window, sinks, outliers, asymmetric keys
    (8, 4, 32, W, 4, 0, False),
    (4, 4, 32, W, 0, 2, False),
    (8, 8, 64, 0, 4, 2, True),
    (4, 8, 64, 1, 2, 1, False),
]


@pytest.mark.parametrize("kb,vb,group,window,n_sink,n_out,asym", APPEND_CASES)
def test_append_is_bit_exact_with_the_reference(kb, vb, group, window, n_sink, n_out, asym):
    """Token-by-token appends produce the same bytes as the reference encoder, for mixed lengths."""
    H, D, lens = 2, 64, [45, 3, 20]
    ks, vs = make_seqs(lens, H, D, seed=2)
    p = make_params(H, D, kb, n_out, ks, asym=asym)
    _append_all_equals_reference(ks, vs, p, ("k_outliers",), n_sink=n_sink, window=window, kb=kb, vb=vb, group=group, n_out=n_out, append_p=p)


@pytest.mark.parametrize("lens,H,G,D,n_sink,window", [([1, 7, 40, 150], 2, 3, 64, 4, W), ([300, 21], 1, 8, 128, 0, 0), ([W + 3, 90], 1, 3, 64, 0, W)])
def test_fp16_store_decode_and_append_match_the_reference(lens, H, G, D, n_sink, window):
    """An fp16 layer of a per-layer format in the static kernels (key_bits = value_bits = 16, the spec's sinks and window):
    appends store every token's fp16 K and V bit-exactly, and decode attends them as the reference does, which is
    plain softmax attention over the fp16 tokens (checked independently)."""
    ks, vs = make_seqs(lens, H, D, seed=5)
    p = ref.fp16_key_params(H, D)
    kw = dict(n_sink=n_sink, window=window, value_bits=16, group=D)
    kv = _to(PackedKV.from_reference(ks, vs, p, **kw), DEVICE)
    assert kv.k_payload.dtype == kv.v_payload.dtype == torch.float16 and kv.k_payload.shape[-1] == D
    q = torch.randn(len(lens), H * G, D, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    want = ops.decode_attention_reference(q, kv, p, D**-0.5)
    exact = torch.stack([torch.softmax((q[b].float().view(H, G, D) @ ks[b].half().float().transpose(1, 2)) * D**-0.5, -1).flatten(0, 1).unsqueeze(1)
                         .bmm(vs[b].half().float().repeat_interleave(G, 0)).squeeze(1) for b in range(len(lens))])
    torch.testing.assert_close(want, exact.to(want.device), atol=1e-5, rtol=1e-5)  # the reference reads the fp16 tokens themselves
    for splits in (None, 1, 5):
        torch.testing.assert_close(ops.decode_attention(q, kv, p, D**-0.5, splits=splits), want, **DECODE_TOL)
    T = max(lens)
    full_k = [torch.cat([k, k[:, -1:].expand(H, T - k.shape[1], D)], 1) for k in ks]
    full_v = [torch.cat([v, v[:, -1:].expand(H, T - v.shape[1], D)], 1) for v in vs]
    app = _to(PackedKV.empty(len(lens), H, D, T, n_out=0, key_bits=16, **kw), DEVICE)
    for t in range(T):
        ops.append(app, torch.stack([k[:, t] for k in full_k]).to(DEVICE), torch.stack([v[:, t] for v in full_v]).to(DEVICE), p)
    expect = PackedKV.from_reference(full_k, full_v, p, cap=T, **kw)
    for name in ("k_payload", "v_payload", "lens"):
        assert torch.equal(getattr(app, name).cpu(), getattr(expect, name)), name
    with pytest.raises(ValueError, match="an fp16 store"):
        PackedKV.empty(1, H, D, 8, n_sink=4, window=0, n_out=2, key_bits=16, value_bits=16, group=D)


# the per-token family (kv.key.granularity=token): kv=rot4 and its neighbours. Only KeyParams.bits is read.
ROT4 = dict(key_group=64, key_rotate=True, value_symmetric=True, value_rotate=True)
PER_TOKEN_CASES = [
    # lens, H_kv, GQA, D, key bits, value bits, value group, family, sinks
    ([1, 7, W - 1, W, W + 1, 150], 2, 3, 64, 4, 4, 64, ROT4, 4),  # kv=rot4 at SmolLM2's head dim
    ([300, 21], 1, 8, 128, 4, 4, 128, dict(ROT4, key_group=128), 4),  # kv=rot4 at Llama's head dim
    ([90, 33], 2, 1, 64, 8, 8, 32, dict(key_group=32, value_symmetric=True), 0),  # grouped key scales, int8, unrotated
    ([90], 1, 3, 64, 4, 4, 32, dict(key_group=64, key_rotate=False, value_rotate=True), 2),  # asymmetric rotated values
    ([W + 2, 140], 1, 3, 64, 8, 4, 32, dict(key_group=64, key_rotate=True, value_rotate=True), 4),  # rotated per-token int8 keys, int4 values
    ([W + 2, 140], 1, 3, 64, 8, 4, 16, dict(key_group=64, key_rotate=True, value_rotate=True, value_coded_min=True), 4),  # kv=rot8k_int4v (coded min)
    ([W + 2, 140], 1, 3, 64, 7, 5, 32, ROT7K5V := dict(key_group=64, key_rotate=True, value_rotate=True, value_coded_min=True), 4),  # kv=rot7k_int5v
    ([200, 37], 1, 8, 128, 7, 5, 32, dict(ROT7K5V, key_group=128), 4),  # kv=rot7k_int5v at Llama's head dim
    ([90, 33], 2, 1, 64, 6, 6, 16, dict(key_group=32, value_symmetric=True), 0),  # 6-bit planes, symmetric values, grouped key scales
]


def token_params(bits: int, H: int) -> KeyParams:
    return KeyParams(bits, torch.zeros(H, 0), torch.zeros(H, 0), torch.zeros(H, 0, dtype=torch.long))


@pytest.mark.parametrize("lens,H,G,D,kb,vb,group,fam,n_sink", PER_TOKEN_CASES)
def test_per_token_decode_matches_reference(lens, H, G, D, kb, vb, group, fam, n_sink):
    """decode_split_rot_kernel (rotated query, per-token key scales, values rotated back once per
    split) against softmax(q k_hat^T) v_hat with k_hat, v_hat decoded by reference.decode_rotated."""
    ks, vs = make_seqs(lens, H, D, seed=5)
    p = token_params(kb, H)
    kv = _to(PackedKV.from_reference(ks, vs, p, n_sink=n_sink, window=W, value_bits=vb, group=group, **fam), DEVICE)
    q = torch.randn(len(lens), H * G, D, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    for splits in (1, 3):
        torch.testing.assert_close(ops.decode_attention(q, kv, p, D**-0.5, splits=splits, block_t=32), ops.decode_attention_reference(q, kv, p, D**-0.5), **DECODE_TOL)


def test_per_token_decode_reads_the_rotated_store():
    """Guards: the kernel must rotate the query (a cache written without key rotation but read as
    rotated gives a different answer) and must read the per-token key scales."""
    ks, vs = make_seqs([120], 1, 64, seed=7)
    p = token_params(4, 1)
    kv = _to(PackedKV.from_reference(ks, vs, p, n_sink=4, window=W, value_bits=4, group=64, **ROT4), DEVICE)
    q = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    good = ops.decode_attention(q, kv, p, 0.125)
    kv.key_rotate = False
    assert (ops.decode_attention(q, kv, p, 0.125) - good).abs().max() > 1e-2
    kv.key_rotate = True
    kv.k_scale.mul_(2)
    assert (ops.decode_attention(q, kv, p, 0.125) - good).abs().max() > 1e-2


@pytest.mark.parametrize("kb,vb,group,window,n_sink,fam", [
    (4, 4, 64, W, 4, ROT4),
    (8, 8, 32, 0, 2, dict(key_group=32, key_rotate=True, value_symmetric=True)),
    (4, 4, 32, 1, 0, dict(key_group=64, value_rotate=True)),
    (8, 4, 32, W, 4, dict(key_group=64, key_rotate=True, value_rotate=True)),
    (8, 4, 16, W, 4, dict(key_group=64, key_rotate=True, value_rotate=True, value_coded_min=True)),  # kv=rot8k_int4v (coded min)
    (4, 8, 32, 1, 0, dict(key_group=64, value_coded_min=True)),  # coded min of 8-bit values, unrotated
    (7, 5, 32, W, 4, ROT7K5V),  # kv=rot7k_int5v: nibble + bit planes, coded min with step 8
    (5, 7, 16, 1, 0, dict(key_group=32, value_coded_min=True)),
    (6, 6, 32, 0, 2, dict(key_group=64, key_rotate=True, value_symmetric=True)),
])
def test_per_token_append_is_bit_exact_with_the_reference(kb, vb, group, window, n_sink, fam):
    """kv_append_rot_kernel: rotation as sums of +-x then one scaling (reference.rotate's order), fp16
    scales rounded up, round-half-even codes: the same bytes as PackedKV.from_reference."""
    H, D, lens = 2, 64, [45, 3, 20]
    ks, vs = make_seqs(lens, H, D, seed=9)
    p = token_params(kb, H)
    _append_all_equals_reference(ks, vs, p, ("k_scale",), n_sink=n_sink, window=window, kb=kb, vb=vb, group=group, **fam)


# the grouped family (kv.key.group_tokens): kv=wf4 (water-filled widths, rotated symmetric values) and kv=kivi_int4's keys
def wf_table(H: int, D: int, seed: int = 0, mean: int = 4) -> torch.Tensor:
    """Per-channel widths as kv.key.alloc=waterfill gives them: 1..8 bits, RoPE pairs alike, the given mean (most codes straddle bytes)."""
    w = torch.rand(H, D, generator=torch.Generator().manual_seed(seed)) ** 8 * 1e4
    t = ref.waterfill_bits(w, mean)
    assert int(t.min()) < mean - 1 and int(t.max()) > mean + 1 and bool((t.sum(-1) == mean * D).all())
    return t


WF4 = dict(value_symmetric=True, value_rotate=True)
GROUPED_CASES = [
    # lens, H_kv, GQA, D, key bits (the mean), value bits, value group, value options, sinks, key group (tokens), water-filled widths
    ([1, 20, 40, 41, 150], 2, 3, 64, 4, 4, 64, WF4, 4, 32, True),  # kv=wf4 at SmolLM2's head dim
    ([300, 45], 1, 8, 128, 4, 4, 128, WF4, 4, 32, True),  # kv=wf4 at Llama's head dim
    ([200, 33], 2, 1, 64, 4, 4, 32, {}, 0, 32, False),  # kv=kivi_int4: uniform 4-bit keys, asymmetric values
    ([170], 1, 3, 64, 4, 4, 16, dict(value_rotate=True, value_coded_min=True), 2, 16, True),  # coded-min values, groups of 16
    # kv=wf5 / kv=wf6: rows of 10 and 24 words read as 16 and 32 (the rest masked), 5- and 6-bit values in bit planes
    ([150, 41], 2, 3, 64, 5, 5, 64, WF4, 4, 32, True),
    ([200, 7], 1, 8, 128, 6, 6, 128, WF4, 4, 32, True),
    # kv=wf3: rows of 6 and 12 words at a mean of 3 bits, 3-bit values as three bit planes alone
    ([150, 41], 2, 3, 64, 3, 3, 64, WF4, 4, 32, True),
    ([200, 7], 1, 8, 128, 3, 3, 128, WF4, 4, 32, True),
    # uniform 7-bit token-grouped keys (allowed beside uniform allocation): 14 words read as 16, 7-bit values
    ([90, 33], 1, 3, 64, 7, 7, 64, WF4, 4, 32, False),
]


@pytest.mark.parametrize("lens,H,G,D,kb,vb,group,fam,n_sink,gt,wf", GROUPED_CASES)
def test_grouped_decode_matches_reference(lens, H, G, D, kb, vb, group, fam, n_sink, gt, wf):
    """decode_split_grp_kernel (a tile's group scale folded into the query, its min into a constant, codes cut
    from the bitstream) against softmax(q k_hat^T) v_hat with k_hat decoded by reference.unpack_bits and
    dequantize_keys_grouped."""
    ks, vs = make_seqs(lens, H, D, seed=11)
    p = token_params(kb, H)
    table = wf_table(H, D, mean=kb) if wf else None
    kv = _to(PackedKV.from_reference(ks, vs, p, n_sink=n_sink, window=32, value_bits=vb, group=group, key_group_tokens=gt, key_bits_table=table, **fam), DEVICE)
    q = torch.randn(len(lens), H * G, D, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    want = ops.decode_attention_reference(q, kv, p, D**-0.5)
    for splits, bt in ((1, 16), (3, 32), (None, None)):
        torch.testing.assert_close(ops.decode_attention(q, kv, p, D**-0.5, splits=splits, block_t=bt), want, **DECODE_TOL)


def test_grouped_decode_reads_the_widths_and_the_group_scales():
    """Guards: a wrong width table, or group scales read from the wrong group, change the answer."""
    ks, vs = make_seqs([150], 1, 64, seed=13)
    p = token_params(4, 1)
    table = wf_table(1, 64, seed=1)
    kv = _to(PackedKV.from_reference(ks, vs, p, n_sink=4, window=32, value_bits=4, group=64, key_group_tokens=32, key_bits_table=table, **WF4), DEVICE)
    q = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(14)).to(DEVICE)
    good = ops.decode_attention(q, kv, p, 0.125)
    kv.key_bits_table = torch.full_like(kv.key_bits_table, 4)
    assert (ops.decode_attention(q, kv, p, 0.125) - good).abs().max() > 1e-2
    kv.key_bits_table = table.to(torch.int32).to(DEVICE)
    kv.k_gscale[:, :, :2] = kv.k_gscale[:, :, 1:3].clone()
    assert (ops.decode_attention(q, kv, p, 0.125) - good).abs().max() > 1e-2


@pytest.mark.parametrize("kb,vb,group,window,n_sink,gt,wf,fam", [
    (4, 4, 64, 32, 4, 32, True, WF4),  # kv=wf4's structure
    (4, 4, 32, 32, 0, 32, False, {}),  # kv=kivi_int4
    (4, 4, 16, 40, 2, 16, True, dict(value_rotate=True, value_coded_min=True)),  # a window longer than a group
    (5, 5, 64, 32, 4, 32, True, WF4),  # kv=wf5's structure: 40-byte key rows, 5-bit values in bit planes
    (3, 3, 64, 32, 4, 32, True, WF4),  # kv=wf3's structure: 24-byte key rows, 3-bit values as three bit planes
])
def test_grouped_append_is_bit_exact_with_the_reference(kb, vb, group, window, n_sink, gt, wf, fam):
    """kv_append_grp_kernel: a group encoded from the ring when its first token leaves it, fp16 min rounded
    down and scale up, round-half-even codes packed at their bit offsets: the same bytes as
    PackedKV.from_reference (which encodes whole groups with reference.quantize_keys_grouped + pack_bits)."""
    H, D, lens = 2, 64, [130, 3, 70]
    ks, vs = make_seqs(lens, H, D, seed=15)
    p = token_params(kb, H)
    table = wf_table(H, D, seed=2, mean=kb) if wf else None
    fam = dict(fam, key_group_tokens=gt, key_bits_table=table)
    _append_all_equals_reference(ks, vs, p, ("k_gscale", "k_gmin"), n_sink=n_sink, window=window, kb=kb, vb=vb, group=group, **fam)


def _to(kv: PackedKV, device) -> PackedKV:
    if device == "cpu":
        return kv
    return PackedKV(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kv.__dict__.items()})

def _append_all_equals_reference(ks, vs, p, key_meta, *, n_sink, window, kb, vb, group, n_out=0, append_p=None, **fam):
    """ops.append of sequences of different lengths in lockstep, one token per step (each padded with its last token to
    the longest; append_p: the static family's params), leaves the bytes PackedKV.from_reference writes for the padded
    sequences (key_meta: the family's key scale buffers)."""
    H, D, T = ks[0].shape[0], ks[0].shape[2], max(k.shape[1] for k in ks)
    kv = _to(PackedKV.empty(len(ks), H, D, T, n_sink=n_sink, window=window, n_out=n_out, key_bits=kb, value_bits=vb, group=group, **fam), DEVICE)
    full_k = [torch.cat([k, k[:, -1:].expand(H, T - k.shape[1], D)], 1) for k in ks]
    full_v = [torch.cat([v, v[:, -1:].expand(H, T - v.shape[1], D)], 1) for v in vs]
    for t in range(T):
        ops.append(kv, torch.stack([k[:, t] for k in full_k]).to(DEVICE), torch.stack([v[:, t] for v in full_v]).to(DEVICE), append_p)
    expect = PackedKV.from_reference(full_k, full_v, p, n_sink=n_sink, window=window, value_bits=vb, group=group, cap=T, **fam)
    for name in ("sink_k", "sink_v", "win_k", "win_v", "k_payload", *key_meta, "v_payload", "v_scale", "v_min", "lens"):
        assert torch.equal(getattr(kv, name).cpu(), getattr(expect, name)), name



@pytest.mark.parametrize("given", ['{bad', '[1]', '{"name": "x"}', '{"nope": 1}'], ids=["not-json", "not-an-object", "fields-missing", "unknown-field"])
def test_aot_rejects_a_bad_variant_json_in_one_line(tmp_path, given):
    p = subprocess.run([sys.executable, "-m", "kvcompress.kernels.aot", "--arch", "sm_90", "--out", str(tmp_path / "k"), "--variant-json", given],
                       capture_output=True, text=True)
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith("kvcompress: error: --variant-json is not a Variant or a list of them") and "fields: name, head_dim" in p.stderr
    assert not (tmp_path / "k").exists()


def test_aot_rejects_unknown_arch(tmp_path):
    p = subprocess.run([sys.executable, "-m", "kvcompress.kernels.aot", "--arch", "sm_75", "--out", str(tmp_path)], capture_output=True, text=True)
    assert p.returncode == 2 and "allowed: sm_80, sm_90" in p.stderr and "Traceback" not in p.stderr


def test_bench_script_smoke_runs_on_cpu(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, "scripts/bench_decode_attention.py", "--smoke", "--out", str(tmp_path / "b.json")],
                       capture_output=True, text=True, env=env, timeout=600, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    from kvcompress.kernels.bytes_model import FORMATS, ROW_COLUMNS

    assert [r["format"] for r in rows] == list(FORMATS) and all(set(ROW_COLUMNS) <= set(r) for r in rows)
    assert all(r["kvc_us"] > 0 and r["fp16_us"] > 0 and r["splits"] >= 1 for r in rows)
    # the fill columns: the interpreter compiles nothing, so the residency is the script's stand-in, and the split count
    # is the plan's for that residency (the same here: the smoke context is short)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
    import bench_decode_attention as bench

    for r in rows:
        assert r["resident_ctas"] == bench.SMOKE_RESIDENCY and r["splits_at_residency"] >= r["splits"]
        assert r["kvc_us_at_residency"] > 0 and r["fill_gain"] == pytest.approx(r["kvc_us"] / r["kvc_us_at_residency"])


def test_bench_fill_uses_the_launched_kernels_residency():
    """bench_decode_attention's step 3: the residency comes from the compiled split kernel (registers, warps, shared memory)
    against the device's limits, and at long context it fills more splits than the shipped plan."""
    from types import SimpleNamespace

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
    import bench_decode_attention as bench

    from kvcompress.kernels import plan
    from kvcompress.kernels.audit import ARCH_LIMITS

    def handle(regs, warps, shared=0):
        return SimpleNamespace(n_regs=regs, metadata=SimpleNamespace(num_warps=warps, shared=shared))

    lim = ARCH_LIMITS["sm_90"]
    assert bench.resident_ctas(handle(168, 4), lim) == 3  # the grouped kernel at head dim 128 (65536 / (128 x 168))
    assert bench.resident_ctas(handle(127, 4), lim) == 4  # the per-token kernel
    assert bench.resident_ctas(handle(100, 8, 120_000), lim) == 1  # shared memory limits
    assert bench.resident_ctas(handle(32, 4), lim | {"max_warps_per_sm": 48}) == 12  # the device's own limits (sm_89: 48 warps)
    assert bench.resident_ctas(None, lim) == bench.SMOKE_RESIDENCY
    base = plan.choose_splits(1, 8, 131072 - 132, 8, 128, 110, 64)
    assert plan.choose_splits(1, 8, 131072 - 132, 8, 128, 110, 64, ctas_per_sm=4) > base == 33


def test_bench_correctness_check_runs_the_kernels_against_the_reference():
    """bench_decode_attention's step 1 (what a GPU owner runs first) on CPU under the interpreter, short: wf3 (its 3-bit
    planes and a water-filled table at the format's mean) decodes within tolerance and appends bit-exact there, and the
    check reports a reference that disagrees with the kernels as a failure. The kernels themselves: the tests above."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
    import bench_decode_attention as bench

    assert "wf3" in bench.CHECKED
    # short (the interpreter is slow): wf3, the newest path (3-bit planes, a water-filled table at mean 3), past the window into the store
    res = bench.check_correctness("cpu", names=("wf3",), lens=(1, 140), T=136)
    assert set(res) == {"wf3"}
    assert all(r["decode_ok"] and r["append_bit_exact"] for r in res.values()), res
    real = bench.ops.decode_attention_reference
    try:  # a reference that disagrees with the kernels must show as a failure
        bench.ops.decode_attention_reference = lambda q, kv, p, s: real(q, kv, p, s) + 0.01
        bad = bench.check_correctness("cpu", names=("wf3",), lens=(161,), T=1)
    finally:
        bench.ops.decode_attention_reference = real
    assert not bad["wf3"]["decode_ok"]


class _Recorder:
    """A Triton kernel stand-in that records each launch's num_warps and num_stages, then launches the kernel."""

    def __init__(self, fn, calls):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.calls.append((self.fn.__name__, kw.get("num_warps"), kw.get("num_stages")))
            return self.fn[grid](*args, **kw)
        return launch


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("family", ["static", "per_token", "grouped"])
def test_jit_launches_use_the_aot_builds_warps_and_stages(monkeypatch, family, arch):
    """ops launches every kernel (append, split, reduce) with the num_warps and num_stages its AOT build is compiled
    with (aot._specs, aot.compile_all), so the kernels the SASS audit checks are the ones a GPU JIT launch runs;
    on sm_80 the grouped decode at head dim 64 in 3 stages (plan.decode_stages). The device's arch is stubbed."""
    from kvcompress.kernels import aot, plan

    monkeypatch.setattr(plan, "device_arch", lambda device: arch)
    calls = []
    for name in ("kv_append_kernel", "kv_append_rot_kernel", "kv_append_grp_kernel", "decode_split_kernel", "decode_split_rot_kernel",
                 "decode_split_grp_kernel", "decode_reduce_kernel"):
        monkeypatch.setattr(ops, name, _Recorder(getattr(ops, name), calls))
    H, G, D, W, lens = 1, 3, 64, 16, [40]
    ks, vs = make_seqs(lens, H, D, seed=21)
    fam = {"static": {}, "per_token": ROT4, "grouped": dict(WF4, key_group_tokens=16)}[family]
    p = make_params(H, D, 8, 0, ks) if family == "static" else token_params(4, H)
    kb = 8 if family == "static" else 4
    kv = _to(PackedKV.from_reference(ks, vs, p, n_sink=4, window=W, value_bits=4, group=32, cap=48, **fam), DEVICE)
    ops.append(kv, torch.randn(1, H, D).to(DEVICE), torch.randn(1, H, D).to(DEVICE), p)
    ops.decode_attention(torch.randn(1, H * G, D).to(DEVICE), kv, p, D**-0.5)
    v = aot.Variant("jit", D, G, kb, 4, 32, 4, W, 0, **{k: val for k, val in fam.items()})
    want = {fn.__name__: (warps, aot.num_stages(arch, kname, v)) for kname, fn, _, _, warps in aot._specs(v)}
    assert len(calls) == 3 and {c[0] for c in calls} == set(want)
    for name, warps, stages in calls:
        assert (warps, stages) == want[name], (name, warps, stages, want[name])
    if family == "grouped":
        assert want["decode_split_grp_kernel"][1] == (3 if arch == "sm_80" else 2)
