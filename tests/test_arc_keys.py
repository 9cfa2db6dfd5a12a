"""Static asymmetric key ranges that hold at every position up to max_position (kv.key.symmetric=false).

profile records, per RoPE pair, the smallest and largest key norm per bin of the pair's angle before RoPE
(k_arcmin / k_arcmax); fit (observers.base.arc_ranges) turns them into each channel's range over the arc
RoPE can turn that angle through by max_position. A slow pair keeps its offset (a range much narrower than
the symmetric pair-norm bound), a fast pair gets the pair-norm bound, and no observed key clips at any
position below max_position."""
import math

import pytest
import torch

from kvcompress import reference as ref
from kvcompress.observers.base import arc_ranges, tie_pair_scales, uses_arc
from kvcompress.observers.mse import rotate_to_random_positions
from kvcompress.spec import KVSpec
from kvcompress.stages.fit import fit
from kvcompress.stats import N_ARC_BINS, StatsAccumulator

D = 8  # 4 RoPE pairs (d, d + 4)
INV = torch.tensor([1.0, 0.1, 1e-3, 1e-5], dtype=torch.float64)  # fast .. very slow
MAXPOS = 1024


def rope(pre: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor = INV) -> torch.Tensor:
    """rotate_half RoPE of pre-RoPE keys [..., T, D] at positions pos [T]."""
    ang = pos.double()[:, None] * inv[None, :]
    a, b = pre[..., : D // 2].double(), pre[..., D // 2 :].double()
    return torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], -1).float()


def pre_keys(n: int, seed: int) -> torch.Tensor:
    """Pre-RoPE keys [1, 1, n, D]: each pair an offset (the slow pairs' large mean, as real keys have) plus noise."""
    g = torch.Generator().manual_seed(seed)
    mean = torch.tensor([0.5, -1.0, 4.0, -6.0, 0.3, 2.0, 3.0, 1.0])
    return (mean + 0.5 * torch.randn(1, 1, n, D, generator=g))


def accumulate(pre: torch.Tensor, inv: torch.Tensor = INV) -> dict:
    acc = StatsAccumulator(n_layers=1, n_heads=1, n_kv_heads=1, head_dim=D, sample_capacity=0, inv_freq=inv.float())
    acc.set_sample_positions(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    T = pre.shape[2]
    k = rope(pre, torch.arange(T))
    acc.observe_kv(0, k, k)
    return acc.finish({}).tensors


def test_profile_records_the_pre_rope_angle_histogram():
    pre = pre_keys(300, 0)
    t = accumulate(pre)
    assert t["k_arcmax"].shape == (1, 1, D // 2, N_ARC_BINS) and t["k_arcmin"].shape == t["k_arcmax"].shape
    a, b = pre[0, 0, :, : D // 2].double(), pre[0, 0, :, D // 2 :].double()
    ang = torch.remainder(torch.atan2(b, a), 2 * math.pi)
    bins = (ang * N_ARC_BINS / (2 * math.pi)).long().clamp(max=N_ARC_BINS - 1)
    norm = (a * a + b * b).sqrt().float()
    for j in range(D // 2):  # the bin of the angle before RoPE, whatever position the key was seen at
        for bn in bins[:, j].unique().tolist():
            sel = bins[:, j] == bn
            assert t["k_arcmax"][0, 0, j, bn] == pytest.approx(float(norm[sel, j].max()), rel=1e-5)
            assert t["k_arcmin"][0, 0, j, bn] == pytest.approx(float(norm[sel, j].min()), rel=1e-5)
        empty = torch.ones(N_ARC_BINS, dtype=torch.bool)
        empty[bins[:, j].unique()] = False
        assert bool((t["k_arcmax"][0, 0, j, empty] == 0).all()) and bool(torch.isinf(t["k_arcmin"][0, 0, j, empty]).all())


def test_no_observed_key_clips_at_any_position_below_max_position():
    pre = pre_keys(300, 1)
    t = accumulate(pre)
    r = arc_ranges(t["k_arcmin"], t["k_arcmax"], INV.float(), MAXPOS)
    lo, hi = (r.center - r.half)[0, 0], (r.center + r.half)[0, 0]
    g = torch.Generator().manual_seed(2)
    pos = torch.randint(0, MAXPOS, (300,), generator=g)
    k = rope(pre, pos)[0, 0]  # the observed keys anywhere below max_position
    assert bool((k >= lo - 1e-5).all() and (k <= hi + 1e-5).all())
    edge = rope(pre, torch.full((300,), MAXPOS - 1))[0, 0]
    assert bool((edge >= lo - 1e-5).all() and (edge <= hi + 1e-5).all())
    # it is a bound for these positions, not for all: pair 2 (0.001 rad per position) turns by ~1 rad by
    # max_position and by more than a half turn by 5000, where its keys leave the range
    far = rope(pre, torch.full((300,), 5000))[0, 0]
    out = (far < lo - 1e-3) | (far > hi + 1e-3)
    assert bool(out[:, [2, 6]].any())


def test_slow_pairs_keep_their_offset_fast_pairs_get_the_pair_norm_bound():
    pre = pre_keys(300, 3)
    t = accumulate(pre)
    r = arc_ranges(t["k_arcmin"], t["k_arcmax"], INV.float(), MAXPOS)
    norm = pre[0, 0].view(-1, 2, D // 2).square().sum(1).sqrt().amax(0)  # [D/2] largest pair norm
    half, center = r.half[0, 0], r.center[0, 0]
    # fast pair (1 rad per position): a full turn, the symmetric pair-norm bound (within the bin width's slack)
    for c in (0, D // 2):
        assert half[c] == pytest.approx(float(norm[0]), rel=0.02) and abs(float(center[c])) < 0.02 * float(norm[0])
    # the very slow pair (1e-5 rad per position: ~0.01 rad by max_position): about the observed spread, far from 0
    for c, m in ((3, -6.0), (7, 1.0)):
        assert half[c] < 0.5 * float(norm[3]) and abs(float(center[c]) - m) < 0.5
    # and the ranges contain the observed keys at their own positions 0..T-1
    k = rope(pre, torch.arange(300))[0, 0]
    assert bool((k >= center - half - 1e-5).all() and (k <= center + half + 1e-5).all())


def test_pair_scales_are_tied_and_zero_points_stay_per_channel():
    t = accumulate(pre_keys(300, 4))
    r = tie_pair_scales(arc_ranges(t["k_arcmin"], t["k_arcmax"], INV.float(), MAXPOS), torch.zeros(1, 1, 0, dtype=torch.long))
    assert torch.equal(r.half[..., : D // 2], r.half[..., D // 2 :])
    assert not torch.allclose(r.center[..., : D // 2], r.center[..., D // 2 :])
    # an fp16 outlier channel does not widen its partner's shared range
    raw = arc_ranges(t["k_arcmin"], t["k_arcmax"], INV.float(), MAXPOS)
    big = raw.half[0, 0, D // 2 + 3] > raw.half[0, 0, 3]
    out_ch, other = (D // 2 + 3, 3) if big else (3, D // 2 + 3)
    r2 = tie_pair_scales(raw, torch.tensor([[[out_ch]]]))
    assert r2.half[0, 0, other] == raw.half[0, 0, other] and r2.half[0, 0, out_ch] == raw.half[0, 0, other]


def test_fit_uses_the_arc_ranges_for_static_asymmetric_keys_only(tiny_stats):
    assert "k_arcmax" in tiny_stats.tensors  # the tiny Llama has RoPE: profile recorded the histogram
    asym = KVSpec(name="a", key={"symmetric": False, "clip": "minmax"})
    assert uses_arc(tiny_stats, asym)
    assert not uses_arc(tiny_stats, KVSpec(name="s", key={"clip": "minmax"}))  # symmetric: the pair-norm bound
    assert not uses_arc(tiny_stats, KVSpec(name="u", key={"symmetric": False, "tie_rope_pairs": False}))
    assert not uses_arc(tiny_stats, KVSpec(name="p", key={"symmetric": False, "clip": "percentile"}))
    book = fit(tiny_stats, asym)
    r = tie_pair_scales(arc_ranges(tiny_stats["k_arcmin"], tiny_stats["k_arcmax"], tiny_stats["rope_inv_freq"],
                                   tiny_stats.geometry["max_position"], tiny_stats["rope_pairs"]),
                        book.tensors["k_outliers"], tiny_stats["rope_pairs"])
    torch.testing.assert_close(book.tensors["k_zero"], r.center)
    torch.testing.assert_close(book.tensors["k_scale"], r.half / ref.key_qmax(8))
    assert f"0..{tiny_stats.geometry['max_position'] - 1}" in book.fit_info["key_ranges"]  # the report says where the ranges hold
    assert "key_ranges" not in fit(tiny_stats, KVSpec(name="s", key={"clip": "minmax"})).fit_info
    assert "key_clip_note" not in book.fit_info
    # kv_stats without the histogram (an older profile, or no RoPE): the observed ranges, as before
    old = type(tiny_stats)({k: v for k, v in tiny_stats.tensors.items() if k not in ("k_arcmin", "k_arcmax")}, tiny_stats.header)
    assert not uses_arc(old, asym)
    assert not torch.equal(fit(old, asym).tensors["k_zero"], book.tensors["k_zero"])


def test_asymmetric_keys_with_the_mse_search_are_warned_about(tiny_stats, caplog):
    """kv.key.symmetric=false alone keeps the default clip=mse, which measured worse at 8K than minmax: fit says so in
    the log and in fit_info (the report); minmax and symmetric keys are not warned about."""
    import logging

    with caplog.at_level(logging.WARNING, logger="kvcompress"):
        book = fit(tiny_stats, KVSpec(name="a", key={"symmetric": False}))
    assert "kv.key.clip=mse" in book.fit_info["key_clip_note"] and "kv=a: asymmetric keys with kv.key.clip=mse" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvcompress"):
        fit(tiny_stats, KVSpec(name="s"))
        fit(tiny_stats, KVSpec(name="m", key={"symmetric": False, "clip": "minmax"}))
    assert "kv.key.clip=mse" not in caplog.text


def test_key_max_position_tightens_the_ranges_to_the_serving_context(tiny_stats):
    """kv.key.max_position (a serving context below the model's): every channel's range is within the model-wide one and
    some slow pair's is strictly narrower; fit_info says where the ranges hold; observed keys still do not clip at any
    position below it. Only asymmetric static keys take it."""
    full = fit(tiny_stats, KVSpec(name="a", key={"symmetric": False, "clip": "minmax"}))
    short = fit(tiny_stats, KVSpec(name="a", key={"symmetric": False, "clip": "minmax", "max_position": 64}))
    assert full.fit_info["key_max_position"] == tiny_stats.geometry["max_position"] and short.fit_info["key_max_position"] == 64
    assert "positions 0..63" in short.fit_info["key_ranges"] and "kv.key.max_position" in short.fit_info["key_ranges"]
    arcs = {n: arc_ranges(tiny_stats["k_arcmin"], tiny_stats["k_arcmax"], tiny_stats["rope_inv_freq"], n, tiny_stats["rope_pairs"])
            for n in (64, tiny_stats.geometry["max_position"])}
    a, b = arcs.values()  # each channel's arc over fewer positions lies within its arc over more (before the pair's scales are tied)
    assert bool(((a.center - a.half) >= (b.center - b.half) - 1e-5).all() and ((a.center + a.half) <= (b.center + b.half) + 1e-5).all())
    assert (short.tensors["k_scale"] <= full.tensors["k_scale"] + 1e-7).all() and (short.tensors["k_scale"] < full.tensors["k_scale"] * 0.99).any()
    k = tiny_stats["sample_k"].transpose(1, 2).float()  # [L, H, N, D]
    inv = tiny_stats["rope_inv_freq"]
    for pos in (0, 31, 63):
        for layer in range(k.shape[0]):
            kk = rotate_to_random_positions(k[layer], inv, 1, 0, tiny_stats["rope_pairs"], tiny_stats["sample_pos"][layer] - pos)
            assert not ref.key_clipped(kk, short.key_params(layer)).any(), (pos, layer)
    with pytest.raises(ValueError, match="kv.key.max_position=64 sets where asymmetric static keys' ranges hold"):
        KVSpec(name="s", key={"max_position": 64})
