"""kv=rot4: Hadamard-rotated per-token int4 keys and values, a validate-only format at <= 4.5 bits
per element (window and sinks amortised at 8K): reference numerics, bytes, the one-pass evaluation,
and the refusals (CompressedCache, export)."""
import json

import pytest
import torch
from pydantic import ValidationError

from conftest import fitted_book, run_cli
from kvcompress import reference as ref
from kvcompress.errors import UserError
from kvcompress.eval.attention import simulate_kv
from kvcompress.models.base import Geometry
from kvcompress.spec import KVSpec
from kvcompress.stages.validate import memory_summary

ROT = {"key": {"bits": 4, "granularity": "token", "rotate": "hadamard", "clip": "minmax"}}


def test_hadamard_is_orthogonal_and_its_own_inverse():
    for n in (1, 2, 8, 64, 256):
        h = ref.hadamard(n)
        torch.testing.assert_close(h @ h, torch.eye(n), atol=1e-6, rtol=0)
        torch.testing.assert_close(h, h.T)
    x = torch.randn(3, 5, 64)
    torch.testing.assert_close(ref.rotate(ref.rotate(x, "hadamard"), "hadamard"), x, atol=1e-5, rtol=0)
    q = torch.randn(64)
    torch.testing.assert_close(ref.rotate(q, "hadamard") @ ref.rotate(x, "hadamard").transpose(-1, -2), q @ x.transpose(-1, -2), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="power-of-two"):
        ref.hadamard(48)


def test_symmetric_per_token_quantizer_never_clips_and_uses_15_levels():
    x = torch.randn(4, 100, 64) * torch.linspace(0.1, 5, 64)
    xq = ref.fake_quant_token_symmetric(x, 4, 32)
    xg, qg = x.unflatten(-1, (2, 32)), xq.unflatten(-1, (2, 32))
    step = qg.abs().amax(-1, keepdim=True) / 7
    assert ((xg - qg).abs() <= step / 2 + 1e-6).all()  # within half a step: nothing saturates
    for t in range(5):
        assert qg[0, t, 0].unique().numel() <= 15


def test_rotation_spreads_an_outlier_channel():
    """Why rotate: a token with one large channel wastes per-token levels on it; after the rotation
    the energy is spread and the reconstruction error drops."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 64, generator=g)
    x[:, 3] *= 30.0
    err = {how: float((ref.fake_quant_rotated(x, 4, 64, True, how) - x).pow(2).mean()) for how in ("none", "hadamard")}
    assert err["hadamard"] < 0.5 * err["none"], err


def test_simulate_kv_follows_the_spec(tiny_llama):
    book = fitted_book(tiny_llama, name="rot", window=8, sink_tokens=0, value={"bits": 4, "group_size": 0, "symmetric": True, "rotate": "hadamard"}, **ROT)
    k, v = torch.randn(1, 2, 40, 32), torch.randn(1, 2, 40, 32)
    k_hp, v_hp, k_hat, v_hat = simulate_kv(k, v, book, 0)
    torch.testing.assert_close(k_hat, ref.fake_quant_rotated(k_hp, 4, 32, True, "hadamard"))
    torch.testing.assert_close(v_hat, ref.fake_quant_rotated(v_hp, 4, 32, True, "hadamard"))
    assert not torch.allclose(k_hat, ref.fake_quant_rotated(k_hp, 4, 32, True, "none"))  # the rotation is applied


def test_bytes_and_the_rot4_preset_fits_the_4_5_bit_budget():
    from kvcompress.config import kv_preset

    geo = Geometry(n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, hidden_size=576, vocab_size=10, max_position=8192, rope_theta=1e4, architecture="x")
    spec = KVSpec(name="r", window=0, sink_tokens=0, key={"bits": 4, "granularity": "token", "group_size": 32, "rotate": "hadamard"},
                  value={"bits": 4, "group_size": 64, "symmetric": True, "rotate": "hadamard"})
    b = ref.spec_cache_nbytes(spec, geo, 100)
    lh = 30 * 3 * 100
    assert b["key_meta"] == lh * 2 * 2 and b["value_meta"] == lh * 1 * 2 and b["static"] == 0  # 2 key groups, 1 value group, fp16 scale each
    preset = kv_preset("rot4")
    assert preset.validate_only
    m = memory_summary(preset, geo, 8192)
    assert m.bits_per_element <= 4.5, m


def test_refusals(tiny_llama, tmp_path):
    from kvcompress.cache import CompressedCache

    with pytest.raises(ValidationError, match="kv.key.rotate=hadamard needs kv.key.granularity=token"):
        KVSpec(name="x", key={"rotate": "hadamard"})
    with pytest.raises(ValidationError, match="needs kv.key.symmetric=true"):
        KVSpec(name="x", key={"bits": 4, "granularity": "token", "symmetric": False})
    book = fitted_book(tiny_llama, name="rot", window=8, sink_tokens=0, **ROT)
    with pytest.raises(UserError, match="comparison format"):
        CompressedCache(book)
    r = run_cli("model=tiny_llama", "calib=smoke", "eval=smoke", "kv=rot4", cache_dir=tmp_path / "c")
    assert r.returncode != 0 and "validated but never shipped: add export=none" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_rot4_validates_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    r = run_cli("model=tiny_llama", "calib=smoke", "eval=smoke", "kv=rot4", "export=none", f"hydra.run.dir={run_dir}", cache_dir=tmp_path / "c")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads((run_dir / "report.json").read_text())
    assert rep["quality"]["key_clip_rate"] == 0 and rep["memory"]["breakdown_per_token"]["key_meta"] > 0
    assert rep["quality"]["kl_mean"] > 0
