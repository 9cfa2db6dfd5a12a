"""Token-grouped keys (kv.key.group_tokens) with water-filled bits per channel (kv.key.alloc=waterfill, kv=wf4):
the allocation, the variable-width packing, the grouped quantizer, the fit, and the one-pass evaluation against
decoding through the real CompressedCache."""
import itertools

import pytest
import torch
from pydantic import ValidationError

from conftest import fitted_book, run_cli
from kvcompress import reference as ref
from kvcompress.cache import CompressedCache
from kvcompress.errors import UserError
from kvcompress.eval.attention import compressed_attention
from kvcompress.models.base import Geometry
from kvcompress.spec import KVSpec

WF = {"key": {"bits": 4, "symmetric": False, "clip": "minmax", "group_tokens": 32, "alloc": "waterfill"},
      "value": {"bits": 4, "group_size": 0, "symmetric": True, "rotate": "hadamard"}}
UNIFORM = {"key": {"bits": 4, "symmetric": False, "clip": "minmax", "group_tokens": 32}, "value": {"bits": 4, "group_size": 16}}
WF5 = {"key": {**WF["key"], "bits": 5}, "value": {**WF["value"], "bits": 5}}  # kv=wf5's structure: mean 5, 5-bit values in bit planes
WF3 = {"key": {**WF["key"], "bits": 3}, "value": {**WF["value"], "bits": 3}}  # kv=wf3's structure: mean 3, 3-bit values as three bit planes


def _cost(w: torch.Tensor, b: torch.Tensor) -> float:
    return float((w * torch.pow(4.0, -b.double())).sum())


def test_waterfill_bits_is_the_exact_optimum_with_rope_pairs_alike():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        w = torch.rand(8, generator=g).double() ** 6 * 100  # weights over orders of magnitude: 4 RoPE pairs
        b = ref.waterfill_bits(w, 3)
        assert torch.equal(b[:4], b[4:]) and b.float().mean() == 3 and int(b.min()) >= 1 and int(b.max()) <= 8
        wp = w[:4] + w[4:]
        best = min((c for c in itertools.product(range(1, 9), repeat=4) if sum(c) == 12), key=lambda c: _cost(wp, torch.tensor(c)))
        assert _cost(wp, b[:4]) == pytest.approx(_cost(wp, torch.tensor(best)), rel=1e-12)  # greedy == brute force
    # the pair that matters most never gets fewer bits than one that matters less; equal weights share within a bit
    w = torch.tensor([1e4, 1.0, 1e-4, 1.0] * 2).double()
    b = ref.waterfill_bits(w, 4)
    assert b[0] >= max(b[1], b[3]) and min(b[1], b[3]) >= b[2] and b[0] > b[2] and abs(int(b[1] - b[3])) <= 1
    assert torch.equal(ref.waterfill_bits(torch.ones(2, 16), 4), torch.full((2, 16), 4))
    with pytest.raises(ValueError, match="mean_bits"):
        ref.waterfill_bits(torch.ones(8), 9)


def test_pack_bits_round_trips_codes_that_straddle_bytes():
    g = torch.Generator().manual_seed(1)
    bits = torch.tensor([3, 5, 8, 1, 7, 2, 6, 4] * 2)  # 72 bits: most codes straddle a byte boundary
    codes = (torch.randint(0, 256, (5, 9, 16), generator=g) % (2**bits)).to(torch.uint8)
    packed = ref.pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 9, 9)
    assert torch.equal(ref.unpack_bits(packed, bits), codes)
    # the layout, by hand: channel 0 holds bits 0-2 of byte 0, channel 1 bits 3-7 of byte 0, channel 2 byte 1
    one = torch.zeros(16, dtype=torch.uint8)
    one[0], one[1], one[2] = 0b101, 0b10011, 0xA5
    p = ref.pack_bits(one, bits)
    assert int(p[0]) == 0b101 | (0b10011 << 3) and int(p[1]) == 0xA5 and int(p[2:].sum()) == 0
    # a uniform width of 4 is pack_int4's layout, so the kernels' bitstream and the cache's int4 payload agree
    c4 = torch.randint(0, 16, (2, 3, 5, 16), generator=g).to(torch.uint8)  # [B, H, n, D]
    t4 = torch.full((3, 16), 4)
    assert torch.equal(ref.pack_key_codes(c4, t4), ref.pack_key_codes(c4, 4)) and torch.equal(ref.unpack_key_codes(ref.pack_key_codes(c4, t4), t4), c4)


def test_grouped_keys_with_per_channel_bits_never_clip_and_groups_start_after_the_sinks():
    g = torch.Generator().manual_seed(2)
    k = torch.randn(2, 70, 8, generator=g) * torch.linspace(0.1, 10, 8)  # [H, T, D]
    bits = torch.tensor([[1, 8, 4, 3] * 2, [2, 6, 5, 3] * 2])  # [H, D]
    kq = ref.fake_quant_keys_grouped(k, bits.unsqueeze(-2), 32, start=3)
    assert torch.equal(kq[:, :3], k[:, :3])  # sinks unchanged
    for lo in (3, 35):  # groups [3, 35), [35, 67)
        src, blk = k[:, lo : lo + 32], kq[:, lo : lo + 32]
        step = (src.amax(1) - src.amin(1)) / (2.0**bits - 1)  # [H, D]
        assert ((blk - src).abs() <= step.unsqueeze(1) * 0.5 * (1 + 1e-2) + 1e-6).all()  # at most half a step: nothing clips
        for h, d in itertools.product(range(2), range(8)):
            assert blk[h, :, d].unique().numel() <= 2 ** int(bits[h, d])
    codes, scale, vmin = ref.quantize_keys_grouped(k[:, 3:67], bits.unsqueeze(-2), 32)
    assert codes.dtype == torch.uint8 and bool((codes.long() < 2 ** bits.unsqueeze(-2)).all()) and scale.dtype == vmin.dtype == torch.float16


def test_spec_refuses_waterfill_without_token_groups_it_can_weigh():
    with pytest.raises(ValidationError, match="alloc=waterfill needs token-grouped keys"):
        KVSpec(name="x", key={"bits": 4, "symmetric": False, "alloc": "waterfill"})
    with pytest.raises(ValidationError, match=r"group_tokens in \[32, 64, 128\]"):
        KVSpec(name="x", key={"bits": 4, "symmetric": False, "group_tokens": 96, "alloc": "waterfill"}, window=128)
    for b in (7, 8):  # means the kernels are not tested at
        with pytest.raises(ValidationError, match=rf"kv.key.bits \(the mean width\) in \[3, 4, 5, 6\]; got group_tokens=32, bits={b}"):
            KVSpec(name="x", key={"bits": b, "symmetric": False, "group_tokens": 32, "alloc": "waterfill"})
    for b in (5, 6):  # kv=wf5 / wf6: a mean of 5 or 6 bits, and 5- or 6-bit values beside token-grouped keys
        KVSpec(name="x", key={"bits": b, "symmetric": False, "group_tokens": 32, "alloc": "waterfill"}, value={"bits": b, "symmetric": True}, window=32)
    with pytest.raises(ValidationError, match="5..7-bit codes are in the per-token family .* and the token-grouped family"):
        KVSpec(name="x", key={"bits": 8}, value={"bits": 5})
    KVSpec(name="x", key={"bits": 3, "symmetric": False, "group_tokens": 32, "alloc": "waterfill"}, value={"bits": 3, "symmetric": True}, window=32)
    # 3-bit codes (kv=wf3): water-filled token-grouped keys and symmetric values only
    for key, value in (({"bits": 3}, {"bits": 3}),  # static keys
                       ({"bits": 3, "symmetric": False, "group_tokens": 32}, {"bits": 3, "symmetric": True}),  # uniform 3-bit keys
                       ({"bits": 4, "symmetric": False, "group_tokens": 32, "alloc": "waterfill"}, {"bits": 3}),  # asymmetric 3-bit values
                       ({"bits": 8}, {"bits": 3, "symmetric": True})):
        with pytest.raises(ValidationError, match="3-bit codes are in the token-grouped family with water-filled keys and symmetric values only"):
            KVSpec(name="x", key=key, value=value, window=32)


def test_token_grouped_key_rows_must_be_whole_32_bit_words():
    """The decode reads a key row as 32-bit words: head_dim * mean bits must be a multiple of 32 (SmolLM2's 64 x 5 is;
    a head of 72 at a mean of 5 is not), said in one line before anything is profiled."""
    spec = KVSpec(name="x", key={"bits": 5, "symmetric": False, "group_tokens": 32, "alloc": "waterfill"}, value={"group_size": 0}, window=32)
    spec.check_geometry(64)
    with pytest.raises(UserError, match="head_dim \\* bits must be a multiple of 32; got head_dim=72, kv.key.bits=5"):
        spec.check_geometry(72)


def test_fit_gives_more_bits_where_queries_and_ranges_are_large(tiny_llama, tiny_stats):
    from kvcompress.stages.fit import fit

    book = fit(tiny_stats, KVSpec(name="wf", window=32, **WF))
    bits = book.tensors["k_bits"]  # [L, H, D]
    L, H, D = bits.shape
    assert bits.dtype == torch.int64 and torch.equal(bits.float().mean(-1), torch.full((L, H), 4.0))
    assert torch.equal(bits[..., : D // 2], bits[..., D // 2 :]) and "waterfill" in book.fit_info["key_bits"]
    assert int(bits.max()) > 4 and int(bits.min()) < 4  # the tiny model's channels are not all alike
    q2 = torch.stack([torch.diagonal(tiny_stats.q_second_moment(i), dim1=-2, dim2=-1) for i in range(L)])
    w = q2 * torch.stack([tiny_stats.group_range_sq(i, 32) for i in range(L)])
    wp = w[..., : D // 2] + w[..., D // 2 :]
    top, low = wp.argmax(-1, keepdim=True), wp.argmin(-1, keepdim=True)
    assert (bits.gather(-1, top) >= bits.gather(-1, low)).all() and (bits.gather(-1, top) > bits.gather(-1, low)).any()
    assert book.key_bits(0).shape == (H, D)


def test_a_group_longer_than_the_calibration_windows_is_a_clear_error(tiny_stats, tmp_path):
    from kvcompress.stages.fit import fit

    with pytest.raises(UserError, match=r"no calibration window holds a whole group of 128 tokens \(calib.seq_len=64\)"):
        fit(tiny_stats, KVSpec(name="wf", window=128, **{**WF, "key": {**WF["key"], "group_tokens": 128}}))
    # the command line says so before any work: no profile, no run directory
    r = run_cli("model=tiny_llama", "calib=smoke", "eval=smoke", "kv=wf4", "export=none", f"hydra.run.dir={tmp_path / 'r'}", cache_dir=tmp_path / "c")
    assert r.returncode != 0 and "kv=wf4: kv.key.group_tokens=128 needs calibration windows that hold a whole group; calib.seq_len=64" in r.stderr
    assert "Traceback" not in r.stderr and "profile" not in r.stderr.lower() and not (tmp_path / "r").exists() and not (tmp_path / "c").exists()
    r = run_cli("model=tiny_llama", "calib=smoke", "eval=smoke", "kv=int8k_int4v", "eval.compare=[wf4]", "export=none", f"hydra.run.dir={tmp_path / 'r'}",
                cache_dir=tmp_path / "c")  # a compared format too
    assert r.returncode != 0 and "kv=wf4: kv.key.group_tokens=128" in r.stderr and not (tmp_path / "r").exists()


@pytest.mark.parametrize("name,kw", [("waterfill", WF), ("uniform", UNIFORM), ("waterfill5", WF5), ("waterfill3", WF3)])
def test_onepass_equals_decoding_through_the_compressed_cache(name, kw):
    """Token-grouped keys in the real cache (a group encoded whole when its first token leaves the window,
    variable-width codes in one bitstream per row) give the validation path's logits, sinks before the
    groups; float64 as tests/test_rotated.py (a flipped code would exceed the tolerance)."""
    from conftest import float64_model, tiny_lm

    lm = tiny_lm("llama")
    book = fitted_book(lm, name=name, window=32, sink_tokens=3, **kw)
    T = 110  # 110 - 3 - 32 = 75 compressed tokens: two whole groups of 32 and a third written ahead of its last tokens
    ids = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        float64_model(lm, mp)
        cache = CompressedCache(book)
        dec = torch.cat([lm.model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(T)], 1)
        with compressed_attention(lm.model, book) as kw_:
            one = lm.model(input_ids=ids, use_cache=False, **kw_).logits
        plain = lm.model(input_ids=ids).logits
    torch.testing.assert_close(one, dec, atol=1e-9, rtol=0)
    assert (one - plain).abs().max() > 1e-3  # something was quantized
    assert cache.nbytes_breakdown() == ref.spec_cache_nbytes(book.spec, Geometry(**book.geometry), T, batch=2)
    st, D = cache.layers[0].store, book.geometry["head_dim"]
    kb = book.spec.key.bits
    assert st["k_payload"].dtype == torch.uint8 and st["k_payload"].shape[-2:] == (96, D * kb // 8)  # 3 groups, kb bits per element on average
    assert st["k_gscale"].shape[-2:] == (3, D) and st["k_gscale"].dtype == st["k_gmin"].dtype == torch.float16


def test_a_prefill_chunk_stores_the_same_groups_as_token_by_token_decoding(tiny_llama):
    book = fitted_book(tiny_llama, name="wf", window=32, sink_tokens=3, **WF)
    k, v = torch.randn(2, 2, 100, 32, generator=torch.Generator().manual_seed(3)).unbind(0)
    k, v = k.unsqueeze(0), v.unsqueeze(0)  # [1, H, T, D]
    a, b = CompressedCache(book), CompressedCache(book)
    a.layers[0].update(k, v)
    for t in range(100):
        b.layers[0].update(k[..., t : t + 1, :], v[..., t : t + 1, :])
    for name in ("k_payload", "k_gscale", "k_gmin", "v_payload", "v_scale"):
        assert torch.equal(a.layers[0].store[name], b.layers[0].store[name]), name
    kv_a, kv_b = a.layers[0]._view(), b.layers[0]._view()
    assert torch.equal(kv_a[0], kv_b[0]) and torch.equal(kv_a[1], kv_b[1])


@pytest.mark.slow
def test_wf4_validates_end_to_end_with_the_groups_the_calibration_holds(tmp_path):
    import json

    run_dir = tmp_path / "run"
    r = run_cli("model=tiny_llama", "calib=smoke", "eval=smoke", "kv=wf4", "kv.key.group_tokens=32", "kv.window=32", "export=none",
                f"hydra.run.dir={run_dir}", cache_dir=tmp_path / "c")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads((run_dir / "report.json").read_text())
    assert rep["kv"]["key"]["alloc"] == "waterfill" and rep["quality"]["key_clip_rate"] == 0 and rep["quality"]["kl_mean"] > 0
    assert rep["memory"]["breakdown_per_token"]["key_meta"] > 0


def test_profile_records_each_key_channels_mean_squared_group_range():
    from kvcompress.spec import GROUP_RANGE_TOKENS
    from kvcompress.stats import StatsAccumulator

    acc = StatsAccumulator(n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, sample_capacity=0)
    acc.set_sample_positions(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    g = torch.Generator().manual_seed(4)
    ks = [torch.randn(2, 1, 140, 4, generator=g), torch.randn(3, 1, 70, 4, generator=g)]  # two batches of windows [B, H, T, D]
    for k in ks:
        acc.observe_kv(0, k, k)
    st = acc.finish({})
    for i, G in enumerate(GROUP_RANGE_TOKENS):
        want, n = torch.zeros(1, 4, dtype=torch.float64), 0
        for k in ks:
            for b in range(k.shape[0]):
                for j in range(k.shape[2] // G):  # aligned whole groups of each window; a partial tail is left out
                    blk = k[b, :, j * G : (j + 1) * G]
                    want += (blk.amax(1) - blk.amin(1)).double() ** 2
                    n += 1
        assert int(st["k_grange_n"][0, i]) == n
        if n:
            torch.testing.assert_close(st.group_range_sq(0, G), want / n)
        else:
            with pytest.raises(UserError, match=f"no calibration window holds a whole group of {G} tokens"):
                st.group_range_sq(0, G)


def test_the_wf4_preset_fits_the_4_5_bit_budget_with_every_byte_counted():
    """4.44 bits per element at 8K on SmolLM2's geometry (the figure the README and wf4.yaml quote): whole groups of
    key payload, an fp16 scale and min per channel per group, the values' fp16 scale per token, sinks and window."""
    from kvcompress.config import kv_preset
    from kvcompress.stages.validate import memory_summary

    geo = Geometry(n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, hidden_size=576, vocab_size=10, max_position=8192, rope_theta=1e4, architecture="x")
    spec = kv_preset("wf4")
    assert not spec.validate_only and spec.key.alloc == "waterfill"  # the grouped family ships (custom tier)
    b = ref.spec_cache_nbytes(spec, geo, 8192)
    lh, n_comp = 30 * 3, 8192 - 4 - 128
    assert b["key_payload"] == lh * 63 * 128 * 64 // 2 and b["key_meta"] == lh * 63 * 64 * 4 and b["static"] == lh * 64  # 63 groups of 128 cover 8060 tokens
    assert b["value_payload"] == lh * n_comp * 32 and b["value_meta"] == lh * n_comp * 2
    m = memory_summary(spec, geo, 8192)
    assert m.bits_per_element <= 4.5 and round(m.bits_per_element, 2) == 4.44, m


@pytest.mark.parametrize("name,bits,figure", [("wf5", 5, 5.42), ("wf6", 6, 6.41), ("wf3", 3, 3.46)])
def test_the_wf5_and_wf6_presets_count_their_wider_rows(name, bits, figure):
    """kv=wf5 / kv=wf6 (and kv=wf3) at 8K on SmolLM2's geometry (the README's figures): key rows of 64 * bits / 8 bytes in
    whole groups, value rows of 5-, 6- (3-) bit codes, the same per-group and per-token metadata as kv=wf4; below
    int8k_int4v's 6.65 bits."""
    from kvcompress.config import kv_preset
    from kvcompress.stages.validate import memory_summary

    geo = Geometry(n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, hidden_size=576, vocab_size=10, max_position=8192, rope_theta=1e4, architecture="x")
    spec = kv_preset(name)
    assert spec.key.alloc == "waterfill" and spec.key.bits == spec.value.bits == bits and not spec.validate_only
    b = ref.spec_cache_nbytes(spec, geo, 8192)
    lh, n_comp = 30 * 3, 8192 - 4 - 128
    assert b["key_payload"] == lh * 63 * 128 * 64 * bits // 8 and b["key_meta"] == lh * 63 * 64 * 4
    assert b["value_payload"] == lh * n_comp * 64 * bits // 8 and b["value_meta"] == lh * n_comp * 2
    m = memory_summary(spec, geo, 8192)
    assert round(m.bits_per_element, 2) == figure and m.bits_per_element < memory_summary(kv_preset("int8k_int4v"), geo, 8192).bits_per_element
