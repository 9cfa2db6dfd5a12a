"""The custom-tier TensorRT-LLM network (kvcompress/targets/trtllm_network.py), verified on CPU through
its oracle: the same decoder_step with the plugins replaced by the reference numerics must decode
like transformers' model through CompressedCache (the validated path). TensorRT itself is not run."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, fitted_book, tiny_lm

from kvcompress.kernels.layout import PackedKV
from kvcompress.targets import network_check as nc
from kvcompress.targets import network_oracle as no
from kvcompress.targets import trtllm_network as tn
from kvcompress.targets.trtllm_reader import rope_inv_freq

SPEC = dict(key={"bits": 8, "granularity": "channel", "symmetric": True, "clip": "mse", "tie_rope_pairs": True},
            value={"bits": 4, "granularity": "token", "group_size": 16, "symmetric": False}, window=6, sink_tokens=2)


def _bundle(tmp_path, lm, book, spec_overrides=None):
    hf = tmp_path / "hf"
    lm.model.save_pretrained(str(hf), safe_serialization=True)
    g = book.geometry
    variant = {"name": "test", "head_dim": g["head_dim"], "gqa": g["n_heads"] // g["n_kv_heads"], "key_bits": book.spec.key.bits,
               "value_bits": book.spec.value.bits, "group": book.value_group(0), "n_sink": book.spec.sink_tokens, "window": book.spec.window,
               "n_out": book.spec.outlier_channels}
    cfg = lm.model.config
    spec = no.network_spec(book, variant, cfg, lm.geometry, {"path": str(hf)}, splits=2)
    spec |= spec_overrides or {}
    no.write_network_files(tmp_path / "bundle", spec, no.plugin_params(book))
    return tmp_path / "bundle", hf


@pytest.mark.parametrize("kw", [{}, {"outlier_channels": 2}, {"key": {"bits": 4, "granularity": "channel", "symmetric": False, "clip": "mse", "tie_rope_pairs": True}}],
                         ids=["int8k_int4v", "outliers", "int4k"])
def test_network_graph_decodes_like_the_validated_cache(tmp_path, kw):
    lm = tiny_lm("llama")
    book = fitted_book(lm, **(SPEC | kw))
    bundle, hf = _bundle(tmp_path, lm, book)
    prompt = lm.tokenizer.encode("The plugin owns its cache.")[:12]
    res = no.check_network(bundle, hf, lm.model, book, prompt, max_new_tokens=8)
    assert res["crossed_into_store"] and res["tokens"] == 19
    # fp16 weights and fp16 GEMM outputs in the graph vs the fp32 model: small, not zero (the random
    # tiny model's logits are nearly flat, so top-1 can flip on a near-tie; the embedded model's export checks it)
    assert res["kl_mean"] < 1e-5 and res["max_abs_logit_diff"] < 0.02, res


def test_asymmetric_keys_ship_their_zero_points_in_the_graph(tmp_path):
    """kv=int8k_asym_rotv's keys (static, asymmetric, the arc ranges: a zero point per channel, one scale per RoPE pair)
    with its rotated values, on a tiny Qwen2 whose k biases give the keys an offset: the graph decodes like CompressedCache. Negative: the same bundle with the zero points
    dropped from the plugin constants (the plugins then encode and score keys about 0) is far off."""
    from kvcompress.config import kv_preset

    lm = tiny_lm("qwen2")
    with torch.no_grad():  # k biases: a pre-RoPE offset, which the slow pairs keep after RoPE (the zero points' reason)
        for layer in lm.model.model.layers:
            layer.self_attn.k_proj.bias.normal_(0.0, 6.0, generator=torch.Generator().manual_seed(1))
    pre = kv_preset("int8k_asym_rotv")
    book = fitted_book(lm, **(SPEC | {"key": pre.key.model_dump(), "value": {**SPEC["value"], "rotate": "hadamard"}}))
    z = book.tensors["k_zero"]
    D = book.geometry["head_dim"]
    assert float(z.abs().max()) > 0 and not torch.equal(z[..., : D // 2], z[..., D // 2 :])  # per channel, not tied
    assert torch.equal(book.tensors["k_scale"][..., : D // 2], book.tensors["k_scale"][..., D // 2 :])  # one scale per pair
    bundle, hf = _bundle(tmp_path, lm, book)
    assert tn.load_spec(bundle)["key_max_position"] == book.geometry["max_position"]  # where the keys' ranges hold
    prompt = lm.tokenizer.encode("The plugin owns its cache.")[:12]
    res = no.check_network(bundle, hf, lm.model, book, prompt, max_new_tokens=8)
    assert res["crossed_into_store"] and res["kl_mean"] < 1e-5 and res["max_abs_logit_diff"] < 0.02, res
    params = no.plugin_params(book)
    params["k_zero"] = np.zeros_like(params["k_zero"])
    params["k_zero_masked"] = np.zeros_like(params["k_zero_masked"])
    g = book.geometry
    variant = {"name": "test", "head_dim": D, "gqa": g["n_heads"] // g["n_kv_heads"], "key_bits": 8, "value_bits": 4, "group": book.value_group(0),
               "n_sink": book.spec.sink_tokens, "window": book.spec.window, "n_out": 0}
    no.write_network_files(tmp_path / "nozero", no.network_spec(book, variant, lm.model.config, lm.geometry, {"path": str(hf)}, splits=2), params)
    off = no.check_network(tmp_path / "nozero", hf, lm.model, book, prompt, max_new_tokens=8)
    assert off["kl_mean"] > 30 * max(res["kl_mean"], 1e-7), (off["kl_mean"], res["kl_mean"])  # measured: 65x


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_network_graph_of_mistral_and_qwen2_decodes_like_the_validated_cache(tmp_path, monkeypatch, arch):
    """export takes MistralForCausalLM (no sliding window) and Qwen2ForCausalLM: the custom-tier graph reads
    their HF directories (Qwen2's q/k/v biases added after the projections). Negative: the same graph with
    the biases dropped is far outside the tolerance."""
    lm = tiny_lm(arch)
    if arch == "qwen2":
        assert lm.model.model.layers[0].self_attn.k_proj.bias is not None
        with torch.no_grad():  # random-init biases are zero: make them matter
            for layer in lm.model.model.layers:
                for n in "qkv":
                    getattr(layer.self_attn, f"{n}_proj").bias.normal_(0.0, 0.5)
    book = fitted_book(lm, **SPEC)
    bundle, hf = _bundle(tmp_path, lm, book)
    prompt = lm.tokenizer.encode("The plugin owns its cache.")[:12]
    res = no.check_network(bundle, hf, lm.model, book, prompt, max_new_tokens=8)
    assert res["crossed_into_store"] and res["kl_mean"] < 1e-5 and res["max_abs_logit_diff"] < 0.02, res
    if arch == "qwen2":
        monkeypatch.setattr(tn, "_proj", lambda g, h, W, i, n: g.matmul(h, g.const(W[f"{i}.w{n}"]), transpose_b=True))
        dropped = no.check_network(bundle, hf, lm.model, book, prompt, max_new_tokens=8)
        assert dropped["kl_mean"] > 100 * max(res["kl_mean"], 1e-7), (dropped["kl_mean"], res["kl_mean"])


def test_network_graph_of_mixtral_routes_tokens_like_the_validated_cache(tmp_path, monkeypatch):
    """Mixtral's expert MLP in the graph (network.json arch.moe; the stored block_sparse_moe tensors): float32 router,
    top-k experts per token, softmax over their logits, each chosen expert's gated MLP: it decodes like transformers'
    MixtralForCausalLM through CompressedCache. Negatives (each > 100x the KL): one expert per token instead of two,
    w1/w3 (gate/up) read the other way round, and each expert's w2 (down) taken from the next expert."""
    lm = tiny_lm("mixtral")
    g = torch.Generator().manual_seed(0)  # the same routers in every process (the global generator's state depends on what ran before)
    with torch.no_grad():  # random-init routers are near-uniform: make the choice of experts matter
        for layer in lm.model.model.layers:
            layer.mlp.gate.weight.copy_(torch.randn(layer.mlp.gate.weight.shape, generator=g) * 0.5)
    book = fitted_book(lm, **SPEC)
    bundle, hf = _bundle(tmp_path, lm, book)
    spec = tn.load_spec(bundle)
    assert spec["arch"]["moe"] == {"num_experts": 4, "top_k": 2, "normalization_mode": 1}
    assert tn.load_hf_weights(hf, spec)["0.wg"].shape == (4, lm.model.config.intermediate_size, lm.model.config.hidden_size)
    prompt = lm.tokenizer.encode("The plugin owns its cache.")[:12]
    res = no.check_network(bundle, hf, lm.model, book, prompt, max_new_tokens=8)
    assert res["crossed_into_store"] and res["kl_mean"] < 1e-5 and res["max_abs_logit_diff"] < 0.02, res
    one, _ = _bundle(tmp_path / "top1", lm, book, {"arch": {**spec["arch"], "moe": {"num_experts": 4, "top_k": 1, "normalization_mode": 1}}})
    top1 = no.check_network(one, hf, lm.model, book, prompt, max_new_tokens=8)
    assert top1["kl_mean"] > 100 * max(res["kl_mean"], 1e-7), (top1["kl_mean"], res["kl_mean"])
    real = tn.load_hf_weights

    def swapped(*a, **k):
        w = real(*a, **k)
        for i in range(spec["arch"]["n_layers"]):
            w[f"{i}.wg"], w[f"{i}.wu"] = w[f"{i}.wu"], w[f"{i}.wg"]
        return w

    def rolled(*a, **k):  # expert e's down projection read as expert e+1's: the experts' weights must line up
        w = real(*a, **k)
        for i in range(spec["arch"]["n_layers"]):
            w[f"{i}.wd"] = np.roll(w[f"{i}.wd"], 1, axis=0)
        return w

    for bad in (swapped, rolled):
        monkeypatch.setattr(tn, "load_hf_weights", bad)
        wrong = no.check_network(bundle, hf, lm.model, book, prompt, max_new_tokens=8)
        assert wrong["kl_mean"] > 100 * max(res["kl_mean"], 1e-7), (bad.__name__, wrong["kl_mean"], res["kl_mean"])
    monkeypatch.setattr(tn, "load_hf_weights", real)
    with pytest.raises(ValueError, match="has no mixture-of-experts block but layer 0 has expert tensors"):
        real(hf, {**spec, "arch": {k: v for k, v in spec["arch"].items() if k != "moe"}})


@pytest.mark.parametrize("renorm", [True, False])
def test_network_graph_of_qwen3_moe_routes_tokens_like_the_validated_cache(tmp_path, renorm):
    """Qwen3-MoE in the graph: Qwen3's per-head q/k norms, and in every layer the experts as stored (mlp.gate, the
    router; mlp.experts.{e}.gate_proj/up_proj/down_proj), routed as the model routes: with norm_topk_prob (the released
    models) the top-k weights renormalised, without it the top k of the softmax over all experts as they are
    (network.json moe.normalization_mode 1 / 0). It decodes like transformers' Qwen3MoeForCausalLM through
    CompressedCache. Negative: the same bundle with the other normalization mode is > 100x the KL (a flat router, whose
    top two weights sum well below 1, and experts with 4x their down projections, so that the scale matters)."""
    lm = tiny_lm("qwen3_moe")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in lm.model.model.layers:
            layer.mlp.gate.weight.copy_(torch.randn(layer.mlp.gate.weight.shape, generator=g) * 0.05)
            layer.mlp.experts.down_proj.mul_(4.0)
            layer.mlp.gate.norm_topk_prob = renorm
    lm.model.config.norm_topk_prob = renorm
    book = fitted_book(lm, **SPEC)
    bundle, hf = _bundle(tmp_path, lm, book)
    spec = tn.load_spec(bundle)
    assert spec["arch"]["moe"] == {"num_experts": 4, "top_k": 2, "normalization_mode": int(renorm)}
    w = tn.load_hf_weights(hf, spec)
    cfg = lm.model.config
    assert w["0.wg"].shape == (4, cfg.moe_intermediate_size, cfg.hidden_size) and w["0.wr"].dtype == np.float32 and "0.kn" in w
    prompt = lm.tokenizer.encode("The plugin owns its cache.")[:12]
    res = no.check_network(bundle, hf, lm.model, book, prompt, max_new_tokens=8)
    assert res["crossed_into_store"] and res["kl_mean"] < 1e-5 and res["max_abs_logit_diff"] < 0.02, res
    other, _ = _bundle(tmp_path / "other", lm, book, {"arch": {**spec["arch"], "moe": {**spec["arch"]["moe"], "normalization_mode": 1 - int(renorm)}}})
    wrong = no.check_network(other, hf, lm.model, book, prompt, max_new_tokens=8)
    assert wrong["kl_mean"] > 100 * max(res["kl_mean"], 1e-7), (wrong["kl_mean"], res["kl_mean"])
    from safetensors.torch import load_file, save_file

    raw = load_file(str(next(hf.glob("*.safetensors"))))
    (tmp_path / "short").mkdir()
    save_file({k: v for k, v in raw.items() if k != "model.layers.0.mlp.experts.3.down_proj.weight"}, str(tmp_path / "short" / "model.safetensors"))
    with pytest.raises(ValueError, match="layer 0 lacks the gate, up or down weights of some of its 4 experts"):
        tn.load_hf_weights(tmp_path / "short", spec)
    (tmp_path / "fused").mkdir()  # the experts as transformers 5 holds them (gate_up_proj rows gate | up, down_proj): the same arrays
    save_file({k: v.contiguous() for k, v in lm.model.state_dict().items()}, str(tmp_path / "fused" / "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(str(tmp_path / "fused" / "model.safetensors"))
    fused = tn.load_hf_weights(tmp_path / "fused", spec)
    assert all(np.array_equal(fused[f"{i}.{n}"], w[f"{i}.{n}"]) for i in range(2) for n in ("wr", "wg", "wu", "wd"))


def test_value_rotation_folded_into_the_weights_decodes_like_the_validated_cache(tmp_path, monkeypatch):
    """int8k_int4v with kv.value.rotate=hadamard: the static-family plugins store whatever values the graph gives
    them, and the graph's W_v/W_o carry the rotation (network.json value_rotation): it decodes like
    CompressedCache, which rotates the values itself. Negatives: the same bundle without the fold (the plugins
    then quantize unrotated values: another format's error, > 10x), and a fold of W_v without W_o (a wiring
    error: another model, > 100x)."""
    lm = tiny_lm("llama")
    book = fitted_book(lm, **(SPEC | {"value": {**SPEC["value"], "rotate": "hadamard"}}))
    assert book.spec.value_rotation_folded and not book.spec.validate_only
    bundle, hf = _bundle(tmp_path, lm, book)
    assert tn.load_spec(bundle)["value_rotation"] == "hadamard" and tn.load_plugin_params(bundle)["v_rotation"].shape == (32, 32)
    prompt = lm.tokenizer.encode("The plugin owns its cache.")[:12]
    res = no.check_network(bundle, hf, lm.model, book, prompt, max_new_tokens=8)
    assert res["crossed_into_store"] and res["kl_mean"] < 1e-5 and res["max_abs_logit_diff"] < 0.02, res
    unfolded, _ = _bundle(tmp_path / "unfolded", lm, book, {"value_rotation": "none"})
    other = no.check_network(unfolded, hf, lm.model, book, prompt, max_new_tokens=8)
    assert other["kl_mean"] > 10 * max(res["kl_mean"], 1e-7), (other["kl_mean"], res["kl_mean"])
    from kvcompress.targets import network_weights as nw

    real = nw._fold_value_rotation

    def without_wo(w, raw, t, i, a, R):
        wo = w[f"{i}.wo"]
        real(w, raw, t, i, a, R)
        w[f"{i}.wo"] = wo

    monkeypatch.setattr(nw, "_fold_value_rotation", without_wo)
    wrong = no.check_network(bundle, hf, lm.model, book, prompt, max_new_tokens=8)
    assert wrong["kl_mean"] > 100 * max(res["kl_mean"], 1e-7), (wrong["kl_mean"], res["kl_mean"])


def test_a_wrong_rope_convention_is_caught(tmp_path):
    """Negative: the check is not vacuous -- the graph with a reversed RoPE frequency table (a wiring
    error an engine could ship) is separated from fp16 rounding by more than 10x in KL, on the same
    tiny random model whose nearly flat logits make every difference small."""
    lm = tiny_lm("llama")
    book = fitted_book(lm, **SPEC)
    g = book.geometry
    prompt = lm.tokenizer.encode("The plugin owns its cache.")[:12]
    good = no.check_network(*_bundle(tmp_path / "good", lm, book), lm.model, book, prompt, max_new_tokens=8)
    wrong = rope_inv_freq(g["head_dim"], g["rope_theta"], None).flip(0)
    bad = no.check_network(*_bundle(tmp_path / "bad", lm, book, {"rope_inv_freq": [float(f) for f in wrong]}), lm.model, book, prompt, max_new_tokens=8)
    assert bad["kl_mean"] > 10 * good["kl_mean"], (good, bad)


def test_cache_tails_are_the_kernel_layout():
    v = {"key_bits": 4, "value_bits": 4, "group": 16, "n_sink": 3, "window": 5, "n_out": 2}
    kv = PackedKV.empty(2, 4, 64, 11, n_sink=3, window=5, n_out=2, key_bits=4, value_bits=4, group=16)
    for name, (tail, dtype) in tn.cache_tails(v, 4, 64, 11).items():
        t = getattr(kv, name)
        assert tuple(t.shape[1:]) == tail and str(t.dtype).removeprefix("torch.") == dtype, name


@pytest.mark.parametrize("base,layers", [
    ("int8k_int4v", [{"key_bits": 16, "value_bits": 16}, {"key_bits": 8, "value_bits": 4}]),  # kv=auto's fp16 layer beside a k8v4 one
    ("rot8k_int4v", [{"key_bits": 8, "value_bits": 4}, {"key_bits": 7, "value_bits": 5}]),  # kv=rot_split's splits
    ("kivi_int4", None),  # token-grouped keys (kv=wf4 and kv=kivi_int4; wf4 needs 128-token calibration windows)
], ids=["fp16_layer", "split", "grouped"])
def test_shipped_cache_buffers_take_the_bytes_the_report_counts(tiny_stats, base, layers):
    """What a compressed token costs in the plugins' cache buffers (network cache_tails, one capacity for every
    layer) equals the byte accounting validate reports (reference.spec_cache_nbytes), layer by layer: an fp16
    layer's unused value-scale buffers are one row per head, not one per token."""
    from kvcompress.config import kv_preset
    from kvcompress.models.base import Geometry
    from kvcompress.spec import mixed_spec
    from kvcompress.targets.bundle import bundle_variants
    from kvcompress.stages.fit import fit

    import kvcompress.reference as ref

    spec = kv_preset(base).model_copy(update={"window": 128 if base == "kivi_int4" else 8, "sink_tokens": 2})
    spec = mixed_spec(spec, layers, name="m") if layers else spec
    book = fit(tiny_stats, spec)
    geom = Geometry(**book.geometry)
    variants, per_layer = bundle_variants(book, geom)
    by_name = {v.name: v.__dict__ for v in variants}
    H, D = geom.n_kv_heads, geom.head_dim
    step = 128  # compressed tokens added (whole key groups of the grouped family)

    def shipped(layer, cap):
        return sum(int(np.prod(shape)) * np.dtype(dt).itemsize for n, (shape, dt) in tn.cache_tails(by_name[per_layer[layer]], H, D, cap).items()
                   if not n.startswith(("sink_", "win_")))

    for i in range(geom.n_layers):
        one = Geometry(**{**book.geometry, "n_layers": 1})
        counted = [sum(v for k, v in ref.spec_cache_nbytes(book.layer_spec(i), one, spec.sink_tokens + spec.window + c).items()
                       if k not in ("static", "sinks", "window", "fp16_tokens")) for c in (step, 2 * step)]
        if book.layer_spec(i).is_baseline:  # an fp16 layer: every token is counted as fp16 K and V
            counted = [2 * 2 * D * H * c for c in (step, 2 * step)]
        assert shipped(i, 2 * step) - shipped(i, step) == counted[1] - counted[0], (i, per_layer[i])


def test_rotate_half_matrix_and_rope_tables():
    D = 8
    x = np.arange(D, dtype=np.float32)[None, None]
    np.testing.assert_array_equal((x @ tn.rotate_half_matrix(D))[0, 0], np.concatenate([-x[0, 0, D // 2:], x[0, 0, :D // 2]]))
    inv = rope_inv_freq(D, 10000.0, None).numpy()
    cos, sin = tn.rope_tables(inv, 5)
    assert cos.shape == (5, D) and np.allclose(cos[3, : D // 2], np.cos(3 * inv)) and np.allclose(sin[3, D // 2:], np.sin(3 * inv))


def test_greedy_loop_feeds_prompts_then_its_own_tokens():
    seen = []

    def step(ids, lens):
        seen.append((ids, lens))
        return torch.nn.functional.one_hot(torch.tensor([i + 1 for i in ids]) % 50, 50).float()

    out, logits = tn.greedy_loop(step, [[5, 6, 7], [9]], max_new_tokens=2)
    assert out == [[5, 6, 7, 8, 9], [9, 10, 11]] and logits.shape == (4, 2, 50)
    assert [s[1] for s in seen] == [[0, 0], [1, 1], [2, 2], [3, 3]] and seen[1][0] == [6, 10]


def test_build_engine_custom_tier_fails_clearly_without_trtllm(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "export" / "build_engine.py"), "--tier", "custom", "--bundle", str(tmp_path),
                        "--hf-dir", str(tmp_path), "--plugin-lib", str(tmp_path / "x.so"), "--out", str(tmp_path / "e")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "network.json" in r.stderr, r.stderr


def test_build_engine_refuses_a_max_seq_len_past_the_keys_positions(tmp_path):
    """A bundle whose asymmetric keys hold to position 64 (kv.key.max_position=64): build_engine.py --tier custom with
    --max-seq-len 128 stops in one line, exit 2, before reading weights or needing TensorRT-LLM; a bundle without the
    limit (symmetric keys) has no such check."""
    (tmp_path / tn.SPEC_FILE).write_text(json.dumps({"key_max_position": 64, "weights": {"hf_dir": None}}))
    args = [sys.executable, str(ROOT / "export" / "build_engine.py"), "--tier", "custom", "--bundle", str(tmp_path), "--hf-dir", str(tmp_path),
            "--plugin-lib", str(tmp_path / "x.so"), "--out", str(tmp_path / "e")]
    r = subprocess.run([*args, "--max-seq-len", "128"], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert "--max-seq-len 128 exceeds 64, the positions this bundle's asymmetric keys were fitted to hold at" in r.stderr
    for extra in (["--max-seq-len", "64"], []):  # without the flag, the default (8192) is capped at the keys' 64
        ok = subprocess.run([*args, *extra], capture_output=True, text=True)
        assert ok.returncode == 2 and "exceeds" not in ok.stderr and "has no *.safetensors" in ok.stderr, ok.stderr  # past the check, to the next
    tn.check_max_seq_len({}, 10**6)


def test_build_engine_reports_an_hf_dir_that_does_not_fit_the_bundle_in_one_line(tmp_path, monkeypatch, capsys):
    """build_engine.py --tier custom with a --hf-dir whose weights do not fit network.json (here: a dense model's
    directory for a Mixtral bundle) stops with one line and exit 2, not a traceback. TensorRT-LLM is faked as
    importable, so the run reaches the weights (tn.build_engine reads them first)."""
    import importlib.util as iu

    lm = tiny_lm("mixtral")
    book = fitted_book(lm, **SPEC)
    bundle, _ = _bundle(tmp_path, lm, book)
    dense = tmp_path / "dense"
    tiny_lm("llama").model.save_pretrained(str(dense), safe_serialization=True)
    spec_ = iu.spec_from_file_location("build_engine_under_test", ROOT / "export" / "build_engine.py")
    be = iu.module_from_spec(spec_)
    spec_.loader.exec_module(be)
    real_find = be.importlib.util.find_spec
    monkeypatch.setattr(be.importlib.util, "find_spec", lambda n, *a: object() if n == "tensorrt_llm" else real_find(n, *a))
    monkeypatch.setattr(tn, "build_engine", lambda bundle, hf_dir, *a: tn.load_hf_weights(hf_dir, tn.load_spec(bundle)))
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"")
    monkeypatch.setattr(sys, "argv", ["build_engine.py", "--tier", "custom", "--bundle", str(bundle), "--hf-dir", str(dense),
                                      "--plugin-lib", str(lib), "--out", str(tmp_path / "e")])
    capsys.readouterr()  # the setup's save_pretrained progress bars
    assert be.main() == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "has mixture-of-experts block but layer 0 has no expert tensors" in err, err


@pytest.mark.parametrize("rotate", ["none", "hadamard"])
def test_network_graph_with_per_layer_formats_decodes_like_the_validated_cache(tmp_path, rotate):
    """kv=auto: each layer its own variant (int4 keys with outliers in layer 0, int8 keys in layer 1)
    -- buffers of that layer's shapes, outlier indices padded across layers -- still decodes like
    CompressedCache with the same per-layer book; and each layer is wired to its own namespace.
    kv.value.rotate=hadamard: every layer's value rotation folded into its W_v/W_o (kv=auto with rotated values)."""
    from kvcompress.spec import KVSpec, LayerFormat, mixed_spec
    from kvcompress.targets.bundle import bundle_variants
    from kvcompress.stages.fit import fit
    from kvcompress.stages.profile import profile
    from kvcompress.data import load_texts
    from conftest import SMOKE_CALIB

    lm = tiny_lm("llama")
    base = KVSpec.model_validate({**SPEC, "name": "auto", "value": {**SPEC["value"], "rotate": rotate}})
    spec = mixed_spec(base, [LayerFormat(key_bits=4, value_bits=4, value_group=16, outlier_channels=2), LayerFormat(key_bits=8, value_bits=4, value_group=32)])
    assert spec.value_rotation_folded == (rotate == "hadamard")
    book = fit(profile(lm, SMOKE_CALIB, load_texts(SMOKE_CALIB), progress=False), spec)
    variants, per_layer = bundle_variants(book, lm.geometry)
    assert [v.name for v in variants] == ["d32_g3_auto_k4v4g16o2", "d32_g3_auto_k8v4"] and per_layer == [v.name for v in variants]
    layers = [{**variants[i].__dict__, "namespace": f"kvcompress.{variants[i].name}"} for i in range(2)]
    hf = tmp_path / "hf"
    lm.model.save_pretrained(str(hf), safe_serialization=True)
    net = no.network_spec(book, variants[0].__dict__, lm.model.config, lm.geometry, {"path": str(hf)}, splits=2, layers=layers)
    no.write_network_files(tmp_path / "bundle", net, no.plugin_params(book))
    assert no.plugin_params(book)["outlier_idx"].shape[-1] == 2 and net["value_rotation"] == rotate
    prompt = lm.tokenizer.encode("The plugin owns its cache.")[:12]
    res = no.check_network(tmp_path / "bundle", hf, lm.model, book, prompt, max_new_tokens=8)
    assert res["crossed_into_store"] and res["kl_mean"] < 1e-5 and res["max_abs_logit_diff"] < 0.02, res
    io = tn.engine_io(net, 16)
    assert io["past.0.k_payload"] == ((2, 16, 16), "uint8") and io["past.1.k_payload"] == ((2, 16, 32), "int8") and io["past.1.k_outliers"][0][-1] == 0

    class Spy(no.TorchGraph):
        seen = []

        def plugin(self, name, inputs, fields, n_out, namespace=tn.NAMESPACE):
            self.seen.append((name, namespace))
            return super().plugin(name, inputs, fields, n_out, namespace)

    g = Spy()
    P = tn.load_plugin_params(tmp_path / "bundle")
    W = tn.load_hf_weights(hf, net, P)
    tn.decoder_step(g, net, W, P, torch.tensor([5], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), no.empty_past(net, 1, 16), 16, 1, 32)
    assert [ns for _, ns in g.seen] == [layers[0]["namespace"]] * 2 + [layers[1]["namespace"]] * 2


def test_network_graph_with_an_fp16_layer_decodes_like_the_validated_cache(tmp_path):
    """kv=auto with an fp16 layer: that layer runs the static plugins built for key_bits = value_bits = 16 (the store
    holds its fp16 K and V; layout.py), and the network decodes like CompressedCache, whose fp16 layers keep every
    token in fp16. Negative: the same network with that layer quantized (k8v4 in its place) is > 10x further off."""
    from kvcompress.spec import KVSpec, LayerFormat, mixed_spec
    from kvcompress.targets.bundle import bundle_variants
    from kvcompress.stages.fit import fit
    from kvcompress.stages.profile import profile
    from kvcompress.data import load_texts
    from conftest import SMOKE_CALIB

    lm = tiny_lm("llama", layers=3)
    base = KVSpec.model_validate({**SPEC, "name": "auto"})
    spec = mixed_spec(base, [LayerFormat(key_bits=8, value_bits=4, value_group=32), LayerFormat(key_bits=16, value_bits=16),
                             LayerFormat(key_bits=4, value_bits=4, value_group=16, outlier_channels=2)])
    book = fit(profile(lm, SMOKE_CALIB, load_texts(SMOKE_CALIB), progress=False), spec)
    variants, per_layer = bundle_variants(book, lm.geometry)
    assert per_layer == ["d32_g3_auto_k8v4", "d32_g3_auto_fp16", "d32_g3_auto_k4v4g16o2"]
    fp16 = next(v for v in variants if v.name.endswith("fp16"))
    assert (fp16.key_bits, fp16.value_bits, fp16.group, fp16.n_out, fp16.n_sink, fp16.window) == (16, 16, 32, 0, 2, 6)
    hf = tmp_path / "hf"
    lm.model.save_pretrained(str(hf), safe_serialization=True)
    by_name = {v.name: v for v in variants}

    def bundle(names, d):
        layers = [{**by_name[n].__dict__, "namespace": f"kvcompress.{n}"} for n in names]
        net = no.network_spec(book, variants[0].__dict__, lm.model.config, lm.geometry, {"path": str(hf)}, splits=2, layers=layers)
        no.write_network_files(tmp_path / d, net, no.plugin_params(book))
        return net

    net = bundle(per_layer, "bundle")
    io = tn.engine_io(net, 16)
    assert io["past.1.k_payload"] == ((2, 16, 32), "float16") and io["past.1.v_payload"] == ((2, 16, 32), "float16")
    assert io["past.0.k_payload"] == ((2, 16, 32), "int8")
    prompt = lm.tokenizer.encode("The plugin owns its cache.")[:12]
    res = no.check_network(tmp_path / "bundle", hf, lm.model, book, prompt, max_new_tokens=8)
    assert res["crossed_into_store"] and res["kl_mean"] < 1e-5 and res["max_abs_logit_diff"] < 0.02, res
    bundle([per_layer[0], per_layer[0], per_layer[2]], "quantized")
    other = no.check_network(tmp_path / "quantized", hf, lm.model, book, prompt, max_new_tokens=8)
    assert other["kl_mean"] > 10 * max(res["kl_mean"], 1e-7), (other["kl_mean"], res["kl_mean"])


WF = dict(key={"bits": 4, "granularity": "channel", "symmetric": False, "clip": "minmax", "tie_rope_pairs": True, "group_tokens": 32, "alloc": "waterfill"},
          value={"bits": 4, "granularity": "token", "group_size": 0, "symmetric": True, "rotate": "hadamard"}, window=32, sink_tokens=2)


@pytest.mark.parametrize("mean", [4, 5, 3])
def test_grouped_network_graph_decodes_like_the_validated_cache(tmp_path, mean):
    """kv=wf4's family (and kv=wf5's: 40-byte key rows, 5-bit values in bit planes; kv=wf3's: 3-bit values as three planes) in the custom-tier network: KvcAppend / KvcDecodeAttention with the per-channel key widths
    and bit offsets (plugin_params k_bits, k_offsets), 10 cache buffers per layer, a key group written whole when
    its first token leaves the window; decodes like CompressedCache on tokens that cross into the store."""
    from kvcompress.targets.bundle import bundle_variants

    lm = tiny_lm("llama")
    with torch.no_grad():  # sharper attention: a random tiny model attends almost uniformly, so wrong keys would barely move its logits
        for layer in lm.model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
    book = fitted_book(lm, name="wf", **{**WF, "key": {**WF["key"], "bits": mean}, "value": {**WF["value"], "bits": mean}})
    bits = book.tensors["k_bits"]
    assert int(bits.min()) < mean < int(bits.max())  # uneven widths, as kv=wf4 / wf5
    variants, _ = bundle_variants(book, lm.geometry)
    v = variants[0].__dict__
    assert v["key_group_tokens"] == 32 and v["value_rotate"] and v["value_symmetric"]
    hf = tmp_path / "hf"
    lm.model.save_pretrained(str(hf), safe_serialization=True)
    spec = no.network_spec(book, v, lm.model.config, lm.geometry, {"path": str(hf)}, splits=2)
    params = no.plugin_params(book)
    assert set(params) == {"k_bits", "k_offsets"} and params["k_bits"].dtype == np.int32 and (params["k_bits"].sum(-1) == mean * lm.geometry.head_dim).all()
    no.write_network_files(tmp_path / "bundle", spec, params)
    assert tn.cache_names(tn.load_spec(tmp_path / "bundle")["variant"]) == tn.CACHE_GROUPED
    prompt = lm.tokenizer.encode(" ".join(["The plugin owns its cache and writes whole key groups."] * 8))[:44]
    assert len(prompt) == 44
    res = no.check_network(tmp_path / "bundle", hf, lm.model, book, prompt, max_new_tokens=8)
    assert res["crossed_into_store"] and res["tokens"] == 51  # 2 sinks + 32 window + 17 compressed: the first group written
    assert res["kl_mean"] < 1e-5 and res["max_abs_logit_diff"] < 0.02, res
    # negative: plugin constants that are not the validated allocation (widths mean -/+ 3 alternating, -/+ 2 at mean 3: no channel
    # under 1 bit; same bits per row) are caught
    from kvcompress import reference as ref

    d = min(3, mean - 1)
    wrong = torch.tensor([mean - d, mean + d]).repeat(lm.geometry.head_dim // 2).expand(*params["k_bits"].shape).contiguous()
    bad = {"k_bits": wrong.to(torch.int32).numpy(), "k_offsets": ref.bit_offsets(wrong).to(torch.int32).numpy()}
    no.write_network_files(tmp_path / "bad", spec, bad)
    worse = no.check_network(tmp_path / "bad", hf, lm.model, book, prompt, max_new_tokens=8)
    assert worse["kl_mean"] > 5 * res["kl_mean"], (res, worse)  # ~85x here (1.6e-6 vs 1.9e-8; ~3x with unscaled queries)


def test_grouped_cache_tails_are_the_kernel_layout():
    v = {"key_bits": 4, "value_bits": 4, "group": 64, "n_sink": 4, "window": 128, "n_out": 0, "key_group_tokens": 128,
         "value_symmetric": True, "value_rotate": True, "value_coded_min": False}
    bits = torch.full((3, 64), 4)
    bits[:, 0], bits[:, 1] = 7, 1
    kv = PackedKV.empty(2, 3, 64, 256, n_sink=4, window=128, n_out=0, key_bits=4, value_bits=4, group=64, key_group_tokens=128,
                        key_bits_table=bits, value_symmetric=True, value_rotate=True)
    tails = tn.cache_tails(v, 3, 64, 256)
    assert tuple(tails) == tn.CACHE_GROUPED
    for name, (tail, dtype) in tails.items():
        t = getattr(kv, name)
        assert tuple(t.shape[1:]) == tail and str(t.dtype).removeprefix("torch.") == dtype, name
    assert tn.store_capacity({"variant": v}, 4 + 128 + 129) == 256  # whole key groups


ROT8 = dict(key={"bits": 8, "granularity": "token", "symmetric": True, "rotate": "hadamard"},
            value={"bits": 4, "granularity": "token", "group_size": 16, "symmetric": False, "rotate": "hadamard", "min": "code"}, window=6, sink_tokens=2)
ROT4 = dict(key={"bits": 4, "granularity": "token", "symmetric": True, "rotate": "hadamard"},
            value={"bits": 4, "granularity": "token", "group_size": 0, "symmetric": True, "rotate": "hadamard"}, window=6, sink_tokens=2)


ROT7K5V = dict(ROT8, key=dict(ROT8["key"], bits=7), value=dict(ROT8["value"], bits=5))


@pytest.mark.parametrize("kw", [ROT8, ROT4, ROT7K5V], ids=["rot8k_int4v", "rot4", "rot7k_int5v"])
def test_per_token_network_graph_decodes_like_the_validated_cache(tmp_path, kw):
    """The per-token family (kv=rot8k_int4v, kv=rot4) in the custom-tier network: KvcAppend without key parameters,
    KvcDecodeAttention reading q and the query rotated in the graph (plugin_params q_rotation), 9 cache buffers with
    each token's key scales; decodes like CompressedCache across the window. Negative: the unrotated query where the
    rotated one belongs (an identity q_rotation) is refused by the reference plugin."""
    from kvcompress.targets.bundle import bundle_variants

    lm = tiny_lm("llama")
    book = fitted_book(lm, name="rot", **kw)
    variants, _ = bundle_variants(book, lm.geometry)
    v = variants[0].__dict__
    assert v["key_group"] == lm.geometry.head_dim and v["key_rotate"] and v["value_rotate"]
    hf = tmp_path / "hf"
    lm.model.save_pretrained(str(hf), safe_serialization=True)
    spec = no.network_spec(book, v, lm.model.config, lm.geometry, {"path": str(hf)}, splits=2)
    params = no.plugin_params(book)
    assert set(params) == {"q_rotation"}
    no.write_network_files(tmp_path / "bundle", spec, params)
    assert tn.cache_names(tn.load_spec(tmp_path / "bundle")["variant"]) == tn.CACHE_PER_TOKEN
    prompt = lm.tokenizer.encode("The plugin owns its cache.")[:12]
    res = no.check_network(tmp_path / "bundle", hf, lm.model, book, prompt, max_new_tokens=8)
    assert res["crossed_into_store"] and res["tokens"] == 19
    assert res["kl_mean"] < 1e-5 and res["max_abs_logit_diff"] < 0.02, res
    no.write_network_files(tmp_path / "bad", spec, {"q_rotation": np.eye(lm.geometry.head_dim, dtype=np.float32)})
    with pytest.raises(ValueError, match="qr is not the query in the keys' basis"):
        no.check_network(tmp_path / "bad", hf, lm.model, book, prompt, max_new_tokens=8)


def test_network_graph_of_a_yarn_model_decodes_like_the_validated_cache(tmp_path):
    """YaRN (network.json rope_scale, the graph's cos/sin tables scaled by it, frequencies from the reader's YaRN):
    the graph decodes like transformers' YaRN model through CompressedCache. Negative: without the scale, far off."""
    from conftest import tiny_lm

    lm = tiny_lm("llama")
    lm.model.config.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
    lm.model.model.rotary_emb.__init__(lm.model.config)  # the model's own YaRN frequencies and attention scaling
    with torch.no_grad():
        for layer in lm.model.model.layers:  # peaked attention: the scores' scale matters
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    book = fitted_book(lm, **SPEC)
    bundle, hf = _bundle(tmp_path, lm, book)
    spec = tn.load_spec(bundle)
    assert spec["rope_scale"] == pytest.approx(0.1 * np.log(4.0) + 1)
    prompt = lm.tokenizer.encode("The plugin owns its cache.")[:12]
    res = no.check_network(bundle, hf, lm.model, book, prompt, max_new_tokens=8)
    assert res["crossed_into_store"] and res["kl_mean"] < 1e-5 and res["max_abs_logit_diff"] < 0.02, res
    unscaled, _ = _bundle(tmp_path / "unscaled", lm, book, {"rope_scale": 1.0})
    other = no.check_network(unscaled, hf, lm.model, book, prompt, max_new_tokens=8)
    assert other["kl_mean"] > 100 * max(res["kl_mean"], 1e-7), (other["kl_mean"], res["kl_mean"])


def test_network_graph_of_qwen2_moe_adds_its_gated_shared_expert(tmp_path, monkeypatch):
    """Qwen2-MoE in the graph: Qwen2's q/k/v biases, the routed experts (top k of the softmax over all, not renormalised,
    as the released models route), and the shared expert every token runs, times sigmoid(h . w_gate) (network.json
    moe.shared_expert): it decodes like transformers' Qwen2MoeForCausalLM through CompressedCache. Negatives: the gate
    held at 0.5 for every token is > 100x the KL; a bundle without the shared expert is refused for these weights."""
    lm = tiny_lm("qwen2_moe")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in lm.model.model.layers:
            layer.mlp.gate.weight.copy_(torch.randn(layer.mlp.gate.weight.shape, generator=g) * 0.5)
            layer.mlp.shared_expert_gate.weight.copy_(torch.randn(layer.mlp.shared_expert_gate.weight.shape, generator=g) * 0.5)
            layer.mlp.shared_expert.down_proj.weight.mul_(4.0)  # a shared expert whose gate matters
            for n in "qkv":
                b = getattr(layer.self_attn, f"{n}_proj").bias
                b.copy_(torch.randn(b.shape, generator=g) * 0.5)
    book = fitted_book(lm, **SPEC)
    bundle, hf = _bundle(tmp_path, lm, book)
    spec = tn.load_spec(bundle)
    cfg = lm.model.config
    assert spec["arch"]["moe"] == {"num_experts": 4, "top_k": 2, "normalization_mode": 0, "shared_expert": cfg.shared_expert_intermediate_size}
    w = tn.load_hf_weights(hf, spec)
    assert w["0.sg"].shape == (cfg.shared_expert_intermediate_size, cfg.hidden_size) and w["0.sgate"].shape == (1, cfg.hidden_size) and "0.bq" in w
    prompt = lm.tokenizer.encode("The plugin owns its cache.")[:12]
    res = no.check_network(bundle, hf, lm.model, book, prompt, max_new_tokens=8)
    assert res["crossed_into_store"] and res["kl_mean"] < 1e-5 and res["max_abs_logit_diff"] < 0.02, res
    real = tn._moe_mlp

    def half_gate(g_, h, W, i, *a, **k):  # sigmoid(0) = 0.5 for every token instead of each token's own gate
        return real(g_, h, {**W, f"{i}.sgate": np.zeros_like(W[f"{i}.sgate"])}, i, *a, **k)

    monkeypatch.setattr(tn, "_moe_mlp", half_gate)
    wrong = no.check_network(bundle, hf, lm.model, book, prompt, max_new_tokens=8)
    assert wrong["kl_mean"] > 100 * max(res["kl_mean"], 1e-7), (wrong["kl_mean"], res["kl_mean"])
    with pytest.raises(ValueError, match="network.json has no shared expert but layer 0 has a mlp.shared_expert_gate"):
        tn.load_hf_weights(hf, {**spec, "arch": {**spec["arch"], "moe": {k: v for k, v in spec["arch"]["moe"].items() if k != "shared_expert"}}})


def test_engine_memory_counts_the_graphs_fp16_weights_and_its_cache_buffers(tmp_path):
    """engine_memory (read from the safetensors headers, no tensor loaded) equals the fp16 constants load_hf_weights
    gives the graph (a tied head once) and the past buffers empty_past allocates for the batch."""
    lm = tiny_lm("llama")
    book = fitted_book(lm, **SPEC)
    bundle, hf = _bundle(tmp_path, lm, book)
    spec = tn.load_spec(bundle)
    W = tn.load_hf_weights(hf, spec)
    mem = tn.engine_memory(spec, hf, 3, 40)
    assert mem["weights_bytes"] == sum(a.nbytes for a in {id(a): a for a in W.values()}.values()) > 0
    past = no.empty_past(spec, 3, tn.store_capacity(spec, 40))
    assert mem["cache_bytes"] == sum(t.numel() * t.element_size() for layer in past for t in layer) + 3 * 2 * 4  # + input_ids, lens
    assert tn.engine_memory(spec, hf, 6, 40)["cache_bytes"] == 2 * mem["cache_bytes"]
    assert "on one GPU" in tn.memory_line(mem)


def _build_engine_with_fake_trtllm(monkeypatch, name: str):
    """export/build_engine.py as a module, with tensorrt_llm faked as importable (the build itself is faked by the test)."""
    import importlib.util as iu

    spec_ = iu.spec_from_file_location(f"build_engine_under_test_{name}", ROOT / "export" / "build_engine.py")
    be = iu.module_from_spec(spec_)
    spec_.loader.exec_module(be)
    real_find = be.importlib.util.find_spec
    monkeypatch.setattr(be.importlib.util, "find_spec", lambda n, *a: object() if n == "tensorrt_llm" else real_find(n, *a))
    return be


def test_build_engine_refuses_an_engine_larger_than_the_gpu_in_one_line(tmp_path, monkeypatch, capsys):
    """build_engine.py --tier custom states the engine's weights and cache, and stops with one line and exit 2 when they exceed
    the GPU's memory (naming --tp, which divides them across GPUs); within it, it goes on to the build (faked here: TensorRT-LLM is not installable)."""
    lm = tiny_lm("llama")
    book = fitted_book(lm, **SPEC)
    bundle, hf = _bundle(tmp_path, lm, book)
    be = _build_engine_with_fake_trtllm(monkeypatch, "mem")
    built = []
    monkeypatch.setattr(tn, "build_engine", lambda *a: built.append(a) or Path(a[3]))
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"")
    monkeypatch.setattr(sys, "argv", ["build_engine.py", "--tier", "custom", "--bundle", str(bundle), "--hf-dir", str(hf),
                                      "--plugin-lib", str(lib), "--out", str(tmp_path / "e"), "--max-batch-size", "2", "--max-seq-len", "64"])
    mem = tn.engine_memory(tn.load_spec(bundle), hf, 2, 64)
    need = mem["weights_bytes"] + mem["cache_bytes"]
    capsys.readouterr()
    monkeypatch.setattr(be, "gpu_bytes", lambda: need - 1)
    assert be.main() == 2 and not built
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: the custom-tier engine needs fp16 weights") and "raise --tp" in err, err
    monkeypatch.setattr(be, "gpu_bytes", lambda: need)
    assert be.main() == 0 and len(built) == 1
    assert "custom-tier engine: fp16 weights" in capsys.readouterr().out


def test_the_engine_check_file_and_its_comparison(tmp_path, monkeypatch):
    """The export keeps its network check for the GPU host (trtllm_network.CHECK_FILE): the tokens and the validated decoding's
    distributions, coarsened to the top-k tokens and one bucket. check_against_reference, which build_engine.py --tier custom
    --check runs on the engine, passes the CPU oracle's step with the KL the export measured (never above the full KL), and
    fails a step that reads the cache one position off (RoPE at the wrong angle), and one whose values are dropped."""
    lm = tiny_lm("llama")
    V = lm.model.config.vocab_size
    monkeypatch.setattr(nc, "CHECK_TOP_K", V // 4)  # the tiny vocabulary: keep a quarter, so the rest bucket is exercised
    book = fitted_book(lm, **SPEC)
    bundle, hf = _bundle(tmp_path, lm, book)
    prompt = lm.tokenizer.encode("The plugin owns its cache.")[:12]
    res = no.check_network(bundle, hf, lm.model, book, prompt, max_new_tokens=8, kl_tolerance=1e-5)
    assert res["check_file"] == tn.CHECK_FILE and res["kl_mean"] < 1e-5
    ids, ref, meta = nc.load_check(bundle / nc.CHECK_FILE)
    assert meta["top_k"] == V // 4
    assert len(ids) == res["tokens"] + 1 and ref["idx"].shape == (res["tokens"], V // 4) and meta["kl_tolerance"] == 1e-5
    assert float((ref["logp"].exp().sum(-1) + ref["rest"].exp() - 1).abs().max()) < 1e-9  # the buckets hold all the mass
    assert float(ref["rest"].exp().min()) > 0.01  # and the rest holds some of it
    spec, P = tn.load_spec(bundle), tn.load_plugin_params(bundle)
    W = tn.load_hf_weights(hf, spec, P)
    n = len(ids) + 1

    good = tn.check_against_reference(no.oracle_step(spec, W, P, 1, n), bundle / tn.CHECK_FILE)
    # at most the full KL (both in float64), and a share of it: here the flat tiny model leaves >= 68% of the mass in the rest (measured: 31%)
    assert good["pass"] and good["tokens"] == res["tokens"] and 0.25 * res["kl_mean"] < good["kl_mean"] <= res["kl_mean"] * (1 + 1e-9)
    assert good["kl_mean"] == pytest.approx(meta["oracle_kl_mean"], rel=1e-6, abs=1e-12)  # the same graph, the same numbers
    step = no.oracle_step(spec, W, P, 1, n)
    shifted = tn.check_against_reference(lambda i, lens: step(i, [x + 1 for x in lens]), bundle / tn.CHECK_FILE)
    no_v = dict(W) | {f"{i}.wv": np.zeros_like(W[f"{i}.wv"]) for i in range(spec["arch"]["n_layers"])}
    dropped = tn.check_against_reference(no.oracle_step(spec, no_v, P, 1, n), bundle / tn.CHECK_FILE)
    for bad in (shifted, dropped):
        assert not bad["pass"] and bad["kl_mean"] > 10 * max(good["kl_mean"], 1e-7), (bad, good)


def test_build_engine_check_passes_the_validated_engine_and_fails_a_wrong_one(tmp_path, monkeypatch, capsys):
    """build_engine.py --tier custom --check ENGINE: one line and exit 2 without an engine, without the bundle's check file
    or without TensorRT-LLM; with them it feeds the check file's tokens through the engine's step (here the CPU oracle
    stands in for the engine, TensorRT-LLM faked as importable) and prints PASS (exit 0), or FAIL (exit 1) for an engine
    whose cache reads are one position off."""
    import importlib.util as iu

    lm = tiny_lm("llama")
    book = fitted_book(lm, **SPEC)
    bundle, hf = _bundle(tmp_path, lm, book)
    prompt = lm.tokenizer.encode("The plugin owns its cache.")[:12]
    no.check_network(bundle, hf, lm.model, book, prompt, max_new_tokens=8, kl_tolerance=1e-5)
    spec_ = iu.spec_from_file_location("build_engine_under_test_check", ROOT / "export" / "build_engine.py")
    be = iu.module_from_spec(spec_)
    spec_.loader.exec_module(be)
    eng = tmp_path / "engine"

    def run(*extra):
        monkeypatch.setattr(sys, "argv", ["build_engine.py", "--tier", "custom", "--check", str(eng), *extra])
        capsys.readouterr()
        rc = be.main()
        return rc, capsys.readouterr()

    rc, out = run()
    assert rc == 2 and out.err.count("\n") == 1 and "has no rank0.engine + config.json" in out.err, out.err
    eng.mkdir()
    (eng / "rank0.engine").write_bytes(b"")
    (eng / "config.json").write_text(json.dumps({"bundle": str(tmp_path / "elsewhere")}))
    rc, out = run()
    assert rc == 2 and out.err.count("\n") == 1 and f"{tn.CHECK_FILE} does not exist" in out.err, out.err
    (eng / "config.json").write_text(json.dumps({"bundle": str(bundle), "max_seq_len": 64}))
    rc, out = run()
    assert rc == 2 and out.err.count("\n") == 1 and "tensorrt_llm is not importable" in out.err, out.err
    real_find = be.importlib.util.find_spec
    monkeypatch.setattr(be.importlib.util, "find_spec", lambda n, *a: object() if n == "tensorrt_llm" else real_find(n, *a))
    spec, P = tn.load_spec(bundle), tn.load_plugin_params(bundle)
    W = tn.load_hf_weights(hf, spec, P)
    monkeypatch.setattr(tn, "engine_step", lambda d, B: no.oracle_step(spec, W, P, B, 64))
    rc, out = run()
    assert rc == 0 and out.out.startswith("PASS: the engine vs the validated decoding on 19 tokens"), out
    def off_by_one(d, B):
        step = no.oracle_step(spec, W, P, B, 64)
        return lambda ids, lens: step(ids, [x + 1 for x in lens])

    monkeypatch.setattr(tn, "engine_step", off_by_one)
    rc, out = run("--check-file", str(bundle / tn.CHECK_FILE))
    assert rc == 1 and out.out.startswith("FAIL: the engine vs the validated decoding"), out
    # a check file from another export (a larger vocabulary) and an engine too short for the tokens: one line, exit 2
    ids, ref, meta = nc.load_check(bundle / nc.CHECK_FILE)
    nc.save_check(tmp_path / "other.safetensors", ids, ref | {"idx": ref["idx"] + 10**6}, meta)
    rc, out = run("--check-file", str(tmp_path / "other.safetensors"))
    assert rc == 2 and out.err.count("\n") == 1 and "past the engine's vocabulary" in out.err, out.err
    (eng / "config.json").write_text(json.dumps({"bundle": str(bundle), "max_seq_len": 8}))
    rc, out = run()
    assert rc == 2 and out.err.count("\n") == 1 and "more than the engine's max_seq_len 8" in out.err, out.err
    (eng / "config.json").write_text("{not json")
    rc, out = run()
    assert rc == 2 and out.err.count("\n") == 1 and "is not JSON" in out.err, out.err


def _routed(lm):
    """Random-init routers are near-uniform and Qwen2-MoE's shared-expert gate near 0.5: make both matter (as the MoE tests above)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in lm.model.model.layers:
            mlp = getattr(layer, "block_sparse_moe", None) or layer.mlp
            if hasattr(mlp, "gate") and hasattr(mlp.gate, "weight"):
                mlp.gate.weight.copy_(torch.randn(mlp.gate.weight.shape, generator=g) * 0.5)
            if hasattr(mlp, "shared_expert_gate"):
                mlp.shared_expert_gate.weight.copy_(torch.randn(mlp.shared_expert_gate.weight.shape, generator=g) * 0.5)
                mlp.shared_expert.down_proj.weight.mul_(4.0)
    return lm


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral", "qwen2_moe"])
def test_tensor_parallel_graph_decodes_like_the_validated_cache(tmp_path, arch):
    """build_engine.py --tp 2: each rank holds half the query and kv heads (with their plugin constants and cache buffers)
    and half of each MLP's, expert's and shared expert's intermediate columns; all-reduces add the ranks' partial sums after
    the attention's and the MLP's output projections. The two ranks, run as the oracle's threads, decode like
    CompressedCache as closely as one rank does (Qwen2: q/k/v biases split with their heads; Mixtral and Qwen2-MoE:
    replicated routers, split experts), and pass the engine check against the export's check file."""
    lm = tiny_lm(arch)
    if "moe" in arch or arch == "mixtral":
        _routed(lm)
    book = fitted_book(lm, **SPEC)
    bundle, hf = _bundle(tmp_path, lm, book)
    prompt = lm.tokenizer.encode("The plugin owns its cache.")[:12]
    one = no.check_network(bundle, hf, lm.model, book, prompt, max_new_tokens=8, kl_tolerance=1e-5)
    two = no.check_network(bundle, hf, lm.model, book, prompt, max_new_tokens=8, tp=2)
    assert two["crossed_into_store"] and two["tokens"] == one["tokens"]
    assert two["kl_mean"] < 1e-5 and two["max_abs_logit_diff"] < 0.02 and two["kl_mean"] < 2 * one["kl_mean"] + 1e-7, (one, two)
    spec, P = tn.load_spec(bundle), tn.load_plugin_params(bundle)
    W = tn.load_hf_weights(hf, spec, P)
    W0, P0 = tn.shard(W, P, spec, 2, 0)
    a = spec["arch"]
    assert W0["0.wq"].shape[0] == a["n_heads"] // 2 * a["head_dim"] and W0["0.wk"].shape[0] == a["n_kv_heads"] // 2 * a["head_dim"]
    assert P0["k_scale"].shape[1] == a["n_kv_heads"] // 2 and W0["embed"] is W["embed"]
    r = tn.check_against_reference(no.oracle_step(spec, W, P, 1, one["tokens"] + 2, tp=2), bundle / tn.CHECK_FILE)
    assert r["pass"] and r["kl_mean"] < 1e-5, r


def test_tensor_parallel_ranks_must_line_up(tmp_path, monkeypatch):
    """Negatives of the tensor-parallel graph: ranks whose kv heads are the other rank's (query head h must read kv head
    h // G of its own rank's cache) are > 100x the KL; ranks without the all-reduce (each keeps its partial sum) diverge,
    and the oracle says so instead of returning rank 0's logits; a --tp that does not divide the kv heads is refused in one line."""
    lm = tiny_lm("llama")
    book = fitted_book(lm, **SPEC)
    bundle, hf = _bundle(tmp_path, lm, book)
    prompt = lm.tokenizer.encode("The plugin owns its cache.")[:12]
    good = no.check_network(bundle, hf, lm.model, book, prompt, max_new_tokens=8, tp=2)
    real = tn.shard

    def crossed(W, P, spec, tp, rank):
        out, p = real(W, P, spec, tp, rank)
        other, _ = real(W, P, spec, tp, tp - 1 - rank)
        return out | {k: other[k] for k in out if k.endswith((".wk", ".wv"))}, p

    monkeypatch.setattr(tn, "shard", crossed)
    wrong = no.check_network(bundle, hf, lm.model, book, prompt, max_new_tokens=8, tp=2)
    assert wrong["kl_mean"] > 100 * max(good["kl_mean"], 1e-7), (wrong["kl_mean"], good["kl_mean"])
    monkeypatch.setattr(tn, "shard", real)
    monkeypatch.setattr(tn, "_reduce", lambda g, x, tp: x)
    with pytest.raises(RuntimeError, match="rank 1's logits differ from rank 0's"):
        no.check_network(bundle, hf, lm.model, book, prompt, max_new_tokens=8, tp=2)
    spec = tn.load_spec(bundle)
    with pytest.raises(tn.WeightsMismatch, match=r"^--tp 3 splits neither the model's 2 kv heads .* allowed: 1, 2, 6$"):
        tn.shard({}, {}, spec, 3, 0)


@pytest.mark.parametrize("arch,heads,kv_heads,tp", [("llama", 8, 2, 4), ("qwen2", 4, 1, 4), ("mixtral", 8, 2, 4)])
def test_tensor_parallel_above_the_kv_heads_replicates_them(tmp_path, arch, heads, kv_heads, tp):
    """--tp above the kv heads (a multiple of them dividing the query heads): the tp / n_kv ranks of a kv head each hold it
    (its projections, plugin constants and one head's cache buffers) and its whole query group, so the decode plugin runs
    with the G it was compiled for; each keeps its own tp-th of the query heads (att_heads) for its columns of the output
    projection. The ranks decode like CompressedCache as closely as one rank does and pass the engine check (Qwen2: biases,
    one kv head over 4 ranks; Mixtral: experts split 4 ways). Negative: ranks that keep the wrong heads of their group."""
    lm = tiny_lm(arch, heads=heads, kv_heads=kv_heads)
    if arch == "mixtral":
        _routed(lm)
    book = fitted_book(lm, **SPEC)
    bundle, hf = _bundle(tmp_path, lm, book)
    prompt = lm.tokenizer.encode("The plugin owns its cache.")[:12]
    one = no.check_network(bundle, hf, lm.model, book, prompt, max_new_tokens=8, kl_tolerance=1e-5)
    many = no.check_network(bundle, hf, lm.model, book, prompt, max_new_tokens=8, tp=tp)
    assert many["crossed_into_store"] and many["tokens"] == one["tokens"]
    assert many["kl_mean"] < 1e-5 and many["max_abs_logit_diff"] < 0.02 and many["kl_mean"] < 2 * one["kl_mean"] + 1e-7, (one, many)
    spec, P = tn.load_spec(bundle), tn.load_plugin_params(bundle)
    W = tn.load_hf_weights(hf, spec, P)
    D, G, rep = spec["arch"]["head_dim"], heads // kv_heads, tp // kv_heads
    for rank in range(tp):
        Wr, Pr = tn.shard(W, P, spec, tp, rank)
        c = rank // rep  # the rank's kv head
        assert np.array_equal(Wr["0.wk"], W["0.wk"][c * D: (c + 1) * D]) and np.array_equal(Wr["0.wq"], W["0.wq"][c * G * D: (c + 1) * G * D])
        assert np.array_equal(Pr["k_scale"], P["k_scale"][:, c: c + 1]) and Wr["att_heads"].dtype == np.int32
        own = (rank % rep) * (G // rep) + np.arange(G // rep)  # its query heads within the group
        assert np.array_equal(Wr["att_heads"], own) and np.array_equal(Wr["0.wo"], W["0.wo"][:, rank * heads // tp * D: (rank + 1) * heads // tp * D])
    assert tn.kv_heads_per_rank(spec, tp) == 1 and tn.default_splits(spec, tp) == spec["splits"]
    r = tn.check_against_reference(no.oracle_step(spec, W, P, 1, one["tokens"] + 2, tp=tp), bundle / tn.CHECK_FILE)
    assert r["pass"] and r["kl_mean"] < 1e-5, r
    real = tn.shard

    def wrong_heads(W, P, spec, tp, rank):
        out, p = real(W, P, spec, tp, rank)
        return out | {"att_heads": out["att_heads"][::-1].copy() if G // rep > 1 else (out["att_heads"] + 1) % G}, p

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tn, "shard", wrong_heads)
        wrong = no.check_network(bundle, hf, lm.model, book, prompt, max_new_tokens=8, tp=tp)
    # measured: 46x (Qwen2), 99x (Llama), 212x (Mixtral) the right heads' KL (random tiny models: attention moves logits little)
    assert wrong["kl_mean"] > 20 * max(many["kl_mean"], 1e-7), (wrong["kl_mean"], many["kl_mean"])
    mem = tn.engine_memory(spec, hf, 3, 40, tp)  # a rank's fp16 constants: its kv head's whole query group, a tp-th of the rest
    W0, _ = tn.shard(W, {}, spec, tp, 0)
    assert mem["weights_bytes"] == sum(a.nbytes for k, a in {id(a): (k, a) for k, a in W0.items()}.values() if k != "att_heads")
    past = no.empty_past(spec, 3, tn.store_capacity(spec, 40), tp=tp)
    assert mem["cache_bytes"] == sum(t.numel() * t.element_size() for layer in past for t in layer) + 3 * 2 * 4


def test_engine_memory_per_tensor_parallel_rank(tmp_path):
    """engine_memory at tp 2 (from the safetensors headers) equals the fp16 constants of one rank's shard (replicated
    embeddings, norms and head counted whole) and half the cache buffers; the line says each of 2 GPUs."""
    lm = tiny_lm("llama")
    book = fitted_book(lm, **SPEC)
    bundle, hf = _bundle(tmp_path, lm, book)
    spec = tn.load_spec(bundle)
    W0, _ = tn.shard(tn.load_hf_weights(hf, spec), {}, spec, 2, 0)
    one, two = tn.engine_memory(spec, hf, 3, 40), tn.engine_memory(spec, hf, 3, 40, tp=2)
    assert two["weights_bytes"] == sum(a.nbytes for a in {id(a): a for a in W0.values()}.values()) < one["weights_bytes"]
    past = no.empty_past(spec, 3, tn.store_capacity(spec, 40), tp=2)
    assert two["cache_bytes"] == sum(t.numel() * t.element_size() for layer in past for t in layer) + 3 * 2 * 4
    assert two["tp"] == 2 and "on each of 2 GPUs" in tn.memory_line(two)
    # the export's plan: the fewest GPUs that hold one sequence's engine, else the most the kv heads allow, said not to fit
    need = {tp: m["weights_bytes"] + m["cache_bytes"] for tp in (1, 2) for m in [tn.engine_memory(spec, hf, 1, 40, tp)]}
    assert tn.fewest_gpus(spec, hf, 40, need[1])["tp"] == 1
    assert tn.fewest_gpus(spec, hf, 40, need[1] - 1) == tn.engine_memory(spec, hf, 1, 40, 2) | {"fits": True}
    assert tn.fewest_gpus(spec, hf, 40, need[2] - 1) == tn.engine_memory(spec, hf, 1, 40, 2) | {"fits": False}


def test_build_engine_tp_is_checked_and_passed_to_the_build(tmp_path, monkeypatch, capsys):
    """build_engine.py --tier custom --tp N: a tp that does not divide the kv heads is refused in one line (exit 2) before any
    build; a valid one sizes the per-GPU memory at that tp and reaches the (faked) build, which is told the tp."""
    lm = tiny_lm("llama")
    book = fitted_book(lm, **SPEC)
    bundle, hf = _bundle(tmp_path, lm, book)
    be = _build_engine_with_fake_trtllm(monkeypatch, "tp")
    built = []
    monkeypatch.setattr(tn, "build_engine", lambda *a: built.append(a) or Path(a[3]))
    monkeypatch.setattr(be, "gpu_bytes", lambda: None)
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"")
    base = ["build_engine.py", "--tier", "custom", "--bundle", str(bundle), "--hf-dir", str(hf), "--plugin-lib", str(lib),
            "--out", str(tmp_path / "e"), "--max-batch-size", "2", "--max-seq-len", "64"]
    monkeypatch.setattr(sys, "argv", base + ["--tp", "4"])
    capsys.readouterr()
    assert be.main() == 2 and not built
    err = capsys.readouterr().err
    assert err == ("error: --tp 4 splits neither the model's 2 kv heads (a divisor of 2) nor its 6 query heads over replicated kv heads "
                   "(a multiple of 2 dividing 6); allowed: 1, 2, 6\n"), err
    monkeypatch.setattr(sys, "argv", base + ["--tp", "2"])
    assert be.main() == 0 and len(built) == 1 and built[0][-1] == 2
    out = capsys.readouterr().out
    assert "on each of 2 GPUs" in out and "mpirun -n 2 python build_engine.py --tier custom --run" in out, out


def test_build_engine_run_refuses_what_the_engine_cannot_take_in_one_line(tmp_path, monkeypatch, capsys):
    """build_engine.py --tier custom --run: more prompts than the engine's max_batch, and a tensor-parallel engine outside
    mpirun -n tp (TensorRT-LLM faked as importable; the checks come before any engine is loaded), end in one line, exit 2."""
    from kvcompress.models.synthetic import byte_tokenizer

    be = _build_engine_with_fake_trtllm(monkeypatch, "run")
    hf = tmp_path / "hf"
    byte_tokenizer().save_pretrained(str(hf))
    eng = tmp_path / "engine"
    eng.mkdir()
    (eng / "rank0.engine").write_bytes(b"")
    cfg = {"kvcompress_custom_tier": {}, "cap": 8, "max_batch": 1, "max_seq_len": 64, "hf_dir": str(hf), "plugin_lib": "", "tp": 1}
    for extra, want in (({}, "2 sequences exceed the engine's max_batch 1"),
                        ({"max_batch": 2, "tp": 2}, "the engine has 2 tensor-parallel ranks: run this under mpirun -n 2")):
        (eng / "config.json").write_text(json.dumps(cfg | extra))
        if extra:
            import types

            fake = types.ModuleType("tensorrt_llm._utils")
            fake.mpi_world_size, fake.mpi_rank = (lambda: 1), (lambda: 0)
            monkeypatch.setitem(sys.modules, "tensorrt_llm", types.ModuleType("tensorrt_llm"))
            monkeypatch.setitem(sys.modules, "tensorrt_llm._utils", fake)
        monkeypatch.setattr(sys, "argv", ["build_engine.py", "--tier", "custom", "--run", str(eng), "--prompt", "a", "--prompt", "b"])
        capsys.readouterr()
        assert be.main() == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and want in err, err
