"""Native formats: headroom on the per-layer scale (kv.headroom), chosen by fit from the calibration error."""
from __future__ import annotations

import pytest
import torch

from kvcompress.config import CalibConfig
from kvcompress.data import load_texts
from kvcompress.reference import NATIVE_QMAX, native_saturated
from kvcompress.spec import KVSpec
from kvcompress.stages.fit import HEADROOM_TOL, fit
from kvcompress.stages.profile import profile

from conftest import tiny_lm

CALIB = CalibConfig(name="smoke", n_samples=4, seq_len=64, batch_size=4, sample_tokens=64)


@pytest.fixture(scope="module")
def stats():
    return profile(tiny_lm(), CALIB, load_texts(CALIB), progress=False)


def _book(stats, fmt, **kw):
    return fit(stats, KVSpec(name=fmt, format=fmt, window=0, sink_tokens=0, **kw))


def _amax(stats):
    return torch.maximum(stats["k_absmax"].amax(dim=(1, 2)), stats["v_absmax"].amax(dim=(1, 2)))


def test_fp8_takes_free_headroom_int8_does_not(stats):
    fp8, int8 = _book(stats, "native_fp8"), _book(stats, "native_int8")
    h8, hi = torch.tensor(fp8.fit_info["headroom"]), torch.tensor(int8.fit_info["headroom"])
    assert (h8 >= 2).all(), h8  # FP8's error is relative per element: doubling the scale is free
    assert (hi == 1).all(), hi  # INT8's step grows with the scale
    torch.testing.assert_close(fp8.tensors["native_scale"], _amax(stats) * h8 / NATIVE_QMAX["native_fp8"])
    # the rule: the chosen headroom's calibration errors are within the tolerance of headroom 1
    for layer, errs in enumerate(fp8.fit_info["headroom_error"]):
        k1, v1 = errs["1.0"]
        kh, vh = errs[str(float(h8[layer]))]
        assert kh <= (1 + HEADROOM_TOL) * k1 and vh <= (1 + HEADROOM_TOL) * v1
    # a held-out key 1.4x beyond the calibrated amax saturates without headroom, not with it
    x = torch.tensor([1.4]) * _amax(stats)[0]
    assert native_saturated(x, _amax(stats)[0] / 448, "native_fp8").all()
    assert not native_saturated(x, fp8.tensors["native_scale"][0], "native_fp8").any()


def test_fixed_headroom_scales_the_scale(stats):
    one, three = _book(stats, "native_fp8", headroom=1.0), _book(stats, "native_fp8", headroom=3.0)
    torch.testing.assert_close(three.tensors["native_scale"], 3 * one.tensors["native_scale"])
    assert three.fit_info["headroom"] == [3.0] * len(three.fit_info["headroom"])


def test_headroom_below_one_is_rejected():
    with pytest.raises(ValueError, match="kv.headroom=0.5"):
        KVSpec(name="x", format="native_fp8", window=0, sink_tokens=0, headroom=0.5)
