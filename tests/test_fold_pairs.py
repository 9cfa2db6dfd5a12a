"""kv.fold_pairs: per-RoPE-pair rotations (and FP8 grid shrinks) folded into W_q/W_k, chosen by fit."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import DynamicCache

from conftest import tiny_lm
from kvcompress import reference as ref
from kvcompress.config import CalibConfig
from kvcompress.data import load_texts
from kvcompress.eval.attention import simulate_kv
from kvcompress.fold import apply_fold
from kvcompress.spec import KVSpec
from kvcompress.stages.fit import PAIR_ANGLES, PAIR_SHIFTS, fit, pair_scores, pair_transforms
from kvcompress.stages.profile import profile

CALIB = CalibConfig(name="smoke", n_samples=4, seq_len=64, batch_size=4, sample_tokens=64)


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama", heads=8, kv_heads=2, head_dim=32, layers=2)


@pytest.fixture(scope="module")
def stats(lm):
    return profile(lm, CALIB, load_texts(CALIB), progress=False)


def _spec(fmt, **kw):
    return KVSpec(name=fmt, format=fmt, window=0, sink_tokens=0, **kw)


def test_pair_rotate_commutes_with_rope_and_inverts():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    x = torch.randn(1, 3, 5, 16)
    ang = torch.rand(8) * 3
    freqs = torch.arange(5.0)[:, None] * (0.3 ** torch.arange(8.0))  # [T, D/2]
    emb = torch.cat([freqs, freqs], -1)[None]
    rope = lambda t: apply_rotary_pos_emb(t, t, emb.cos(), emb.sin())[0]  # noqa: E731  transformers' own RoPE
    torch.testing.assert_close(ref.pair_rotate(rope(x), ang), rope(ref.pair_rotate(x, ang)), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref.pair_rotate(ref.pair_rotate(x, ang), -ang), x, atol=1e-5, rtol=1e-5)
    assert (ref.pair_rotate(x, ang) - x).abs().max() > 0.1


def test_rotated_fold_is_exact_and_caches_rotated_keys(lm):
    g = torch.Generator().manual_seed(0)
    L, H, D = lm.geometry.n_layers, lm.geometry.n_kv_heads, lm.geometry.head_dim
    sigma = (torch.rand(L, H, D // 2, generator=g) + 0.5).repeat(1, 1, 2)
    rot = torch.rand(L, H, D // 2, generator=g) * math.pi
    folded = copy.deepcopy(lm.model)
    apply_fold(folded, sigma, None, rot)
    ids = torch.randint(0, 256, (2, 33), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(folded(input_ids=ids).logits, lm.model(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
        c1, c2 = DynamicCache(config=lm.model.config), DynamicCache(config=lm.model.config)
        lm.model(input_ids=ids, cache=c1, use_cache=True)
        folded(input_ids=ids, cache=c2, use_cache=True)
    for layer in range(L):
        want = ref.pair_rotate(c1.layers[layer].keys, rot[layer][None, :, None, :]) / sigma[layer][None, :, None, :]
        torch.testing.assert_close(c2.layers[layer].keys, want, atol=1e-5, rtol=1e-4)
        assert (c2.layers[layer].keys - c1.layers[layer].keys / sigma[layer][None, :, None, :]).abs().max() > 1e-2  # really rotated


def test_fit_rotates_fp8_pairs_and_never_raises_the_calibration_error(stats):
    book = fit(stats, _spec("native_fp8"))
    rot, sk = book.tensors["fold_k_rot"], book.tensors["fold_k"]
    info = book.fit_info["fold_pairs"]
    assert (rot != 0).any() and sum(info["rotated_pairs"]) == int((rot != 0).sum())
    assert sum(info["shrunk_pairs"]) == int((sk[..., : sk.shape[-1] // 2] != fit(stats, _spec("native_fp8", fold_pairs=False)).tensors["fold_k"][..., : sk.shape[-1] // 2]).sum())
    before, after = zip(*info["key_error_before_after"])
    assert all(a <= b for a, b in zip(after, before)) and sum(after) < 0.95 * sum(before)
    P = sk.shape[-1] // 2
    torch.testing.assert_close(sk[..., :P], sk[..., P:])  # still tied: commutes with RoPE
    # a rotated pair's calibrated norm stays within the format's range at every angle
    limit = 448 * book.tensors["native_scale"].view(-1, 1, 1)
    assert ((stats["k_pairmax"] / sk[..., :P] <= limit * (1 + 1e-6)) | (rot == 0)).all()
    # off: no rotation, no shrink; INT8 (auto) leaves pairs alone
    plain = fit(stats, _spec("native_fp8", fold_pairs=False))
    assert not plain.tensors["fold_k_rot"].any() and "fold_pairs" not in plain.fit_info
    assert (plain.tensors["fold_k"] <= 1).all() and (sk >= plain.tensors["fold_k"]).all()
    assert not fit(stats, _spec("native_int8")).tensors["fold_k_rot"].any()
    forced = fit(stats, _spec("native_int8", fold_pairs=True)).fit_info["fold_pairs"]
    assert len(forced["rotated_pairs"]) == stats["k_absmax"].shape[0] and sum(forced["shrunk_pairs"]) == 0  # INT8: no grid to shrink onto


def test_validate_simulates_what_the_rotated_checkpoint_caches(lm, stats):
    """simulate_kv's keys equal the folded model's cached keys through FP8, mapped back by the fold."""
    book = fit(stats, _spec("native_fp8"))
    t = book.tensors
    folded = copy.deepcopy(lm.model)
    apply_fold(folded, t["fold_k"], t["fold_v"], t["fold_k_rot"])
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    c1, c2 = DynamicCache(config=lm.model.config), DynamicCache(config=lm.model.config)
    with torch.no_grad():
        lm.model(input_ids=ids, cache=c1, use_cache=True)
        folded(input_ids=ids, cache=c2, use_cache=True)
    for layer in range(lm.geometry.n_layers):
        k, v = c1.layers[layer].keys, c1.layers[layer].values
        _, _, k_hat, v_hat = simulate_kv(k, v, book, layer)
        sk, rot, s = t["fold_k"][layer][None, :, None, :], t["fold_k_rot"][layer][None, :, None, :], float(t["native_scale"][layer])
        # the folded model caches R k / sigma (float rounding apart) ...
        torch.testing.assert_close(c2.layers[layer].keys, ref.pair_rotate(k, rot) / sk, atol=1e-5, rtol=1e-4)
        # ... and validate's keys are that, through FP8, mapped back; the last-bit differences of the
        # two float paths flip an FP8 rounding tie now and then
        cached = ref.native_fake_quant(c2.layers[layer].keys.float(), s, "native_fp8")  # what TensorRT-LLM's FP8 cache holds
        same = torch.isclose(k_hat.float(), ref.pair_rotate(cached * sk, -rot), atol=1e-4, rtol=1e-3)
        assert same.float().mean() > 0.99, float(same.float().mean())


def test_pair_transforms_split_a_one_channel_pair():
    """A pair whose keys sit in one channel, read by queries in that channel: a quarter-turn-free
    rotation spreads its FP8 rounding error over both channels and cuts the q.k error."""
    g = torch.Generator().manual_seed(0)
    N, H, D = 4096, 1, 4
    x = torch.zeros(N, H, D)
    x[:, 0, 0] = 3 + torch.rand(N, generator=g)  # pair (0, 2): energy in channel 0
    x[:, 0, 1] = torch.randn(N, generator=g)
    x[:, 0, 3] = torch.randn(N, generator=g)
    qq = torch.diag(torch.tensor([100.0, 1.0, 100.0, 1.0]))[None]
    pairmax = torch.stack([(x[..., 0] ** 2 + x[..., 2] ** 2).sqrt().amax(0), (x[..., 1] ** 2 + x[..., 3] ** 2).sqrt().amax(0)], -1)
    ang, sigma, e = pair_transforms(x, qq, torch.ones(H, D), 4.0 * 16 / 448, "native_fp8", pairmax)
    assert ang[0, 0] != 0 and e["after"] < 0.8 * e["before"] and e["rotated"] >= 1
    # little headroom: a rotation must come with a shrink that keeps the pair's norm in range ...
    s = float(pairmax[0, 0]) / 448 / 1.2
    ang2, sigma2, _ = pair_transforms(x, qq, torch.ones(H, D), s, "native_fp8", pairmax)
    assert ang2[0, 0] != 0 and float(pairmax[0, 0] / sigma2[0, 0]) <= 448 * s
    # ... and without shrinks (INT8), it is not taken
    ang3, sigma3, _ = pair_transforms(x, qq, torch.ones(H, D), float(pairmax[0, 0]) / 127 / 1.2, "native_int8", pairmax)
    assert ang3[0, 0] == 0 and (sigma3 == 1).all()


def test_fold_pairs_true_is_refused_where_it_does_not_apply():
    with pytest.raises(ValueError, match="format=native_nvfp4"):
        _spec("native_nvfp4", fold_pairs=True)
    with pytest.raises(ValueError, match="fold_keys=False"):
        _spec("native_fp8", fold_pairs=True, fold_keys=False)
    assert not _spec("native_fp8", fold_keys=False).pairs_folded


def test_pair_scores_at_a_serving_context_average_the_scores_of_turned_keys_and_queries():
    """kv.pair_context: a pair's score is its calibration score averaged over position shifts, keys and
    queries turned together by RoPE; checked against rotating the sample and the query block by hand.
    Pair 0 turns 16 pi over the shifts (every shift lands on a measured angle), pair 1 not at all."""
    g = torch.Generator().manual_seed(0)
    N, H, D = 512, 2, 4
    x = torch.randn(N, H, D, generator=g) * torch.tensor([3.0, 0.5, 0.2, 1.0]) + torch.tensor([2.0, 1.0, 0.0, -1.0])
    q = torch.randn(4 * N, H, D, generator=g) * torch.tensor([2.0, 1.0, 0.5, 1.0])
    qq = torch.einsum("nhd,nhe->hde", q, q).double() / q.shape[0]
    P, step, shift, scale = D // 2, math.pi / 2 / PAIR_ANGLES, 1000, 8.0 / 448
    inv_freq = torch.tensor([2 * PAIR_SHIFTS * step / shift, 0.0])
    blocks = [torch.diagonal(qq, dim1=-2, dim2=-1)[:, :P], torch.diagonal(qq, dim1=-2, dim2=-1)[:, P:], torch.diagonal(qq[:, :P, P:], dim1=-2, dim2=-1)]
    got = pair_scores(x.double(), *blocks, scale, "native_fp8", [1.0], inv_freq, shift)[1.0]  # [J, H, P]
    still = pair_scores(x.double(), *blocks, scale, "native_fp8", [1.0])[1.0]
    for j in (0, 5):
        want = torch.zeros(H, P, dtype=torch.float64)
        for m in range(PAIR_SHIFTS):
            beta = torch.tensor([(j + 2 * m + 1) * step, j * step], dtype=torch.float64)  # shift (m + 1/2) / S * shift
            y = ref.pair_rotate(x.double(), beta)
            dy = ref.native_fake_quant(y.float(), scale, "native_fp8").double() - y
            c, s_ = beta.cos(), beta.sin()
            r = torch.zeros(H, P, 2, 2, dtype=torch.float64)
            r[..., 0, 0], r[..., 0, 1], r[..., 1, 0], r[..., 1, 1] = c, -s_, s_, c
            qb = torch.stack([torch.stack([blocks[0], blocks[2]], -1), torch.stack([blocks[2], blocks[1]], -1)], -2)  # [H, P, 2, 2]
            rq = r @ qb @ r.transpose(-1, -2)
            d2 = torch.stack([dy[..., :P], dy[..., P:]], -1)  # [N, H, P, 2]
            want += torch.einsum("nhpa,hpab,nhpb->hp", d2, rq, d2) / N
        torch.testing.assert_close(got[j], want / PAIR_SHIFTS, rtol=1e-6, atol=0)
        torch.testing.assert_close(got[j, :, 1], still[j, :, 1], rtol=1e-9, atol=0)  # RoPE never turns pair 1
    assert not torch.allclose(got[:, :, 0], still[:, :, 0], rtol=1e-3)


def test_pair_context_averages_the_fit_over_the_serving_positions(stats):
    """fit records the shift that kv.pair_context asks for; 0 is the calibration-position choice."""
    base = fit(stats, _spec("native_fp8", fold_pairs=True))
    far = fit(stats, _spec("native_fp8", fold_pairs=True, pair_context=4096))
    assert base.fit_info["fold_pairs"]["position_shift"] == 0
    assert far.fit_info["fold_pairs"]["position_shift"] == 4096 - CALIB.seq_len
    assert "kv.pair_context=4096" in far.fit_info["fold_pairs"]["rule"]
    assert not torch.equal(base.tensors["fold_k_rot"], far.tensors["fold_k_rot"])
    with pytest.raises(ValueError, match="kv.pair_context=4096"):
        _spec("native_int8", pair_context=4096)
