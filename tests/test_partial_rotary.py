"""RoPE layouts other than Llama's half-split (i, i + D/2): partial rotary (Phi, GPT-NeoX, StableLM: RoPE rotates
the first r of D channels, pairs (i, i + r/2)) and interleaved (Cohere, GLM, ERNIE: pairs (2i, 2i + 1)). profile
reads the model's own pairs by probing its RoPE (profile.rope_pairs_of) and the RoPE-pair logic follows them, so the
rotation-invariant key bound holds as for a Llama. Pass-through channels are paired among themselves (never rotated)."""
from __future__ import annotations

import pytest
import torch
from conftest import SMOKE_CALIB

from kvcompress import reference as ref
from kvcompress.data import load_texts
from kvcompress.errors import UserError
from kvcompress.fold import fold_factors
from kvcompress.spec import KVSpec, native_spec
from kvcompress.stages.fit import fit
from kvcompress.stages.profile import profile


def test_rope_pairs_layouts():
    assert ref.rope_pairs(8).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and ref.is_half_split(ref.rope_pairs(8))
    p = ref.rope_pairs(12, 8)  # rotary pairs (i, i + 4), then the pass-through channels 8..11 as (8, 10), (9, 11)
    assert p.tolist() == [[0, 1, 2, 3, 8, 9], [4, 5, 6, 7, 10, 11]] and not ref.is_half_split(p)
    assert sorted(p.flatten().tolist()) == list(range(12))
    x = torch.randn(3, 12)
    xa, xb = ref.pair_halves(x, p)
    assert torch.equal(ref.pair_spread(xa, p, xb), x)
    with pytest.raises(ValueError, match="rotary_dim"):
        ref.rope_pairs(12, 7)


def test_ties_follow_the_pairs():
    p = ref.rope_pairs(12, 8)
    a = torch.rand(2, 3, 12) + 0.1
    f = fold_factors(a, a.amax(dim=(1, 2)), 1.0, tie_pairs=True, pairs=p)
    assert torch.equal(f[..., p[0]], f[..., p[1]]) and not torch.equal(f[..., :6], f[..., 6:])
    w = torch.rand(2, 12)
    bits = ref.waterfill_bits(w, 4, pairs=p)
    assert torch.equal(bits[..., p[0]], bits[..., p[1]]) and bits.float().mean() == 4


def _model(kind: str = "phi"):
    """Tiny random models of three RoPE layouts: Phi (half-split, 16 of 32 channels), Cohere (interleaved (2i, 2i + 1),
    every channel), GLM (interleaved, 16 of 32 channels)."""
    import transformers

    from kvcompress.models.base import Geometry, LoadedModel
    from kvcompress.models.tokenizer import ByteTokenizer

    cls, extra = {"phi": ("PhiConfig", {"partial_rotary_factor": 0.5}), "cohere": ("CohereConfig", {}),
                  "glm": ("GlmConfig", {"head_dim": 32, "partial_rotary_factor": 0.5})}[kind]
    cfg = getattr(transformers, cls)(vocab_size=257, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0, bos_token_id=256, eos_token_id=256, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    return LoadedModel(model, ByteTokenizer(), Geometry.from_hf_config(model.config), {"name": f"tiny_{kind}"})


def _phi():
    return _model("phi")


def test_rope_pairs_are_read_from_the_models_own_rope():
    """profile.rope_pairs_of probes the model's RoPE: half-split, interleaved and partial layouts alike."""
    from conftest import tiny_lm

    from kvcompress.stages.profile import rope_pairs_of

    llama = tiny_lm("llama")
    assert torch.equal(rope_pairs_of(llama.model, llama.geometry), ref.rope_pairs(32))
    inter = torch.stack([torch.arange(0, 16, 2), torch.arange(1, 16, 2)])
    expect = {"phi": ref.rope_pairs(32, 16), "cohere": torch.stack([torch.arange(0, 32, 2), torch.arange(1, 32, 2)]),
              "glm": torch.cat([inter, ref.rope_pairs(32, 16)[:, 8:]], 1)}
    for kind, pairs in expect.items():
        lm = _model(kind)
        assert torch.equal(rope_pairs_of(lm.model, lm.geometry), pairs), kind


def test_a_rope_the_probe_cannot_read_is_assumed_half_split_and_says_so(monkeypatch, caplog):
    """Where the model's RoPE cannot be probed (its apply_rotary_pos_emb raises, or turns channels without one mutual partner
    each), profile assumes Llama's half-split pairs and warns once per model class, naming why."""
    import sys

    from conftest import tiny_lm

    from kvcompress.stages import profile as profile_mod

    lm = tiny_lm("llama")
    modeling = sys.modules[type(lm.model.model.layers[0].self_attn).__module__]
    monkeypatch.setattr(profile_mod, "_ASSUMED", set())

    def broken(*a, **kw):
        raise RuntimeError("custom kernel only")

    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", broken)
    with caplog.at_level("WARNING", logger="kvcompress"):
        first = profile_mod.rope_pairs_of(lm.model, lm.geometry)
        again = profile_mod.rope_pairs_of(lm.model, lm.geometry)
    assert torch.equal(first, ref.rope_pairs(32)) and torch.equal(again, first)
    warned = [r.getMessage() for r in caplog.records if "RoPE could not be read" in r.getMessage()]
    assert len(warned) == 1 and "LlamaForCausalLM" in warned[0] and "RuntimeError: custom kernel only" in warned[0], warned

    def scrambled(q, k, cos, sin, *a, **kw):  # every channel also leaks into all the others: no pair structure to read
        return q + q.sum(-1, keepdim=True), k

    monkeypatch.setattr(profile_mod, "_ASSUMED", set())
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", scrambled)
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvcompress"):
        assert torch.equal(profile_mod.rope_pairs_of(lm.model, lm.geometry), ref.rope_pairs(32))
    assert any("exactly one partner" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("kind", ["phi", "cohere", "glm"])
def test_keys_do_not_clip_at_positions_the_calibration_never_saw(kind):
    """Tiny Phi (rotary 16 of 32 channels), Cohere (interleaved) and GLM (both): the sampled calibration keys, turned
    by RoPE to arbitrary angles on the model's own pairs (what later positions do), never exceed the tied symmetric
    key range. Negative: the ranges tied over (i, i + D/2), as before, let them exceed it."""
    from kvcompress.stages.profile import rope_pairs_of

    lm = _model(kind)
    stats = profile(lm, SMOKE_CALIB, load_texts(SMOKE_CALIB), progress=False)
    pairs = stats["rope_pairs"]
    assert torch.equal(pairs, rope_pairs_of(lm.model, lm.geometry)) and not ref.is_half_split(pairs)
    rotated = 16 if kind != "cohere" else 32
    spec = KVSpec(name="kv", key={"bits": 8, "granularity": "channel", "symmetric": True, "clip": "minmax", "tie_rope_pairs": True})
    book = fit(stats, spec)
    half = book.tensors["k_scale"] * ref.key_qmax(8)  # [L, H, D]
    k = stats["sample_k"].double()  # [L, N, H, D]
    g = torch.Generator().manual_seed(0)
    ang = torch.rand(k.shape[1], 1, 16, generator=g, dtype=torch.float64) * 2 * torch.pi
    ang[..., rotated // 2 :] = 0.0  # the pass-through pairs do not turn
    a, b = ref.pair_halves(k, pairs)
    turned = ref.pair_spread(a * ang.cos() - b * ang.sin(), pairs, a * ang.sin() + b * ang.cos())
    assert (turned.abs() <= half[:, None].double() * (1 + 1e-6)).all()
    # the same bound over (i, i + D/2): the sample's own pair norms, tied the old way
    ka, kb = ref.pair_halves(k)
    old = torch.cat([(ka.square() + kb.square()).sqrt().amax(1)] * 2, -1)  # [L, H, D]
    assert (turned.abs() > old[:, None] * 1.01).any()


def test_native_formats_choose_no_pair_rotation_for_partial_rotary():
    lm = _phi()
    stats = profile(lm, SMOKE_CALIB, load_texts(SMOKE_CALIB), progress=False)
    book = fit(stats, native_spec("native_fp8"))
    assert not book.tensors["fold_k_rot"].any() and book.fit_info["fold_pairs"].startswith("off: partial or interleaved rotary")
    fk, p = book.tensors["fold_k"], stats["rope_pairs"]
    assert torch.equal(fk[..., p[0]], fk[..., p[1]])
    with pytest.raises(UserError, match=r"kv.fold_pairs=true: this model's RoPE pairs are not \(i, i \+ head_dim/2\) \(partial or interleaved rotary: first pair \(0, 8\)\)"):
        fit(stats, native_spec("native_fp8").model_copy(update={"fold_pairs": True}))


def test_the_clipping_search_turns_keys_on_the_models_own_pairs():
    """The MSE clipping search moves its key sample to random positions: a partial-rotary model's stats carry its
    inverse frequencies per pair of rope_pairs (0 for the pass-through pairs), and the rotation keeps each pair's norm
    on those pairs (the pass-through channels unchanged)."""
    from kvcompress.observers.mse import rotate_to_random_positions

    lm = _phi()
    stats = profile(lm, SMOKE_CALIB, load_texts(SMOKE_CALIB), progress=False)
    inv, pairs = stats["rope_inv_freq"], stats["rope_pairs"]
    assert inv.shape == (16,) and (inv[:8] > 0).all() and (inv[8:] == 0).all()
    k = stats["sample_k"][0].transpose(0, 1).double()  # [H, N, D]
    turned = rotate_to_random_positions(k, inv, 4096, pairs=pairs)
    assert torch.equal(turned[..., 16:], k[..., 16:]) and not torch.allclose(turned[..., :16], k[..., :16])
    norm = lambda x: sum(h.square() for h in ref.pair_halves(x, pairs)).sqrt()  # noqa: E731
    torch.testing.assert_close(norm(turned), norm(k))


def test_the_report_names_an_interleaved_layout():
    from kvcompress.config import EvalConfig, TasksConfig
    from kvcompress.stages.validate import validate

    lm = _model("cohere")
    book = fit(profile(lm, SMOKE_CALIB, load_texts(SMOKE_CALIB), progress=False), KVSpec(name="kv", window=8, sink_tokens=2))
    ecfg = EvalConfig(name="smoke", split="heldout", n_windows=1, seq_len=64, batch_size=1, tasks=TasksConfig(names=[]))
    report = validate(lm, {"primary": book}, ecfg, progress=False)[0]
    assert "RoPE pairs of this model are (2i, 2i + 1), interleaved: key scales are tied over them; native formats choose no pair rotation (kv.fold_pairs)" in report.notes


def test_inspect_prints_the_models_own_pairs(tmp_path, capsys):
    """python -m kvcompress.inspect: the key outlier table per layer and head, post-RoPE pairs over the model's own
    RoPE pairs (named for an interleaved model); a missing file is one line and exit 2."""
    from kvcompress.inspect import main

    stats = profile(_model("cohere"), SMOKE_CALIB, load_texts(SMOKE_CALIB), progress=False)
    stats.save(tmp_path / "kv_stats.safetensors")
    assert main([str(tmp_path / "kv_stats.safetensors"), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "pair j is the model's own RoPE pair (0=(0,1), 1=(2,3)" in out and len(out.splitlines()) == 3 + 2 * 2
    assert main([str(tmp_path / "missing.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcompress: error:") and len(err.strip().splitlines()) == 1
    assert main([str(tmp_path / "kv_stats.safetensors"), "--top", "-3"]) == 2  # was a torch traceback
    err = capsys.readouterr().err
    assert err.startswith("kvcompress: error: --top -3: allowed: an integer >= 1") and len(err.strip().splitlines()) == 1
    assert main([str(tmp_path / "kv_stats.safetensors"), "--top", "1000"]) == 0  # more than the channels: all of them (was a traceback)
    assert len(capsys.readouterr().out.splitlines()) == 3 + 2 * 2
    assert main([str(tmp_path)]) == 2  # a directory: said so (was "does not exist")
    assert "is a directory; give the .safetensors file in it" in capsys.readouterr().err
