"""The reference numerics: hand-computed values, exact bounds, awkward shapes, byte accounting."""
import pytest
import torch

from kvcompress import reference as ref
from kvcompress.reference import KeyParams


def params(H, D, bits, scale=None, n_out=0):
    s = scale if scale is not None else torch.rand(H, D) * 0.1 + 0.01
    idx = torch.stack([torch.randperm(D)[:n_out].sort().values for _ in range(H)]) if n_out else torch.zeros(H, 0, dtype=torch.long)
    return KeyParams(bits, s, torch.zeros(H, D), idx)


def test_round_half_even_hand_values():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 2.4999, 2.5001])
    assert ref.round_half_even(x).tolist() == [0.0, 2.0, 2.0, -0.0, -2.0, 2.0, 3.0]


def test_int8_keys_hand_values():
    # scale 0.5: 1.0 -> 2; 0.25 -> 0.5 -> 0 (ties to even); 0.75 -> 1.5 -> 2; 100 -> clamp 127; -1.3 -> -2.6 -> -3
    p = KeyParams(8, torch.full((1, 5), 0.5), torch.zeros(1, 5), torch.zeros(1, 0, dtype=torch.long))
    k = torch.tensor([[[1.0, 0.25, 0.75, 100.0, -1.3]]])  # [H=1, T=1, D=5]
    assert ref.quantize_keys(k, p).tolist() == [[[2, 0, 2, 127, -3]]]
    assert ref.dequantize_keys(ref.quantize_keys(k, p), p).tolist() == [[[1.0, 0.0, 1.0, 63.5, -1.5]]]


def test_int4_keys_hand_values_and_offset_binary_packing():
    p = KeyParams(4, torch.ones(1, 4), torch.zeros(1, 4), torch.zeros(1, 0, dtype=torch.long))
    k = torch.tensor([[[-9.0, -1.0, 0.0, 3.0]]])
    q = ref.quantize_keys(k, p)
    assert q.tolist() == [[[-7, -1, 0, 3]]]
    payload, _ = ref.encode_keys(k, p)
    # codes + 8 = [1, 7, 8, 11]; byte0 = 1 | 7 << 4 = 113, byte1 = 8 | 11 << 4 = 184
    assert payload.tolist() == [[[113, 184]]]
    assert ref.decode_keys(payload, torch.zeros(1, 1, 0), p).tolist() == [[[-7.0, -1.0, 0.0, 3.0]]]


def test_pack_unpack_nibble_order():
    codes = torch.tensor([1, 2, 15, 0], dtype=torch.uint8)
    packed = ref.pack_int4(codes)
    assert packed.tolist() == [1 | (2 << 4), 15]
    assert torch.equal(ref.unpack_int4(packed), codes)
    with pytest.raises(ValueError):
        ref.pack_int4(torch.zeros(3, dtype=torch.uint8))


def test_plane_packing_hand_values_and_round_trips():
    """5..7-bit codes: the low nibbles as pack_int4, then one D/8-byte plane per further bit (channel d at bit
    d % 8 of byte d // 8); 4 and 8 bits are pack_int4 and bytes. Signed codes are offset-binary (q + 2**(bits-1))."""
    codes = torch.tensor([17, 2, 31, 16, 0, 5, 20, 1], dtype=torch.uint8)  # 5-bit codes; bit 4 set in channels 0, 2, 3, 6
    packed = ref.pack_codes(codes, 5)
    assert packed.tolist() == [1 | 2 << 4, 15 | 0 << 4, 0 | 5 << 4, 4 | 1 << 4, 0b01001101]
    assert torch.equal(ref.unpack_codes(packed, 5), codes)
    g = torch.Generator().manual_seed(0)
    for bits in (4, 5, 6, 7, 8):
        c = torch.randint(0, 2**bits, (3, 5, 64), generator=g).to(torch.uint8)
        p = ref.pack_codes(c, bits)
        assert p.shape[-1] == ref.row_width(64, bits) == 64 * bits // 8 and ref.row_bits(64, p.shape[-1], p.dtype) == bits
        assert torch.equal(ref.unpack_codes(p, bits), c)
        q = torch.randint(-ref.key_qmax(bits), ref.key_qmax(bits) + 1, (2, 64), generator=g).to(torch.int8)
        assert torch.equal(ref.load_signed(ref.store_signed(q, bits), bits).to(torch.int8), q)
    assert ref.store_signed(torch.tensor([[-63] + [0] * 7], dtype=torch.int8), 7)[0, 0] == 1  # -63 + 64: offset-binary
    with pytest.raises(ValueError, match="multiple of 8"):
        ref.pack_codes(torch.zeros(12, dtype=torch.uint8), 6)
    assert [ref.min_code_step(b) for b in (4, 5, 6, 7, 8)] == [16, 8, 4, 2, 1]


def test_value_hand_values():
    # one group of 4: min 0, max 3 -> int4 scale 3/15 = 0.2 (fp16 rounded up), codes round((v-0)/scale)
    v = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    codes, scale, vmin = ref.quantize_values(v, 4, 4)
    assert vmin.item() == 0.0
    assert scale.item() >= 0.2 and scale.item() - 0.2 < 2e-4  # fp16 ulp at 0.2 is 1.2e-4
    assert codes.tolist() == [[0, 5, 10, 15]]
    assert torch.allclose(ref.dequantize_values(codes, scale, vmin, 4, 4), v, atol=scale.item() / 2)


def test_constant_value_group_is_exact():
    v = torch.full((3, 8), 0.375)  # exactly representable in fp16; scale 0 must not divide by zero
    assert torch.equal(ref.fake_quant_values(v, 4, 8), v)


@pytest.mark.parametrize("T", [1, 7, 1170])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("bits", [4, 8])
def test_key_round_trip_bound(T, D, bits):
    torch.manual_seed(T + D + bits)
    H = 3
    k = torch.randn(2, H, T, D)
    absmax = k.abs().amax(dim=(0, 2))
    p = params(H, D, bits, scale=absmax / ref.key_qmax(bits))  # no clipping
    err = (k - ref.fake_quant_keys(k, p)).abs()
    # exact bound for unclipped values: half a step (plus float32 rounding of the product)
    assert bool((err <= p.scale.view(1, H, 1, D) / 2 * (1 + 1e-5) + 1e-7).all())


@pytest.mark.parametrize("T", [1, 7, 1170])
@pytest.mark.parametrize("D,G", [(64, 32), (128, 128), (128, 32)])
@pytest.mark.parametrize("bits", [4, 5, 7, 8])
def test_value_round_trip_bound(T, D, G, bits):
    torch.manual_seed(T * D + bits)
    v = torch.randn(1, 3, T, D) * 3
    codes, scale, vmin = ref.quantize_values(v, bits, G)
    deq = ref.dequantize_values(codes, scale, vmin, G, bits)
    bound = scale.float().repeat_interleave(G, dim=-1) / 2
    # outward-rounded fp16 meta keeps every value inside the grid: error <= scale/2 (+ fp32 rounding)
    assert bool(((v - deq).abs() <= bound * (1 + 1e-5) + 1e-6).all())
    assert bool((vmin.float() <= v.unflatten(-1, (-1, G)).amin(-1)).all())


@pytest.mark.parametrize("bits", [4, 8])
def test_outliers_are_kept_in_fp16(bits):
    torch.manual_seed(0)
    H, T, D = 3, 7, 64
    k = torch.randn(1, H, T, D)
    k[..., 5] *= 100  # an outlier channel
    p = params(H, D, bits, scale=torch.full((H, D), 0.05), n_out=2)
    idx = p.outlier_idx
    k_hat = ref.fake_quant_keys(k, p)
    kept = torch.gather(k, -1, idx.view(1, H, 1, 2).expand(1, H, T, 2))
    got = torch.gather(k_hat, -1, idx.view(1, H, 1, 2).expand(1, H, T, 2))
    assert torch.equal(got, kept.half().float())
    assert int(ref.quantize_keys(k, p).gather(-1, idx.view(1, H, 1, 2).expand(1, H, T, 2)).abs().sum()) == 0


def test_fp16_mask_and_regions():
    m = ref.fp16_mask(torch.tensor([0, 5, 9]), 10, sink_tokens=2, window=3)
    assert bool(m[0].all())  # t=0: t - s <= 0 < 3 for every s (future slots are removed by causality, not here)
    assert m[1].nonzero().flatten().tolist() == [0, 1, 3, 4, 5, 6, 7, 8, 9]  # t - s < 3 includes s > t (not causal)
    assert m[2].nonzero().flatten().tolist() == [0, 1, 7, 8, 9]
    assert ref.fp16_mask(torch.tensor([4]), 5, 0, 0).sum() == 0  # window 0: the current token is compressed too
    assert ref.region_sizes(3, 4, 128) == (3, 0, 0)
    assert ref.region_sizes(10, 4, 3) == (4, 3, 3)
    assert ref.region_sizes(7, 0, 0) == (0, 7, 0)


def test_cache_nbytes_hand_computed():
    # 1 layer, 1 head, D=64, int8 keys, int4 values in groups of 32, 2 outliers, 4 sinks, window 8, 20 tokens
    b = ref.cache_nbytes(
        n_layers=1, n_kv_heads=1, head_dim=64, key_bits=8, value_bits=4, value_group=32,
        outlier_channels=2, sink_tokens=4, window=8, n_tokens=20,
    )
    assert b == {
        "key_payload": 8 * 64,  # 8 compressed tokens x 64 bytes
        "key_outliers": 8 * 2 * 2,
        "value_payload": 8 * 32,
        "value_meta": 8 * 2 * 2 * 2,  # 2 groups x (scale, min) x fp16
        "sinks": 4 * 2 * 64 * 2,
        "window": 8 * 2 * 64 * 2,
        "static": 64 * 2 * 4 + 2 * 8,
    }
    assert ref.cache_nbytes(n_layers=2, n_kv_heads=3, head_dim=64, key_bits=16, value_bits=16, value_group=64,
                            outlier_channels=0, sink_tokens=0, window=0, n_tokens=5) == {"fp16_tokens": 2 * 3 * 5 * 2 * 64 * 2, "static": 0}


@pytest.mark.parametrize("gqa", [1, 3, 8])
@pytest.mark.parametrize("D", [64, 128])
def test_mixed_attention_limits(gqa, D):
    """window >= length -> plain causal attention on k; window 0 -> plain attention on k_hat."""
    torch.manual_seed(gqa + D)
    Hkv, T = 2, 7
    q = torch.randn(2, Hkv * gqa, T, D)
    k, v, kh, vh = (torch.randn(2, Hkv, T, D) for _ in range(4))
    pos = torch.arange(T)
    sd = lambda kk, vv: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q, kk.repeat_interleave(gqa, 1), vv.repeat_interleave(gqa, 1), is_causal=True, scale=D**-0.5)
    out_full = ref.mixed_attention(q, k, v, kh, vh, pos, sink_tokens=0, window=T, scaling=D**-0.5, q_block=3)
    out_comp = ref.mixed_attention(q, k, v, kh, vh, pos, sink_tokens=0, window=0, scaling=D**-0.5)
    # float32, different summation order than SDPA: 1e-5 absolute on O(1) outputs
    torch.testing.assert_close(out_full, sd(k, v), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_comp, sd(kh, vh), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,sinks,sliding", [(0, 0, None), (5, 2, None), (7, 0, 9), (64, 4, None)])
def test_fused_mixed_attention_equals_explicit(window, sinks, sliding):
    """The CPU path (two fused attentions merged by log-sum-exp) equals the explicit softmax over the
    mixed scores; float64 so only the summation order differs (1e-10)."""
    from kvcompress.reference import mixed_attention
    from kvcompress.reference.attention import _mixed_attention_explicit

    g = torch.Generator().manual_seed(window)
    B, Hq, Hkv, T, D = 2, 6, 2, 37, 16
    q = torch.randn(B, Hq, T, D, generator=g, dtype=torch.float64)
    k, v, kh, vh = (torch.randn(B, Hkv, T, D, generator=g, dtype=torch.float64) for _ in range(4))
    pos = torch.arange(T)
    key_mask = torch.ones(B, T, dtype=torch.bool)
    key_mask[1, :3] = False  # left padding in the second sequence
    kw = dict(sink_tokens=sinks, window=window, scaling=0.25, key_mask=key_mask, sliding_window=sliding)
    fused = mixed_attention(q, k, v, kh, vh, pos, q_block=16, **kw)
    torch.testing.assert_close(fused, _mixed_attention_explicit(q, k, v, kh, vh, pos, **kw), atol=1e-10, rtol=0)


@pytest.mark.parametrize("bits", [4, 5, 6, 7, 8])
def test_coded_min_never_clips_and_costs_little(bits):
    """kv.value.min=code: the min is a byte (-w * scale / F) rounded down, the scale leaves room for that
    rounding, so nothing clips (the round trip error is at most half a step); its error stays within
    a few percent of the fp16 min's (4 bits), for groups that straddle 0 and groups that don't."""
    g = torch.Generator().manual_seed(3)
    v = torch.randn(4, 200, 64, generator=g) * torch.rand(4, 200, 1, generator=g) * 5
    v[0] += 3.0  # all-positive groups: the range is widened to include 0
    v[1] -= 3.0
    scale, w = ref.value_meta_coded(v, bits, 32)
    assert w.dtype == torch.uint8 and scale.dtype == torch.float16
    vmin = ref.coded_min(w, scale, bits)
    vg = v.unflatten(-1, (-1, 32))
    assert (vmin <= vg.amin(-1).clamp(max=0)).all()
    assert (vmin + ref.value_levels(bits) * scale.float() >= vg.amax(-1).clamp(min=0)).all()
    err = (ref.fake_quant_values(v, bits, 32, coded_min=True) - v).unflatten(-1, (-1, 32))
    assert (err.abs() <= 0.5 * scale.float().unsqueeze(-1) + 2e-6).all()  # + float32 rounding of q * scale + min
    if bits == 4:
        mse = [float((ref.fake_quant_values(v[2:], 4, 32, coded_min=c) - v[2:]).pow(2).mean()) for c in (False, True)]
        assert mse[1] < 1.05 * mse[0], mse
