"""Shared fixtures: tiny in-code models, a fitted ScaleBook for them, CLI runner."""
from __future__ import annotations

import os

import torch

# Triton kernels run under the interpreter on CPU; this must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
# Under pytest-xdist (the README's `-n 2`), the workers share the cores: each takes its share of threads,
# and so do the CLI runs it starts (OMP_NUM_THREADS is inherited), instead of every process oversubscribing them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _threads = max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcompress.config import CalibConfig
from kvcompress.data import load_texts
from kvcompress.models.base import Geometry, LoadedModel
from kvcompress.models.tiny import build_tiny
from kvcompress.models.tokenizer import ByteTokenizer
from kvcompress.spec import KVSpec
from kvcompress.stages.fit import fit
from kvcompress.stages.profile import profile

ROOT = Path(__file__).resolve().parents[1]
SMOKE_CALIB = CalibConfig(name="smoke", n_samples=4, seq_len=64, batch_size=4, sample_tokens=64)


def tiny_lm(arch="llama", heads=6, kv_heads=2, head_dim=32, layers=2, seed=0) -> LoadedModel:
    model = build_tiny(arch, layers=layers, hidden=16 * heads, heads=heads, kv_heads=kv_heads, head_dim=head_dim, seed=seed)
    return LoadedModel(model, ByteTokenizer(), Geometry.from_hf_config(model.config), {"name": f"tiny_{arch}"})


def rmsnorm_float64(self, h):
    """LlamaRMSNorm's formula, in the input's dtype (transformers computes it in float32): with it,
    a model moved to float64 computes in float64 end to end."""
    return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def float64_model(lm: LoadedModel, mp: pytest.MonkeyPatch) -> LoadedModel:
    """lm's model moved to float64, with float64 RMSNorm math (Llama, Qwen2, Qwen3, Mistral, Phi-3, Gemma 3) for as long as
    mp is active. Two paths that compute the same thing with different summation orders (one GEMM over
    all positions vs one GEMV per decoding step) differ by ~1e-7 in float32, and by how much depends on
    the CPU's BLAS kernels: enough to flip the rounding of a K/V element on a rounding midpoint. In
    float64 they agree to ~1e-12 on any CPU."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.phi3.modeling_phi3 import Phi3RMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    for cls in (LlamaRMSNorm, MistralRMSNorm, Phi3RMSNorm, Qwen2RMSNorm, Qwen3RMSNorm):
        mp.setattr(cls, "forward", rmsnorm_float64)
    mp.setattr(Gemma3RMSNorm, "forward", lambda self, x: self._norm(x) * (1.0 + self.weight))  # Gemma 3's formula, in x's dtype
    lm.model.double()
    return lm


@torch.no_grad()
def assert_folded_like(model, folded, sigma: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`folded` (a key/value fold applied) gives `model`'s logits and caches its keys divided by sigma [L, H, D]; returns the logits."""
    from transformers import DynamicCache

    c1, c2 = DynamicCache(config=model.config), DynamicCache(config=model.config)
    a = model(input_ids=ids, cache=c1, use_cache=True).logits
    b = folded(input_ids=ids, cache=c2, use_cache=True).logits
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    for layer in range(sigma.shape[0]):
        torch.testing.assert_close(c2.layers[layer].keys, c1.layers[layer].keys / sigma[layer][None, :, None, :], atol=1e-5, rtol=1e-4)
    return a

def fitted_book(lm: LoadedModel, **spec_kw):
    spec = KVSpec(name=spec_kw.pop("name", "test"), **spec_kw)
    stats = profile(lm, SMOKE_CALIB, load_texts(SMOKE_CALIB), progress=False)
    return fit(stats, spec)


@pytest.fixture(scope="session")
def tiny_llama() -> LoadedModel:
    return tiny_lm("llama")


@pytest.fixture(scope="session")
def tiny_stats(tiny_llama):
    return profile(tiny_llama, SMOKE_CALIB, load_texts(SMOKE_CALIB), progress=False)


def run_cli(*args: str, cache_dir: Path | None = None, cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """python -m kvcompress ARGS, returning the completed process (never raises on failure)."""
    env = dict(os.environ)
    if cache_dir is not None:
        env["KVCOMPRESS_CACHE"] = str(cache_dir)
    return subprocess.run(
        [sys.executable, "-m", "kvcompress", *args], capture_output=True, text=True, env=env, cwd=cwd or ROOT, timeout=timeout
    )


def run_cli_batch(runs: list[tuple[list[str], Path | None]], workdir: Path, timeout: int = 900, script: str | None = None) -> list[subprocess.CompletedProcess]:
    """run_cli for each (args, cache_dir) of `runs`, for one interpreter start (tests/cli_batch.py: a forked child per run from
    a process that imported the CLI's modules once): the same exit code, stdout and stderr as `python -m kvcompress ARGS`
    (script="first": as `python ARGS[0] ARGS[1:]`, the script's path relative to the repository)."""
    workdir.mkdir(parents=True, exist_ok=True)
    cases = [{"args": list(args), "env": {"KVCOMPRESS_CACHE": str(cache)} if cache is not None else {},
              "out": str(workdir / f"{i}.out"), "err": str(workdir / f"{i}.err")} for i, (args, cache) in enumerate(runs)]
    if script == "first":  # each run's script is its first argument
        cases = [c | {"script": c["args"][0], "args": c["args"][1:]} for c in cases]
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "cli_batch.py")], input=json.dumps(cases), capture_output=True, text=True,
                       cwd=ROOT, timeout=timeout)
    if p.returncode:
        raise RuntimeError(f"tests/cli_batch.py failed ({p.returncode}): {p.stderr[-3000:]}")
    codes = json.loads(p.stdout.strip().splitlines()[-1])
    return [subprocess.CompletedProcess([sys.executable, *([c["script"]] if c.get("script") else ["-m", "kvcompress"]), *c["args"]], code, Path(c["out"]).read_text(), Path(c["err"]).read_text())
            for c, code in zip(cases, codes)]


# Seconds each test file took on 2 cores (pytest -n 2 --junitxml, setup included; files under 5 s left out), 2026-12-06.
# The longest files are handed to the two xdist workers first (pyproject: --dist loadfile --no-loadscope-reorder keeps this
# order; xdist's own reorder sorts files by their number of tests), so the run does not end on one worker with a long file.
FILE_SECONDS = {
    "test_export": 399, "test_kernels": 305, "test_streaming": 300,
    "test_cli": 261, "test_quantized_checkpoints": 221, "test_gemma3": 206, "test_int_weights": 136, "test_eval_equivalence": 108,
    "test_nvfp4_weights": 105, "test_architectures": 102, "test_kernel_audit": 100, "test_tune": 66, "test_multimodal": 65,
    "test_report": 56, "test_serve_check": 54, "test_long_context_keys": 51, "test_scripts_cli": 46, "test_readme_commands": 30, "test_trtllm_network": 28,
    "test_kivi": 22, "test_waterfill": 22, "test_rotated": 21, "test_attribution": 18, "test_plugins": 17, "test_nvfp4": 9, "test_tasks": 6}


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.stem, 0))  # stable: a file's own tests keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def tiny_llama_dir(out: Path, arch: str = "llama") -> dict:
    """A tiny random Llama (2 layers, hidden 96, 6 heads over 2 kv heads; arch="mixtral": with Mixtral's experts) saved as an
    HF directory at `out` with the byte tokenizer: the quantized-checkpoint tests rewrite its tensors in their format.
    Returns its state dict as saved."""
    from safetensors.torch import load_file

    from kvcompress.models.synthetic import byte_tokenizer

    m = build_tiny(arch, layers=2, hidden=96, heads=6, kv_heads=2, head_dim=32)
    m.config.architectures = [{"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}[arch]]
    m.save_pretrained(str(out))
    byte_tokenizer().save_pretrained(str(out))
    return load_file(str(out / "model.safetensors"))


def quantized_tiny_dir(out: Path, quantize, quantization_config: dict) -> tuple[Path, dict]:
    """tiny_llama_dir at `out` with each q/k/v/o and MLP projection's weight replaced by the tensors quantize(name, weight)
    returns (a dict of stored name -> tensor, and the float32 weight they define), config.json given
    `quantization_config`. Returns the directory and {weight name: the weight its tensors define}."""
    from safetensors.torch import save_file

    sd = tiny_llama_dir(out)
    new, expect = {}, {}
    for k, v in sd.items():
        if not k.endswith("proj.weight"):
            new[k] = v
            continue
        stored, expect[k] = quantize(k, v)
        new |= stored
    save_file(new, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg | {"quantization_config": quantization_config}))
    return out, expect


def trtllm_writer_refuses_changed_weights(ckpt_tensors, state: dict, hf_cfg, out: Path, dtype: str, kv_algo: str) -> None:
    """TrtllmWriter with a quantized source (`ckpt_tensors`, a models.checkpoint.Checkpoint) copies layer 0's kept weights when they
    still define `state`'s values, refuses layer 1 once its down_proj changed, and leaves nothing behind on abort."""
    from kvcompress.models.base import Geometry
    from kvcompress.targets.trtllm_ckpt import TrtllmWriter

    w = TrtllmWriter({k: torch.empty_like(v, device="meta") for k, v in state.items()}, Geometry.from_hf_config(hf_cfg), out, 1, dtype, kv_algo,
                     torch.ones(2), hf_cfg, fp8_source=ckpt_tensors)
    w.write_layer(state, 0)  # unchanged: copied
    state = dict(state)
    state["model.layers.1.mlp.down_proj.weight"] = state["model.layers.1.mlp.down_proj.weight"] * 1.01
    with pytest.raises(RuntimeError, match="changed before writing"):
        w.write_layer(state, 1)
    w.abort()
    assert not list(out.glob("*.safetensors*"))


def modelopt_trtllm_layout(ckpt: Path, out: Path, preset: str) -> tuple[dict, dict]:
    """Model Optimizer's own TensorRT-LLM export of the model a quantized checkpoint defines (read dequantized), quantized with
    its `preset` weight config (FP8_DEFAULT_CFG, NVFP4_DEFAULT_CFG, ...) and an FP8 KV cache, the attention projections
    left unquantized (what kvcompress's fold needs): its quantization block and {name: (tensor_kind, shape)} of rank0."""
    import copy

    from safetensors.torch import load_file

    from kvcompress.models.checkpoint import Checkpoint

    mtq = pytest.importorskip("modelopt.torch.quantization")
    from modelopt.torch.export import export_tensorrt_llm_checkpoint
    from transformers import AutoConfig, LlamaForCausalLM

    cfg = AutoConfig.from_pretrained(str(ckpt))
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = LlamaForCausalLM(cfg).eval()
    c = Checkpoint(ckpt)
    model.load_state_dict({k: c.read(k).float() for k in c.entries if not k.endswith(("_scale", "_scale_inv", "_scale_2"))}, strict=False)
    qc = copy.deepcopy(getattr(mtq, preset))
    qc["quant_cfg"] = list(qc["quant_cfg"]) + list(mtq.FP8_KV_CFG["quant_cfg"]) + [{"quantizer_name": "*self_attn.*_proj*", "enable": False}]
    g = torch.Generator().manual_seed(0)
    model = mtq.quantize(model, qc, forward_loop=lambda m: m(torch.randint(0, cfg.vocab_size, (2, 16), generator=g)))
    export_tensorrt_llm_checkpoint(model, "llama", torch.float16, str(out), inference_tensor_parallel=1)
    t = load_file(str(out / "rank0.safetensors"))
    return json.loads((out / "config.json").read_text())["quantization"], {k: (tensor_kind(v), tuple(v.shape)) for k, v in t.items()}


def tensor_kind(v: torch.Tensor) -> str:
    """A written tensor's dtype where a layout fixes it (float8, float32, uint8 codes), else "export dtype"."""
    return str(v.dtype) if v.dtype in (torch.float8_e4m3fn, torch.float32, torch.uint8) else "export dtype"


def loader_reads_as(tmp_path: Path, ckpt: Path, expect: dict, modules: list[str], function: str) -> dict:
    """The custom tier's weight loader (trtllm_network: NVFP4, FP8 and integer dequantization in load_hf_weights' order) gives
    `expect` ({weight name: float32 value}) for the checkpoint's tensors, and so does trtllm_network.<function> as the bundle
    ships it (only `modules` beside it, kvcompress blocked); engine_memory counts the loader's tensors as fp16 constants.
    Returns the loader's tensors."""
    from safetensors.torch import load_file

    from kvcompress.targets import network_weights as nw
    from kvcompress.targets import trtllm_network as tn

    out = nw.dequantize_packed(nw.dequantize_fp8(nw.dequantize_nvfp4(load_file(str(ckpt / "model.safetensors")), ckpt), ckpt), ckpt)
    for k, w in expect.items():
        assert torch.equal(out[k], w), k
    spec = {"variant": {"n_sink": 0, "window": 0, "key_bits": 8, "value_bits": 4, "group": 16, "n_out": 0},
            "arch": {"n_layers": 0, "n_kv_heads": 1, "head_dim": 64}}
    assert tn.engine_memory(spec, ckpt, 1, 8)["weights_bytes"] == 2 * sum(t.numel() for t in out.values())
    key = "model.layers.1.mlp.up_proj.weight"
    assert bundle_loader(tmp_path, modules, ckpt, function, key) == float(expect[key].double().sum())
    return out


def refuses_weight_configs(ckpt: Path, changes: list[dict]) -> None:
    """Each of `changes` to the checkpoint's config_groups.group_0.weights makes its weights a format kvcompress refuses, in
    one line naming the quant_method."""
    from kvcompress.errors import UserError
    from kvcompress.models.quantized import weight_quantization

    cfg = json.loads((ckpt / "config.json").read_text())
    for change in changes:
        q = json.loads(json.dumps(cfg["quantization_config"]))
        q["config_groups"]["group_0"]["weights"] |= change
        (ckpt / "config.json").write_text(json.dumps(cfg | {"quantization_config": q}))
        with pytest.raises(UserError, match=f"quant_method={q['quant_method']!r}") as e:
            weight_quantization(ckpt)
        assert "\n" not in str(e.value), change
    (ckpt / "config.json").write_text(json.dumps(cfg))


def bundle_loader(tmp_path: Path, modules: list[str], ckpt: Path, function: str, key: str) -> float:
    """network_weights.<function>(the checkpoint's tensors, its directory)[key]'s sum (float64), run in a fresh interpreter with
    kvcompress blocked and only `modules` (paths under kvcompress/) beside the network's files (targets.bundle.NETWORK_FILES):
    as build_engine.py runs it from the plugin bundle on a GPU host (importing trtllm_network.py, which imports the others)."""
    from kvcompress.targets.bundle import NETWORK_FILES

    bundle = tmp_path / "bundle"
    bundle.mkdir()
    for f in [*(f"targets/{n}" for n in NETWORK_FILES), *modules]:
        (bundle / Path(f).name).write_bytes((ROOT / "kvcompress" / f).read_bytes())
    code = ("import sys; sys.modules['kvcompress'] = None; sys.path.insert(0, sys.argv[1]); import torch, trtllm_network as tn; "
            "import network_weights as nw; from safetensors.torch import load_file; from pathlib import Path; "
            f"o = nw.{function}(load_file(sys.argv[2] + '/model.safetensors'), Path(sys.argv[2])); "
            f"print(float(o[{key!r}].double().sum()))")
    p = subprocess.run([sys.executable, "-c", code, str(bundle), str(ckpt)], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    return float(p.stdout)


def plain_copy(src: Path, out: Path, tensors: dict) -> Path:
    """src's HF directory at `out` with `tensors` as its weights (model.safetensors) and no quantization_config: the same
    model written unquantized."""
    from safetensors.torch import save_file

    out.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
