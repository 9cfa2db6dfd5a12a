"""Build a TensorRT-LLM engine from an export. Runs only where TensorRT-LLM is installed.

Native tier (stock TensorRT-LLM attention, INT8/FP8 KV):
    python build_engine.py --ckpt export/trtllm_ckpt/tp1 --out engine [--max-seq-len 8192]
    python build_engine.py --ckpt export/trtllm_ckpt/tp1 --out engine_fp16kv --kv-cache fp16   # rollback

Custom tier (the kvcompress format; attention = the KvcAppend + KvcDecodeAttention plugins):
    python build_engine.py --tier custom --bundle export/plugin_bundle --plugin-lib libkvcompress_trt.so --out engine_custom \
        [--hf-dir <the model's HF directory; default: the one the run loaded>] [--max-seq-len 8192] [--max-batch-size 8]
    python build_engine.py --tier custom --run engine_custom --prompt "The capital of France is" --max-new-tokens 32
    python build_engine.py --tier custom --check engine_custom   # the engine against the validated decoding: PASS / FAIL
Tensor parallel (a model too large for one GPU): --tp N builds rank0..rank<N-1>.engine (each 1/N of the heads and MLP
columns, all-reduces after attention and MLP; N above the kv heads replicates them, N / kv-heads ranks each); --run and
--check then run one process per rank:
    python build_engine.py --tier custom --bundle export/plugin_bundle --plugin-lib libkvcompress_trt.so --out engine_custom --tp 8
    mpirun -n 8 python build_engine.py --tier custom --check engine_custom
--check feeds the export's network-check tokens (plugin_bundle/network_check.safetensors: a prompt that crosses the fp16
window into the compressed store) through the engine one per step and compares each step's distribution with the
validated decoding's (CompressedCache), as the export compared the CPU oracle: mean KL within the export's tolerance
(over the reference's top 256 tokens and one bucket for the rest, never more than the full KL). Exit 0 PASS, 1 FAIL.
The network (kvcompress/targets/trtllm_network.py, copied beside this file in the bundle) is built with
TensorRT-LLM 1.2.1's Python network API; its graph is checked on CPU against the validated decoding
(network_oracle.py), and its TensorRT-LLM/TensorRT names against the pinned sources
(scripts/check_trtllm_api.py). Neither the build nor the generation loop has been run (no GPU here).

--kv-cache fp16 is the operator's fallback: the same folded weights with an unquantized KV cache
(the fold is exact, so the model is unchanged); it builds from a copy of config.json with
kv_cache_quant_algo set to null, next to symlinks of the same rank files, without re-exporting.

Pinned: tensorrt_llm==1.2.1 (the last line with the TensorRT engine backend and trtllm-build).
This file is the only kvcompress code that imports tensorrt_llm. It was not run on the machines
kvcompress is developed on (TensorRT-LLM is not installable there); whether trtllm-build ignores
the then-unused kv_cache_scaling_factor tensors in the fp16 fallback is likewise not verified.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PINNED = "1.2.1"


# --gemm_plugin auto (the model dtype) for every native checkpoint, FP8 MLPs included. Read in TensorRT-LLM's sources, not run:
# FP8Linear / FP8RowLinear (quant_algo FP8) call the GEMM plugin only when gemm_plugin is 'fp8', else they quantize and
# dequantize around a plain matmul that TensorRT fuses into FP8 GEMMs; FP8_PER_CHANNEL_PER_TOKEN layers call the
# Fp8RowwiseGemm plugin, which the builder enables by itself (set_fp8_rowwise_quant_plugins). 'fp8' (its docs: experimental,
# for batch <= 4) would also route the folded fp16 attention and lm_head through the plugin; not offered, not verified.
GEMM_PLUGIN = "auto"


def native_cmd(exe: str, ckpt: Path, out: str, max_seq_len: int, max_batch_size: int) -> list[str]:
    """The trtllm-build command line of the native tier."""
    return [exe, "--checkpoint_dir", str(ckpt), "--output_dir", out, "--gemm_plugin", GEMM_PLUGIN, "--kv_cache_type", "paged",
            "--max_seq_len", str(max_seq_len), "--max_batch_size", str(max_batch_size)]


def fp16_kv_view(ckpt: Path, view: Path) -> Path:
    """Make `view` (a new or empty directory) the checkpoint `ckpt` with kv_cache_quant_algo = null (rank files symlinked)."""
    view.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization"]["kv_cache_quant_algo"] = None
    (view / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in ckpt.glob("rank*.safetensors"):
        (view / f.name).symlink_to(f.resolve())
    return view


def _network_module():
    """trtllm_network.py from beside this file (the bundle's copy), else from an installed kvcompress."""
    here = Path(__file__).resolve().parent
    if (here / "trtllm_network.py").is_file():
        sys.path.insert(0, str(here))
        import trtllm_network

        return trtllm_network
    from kvcompress.targets import trtllm_network

    return trtllm_network


def gpu_bytes() -> int | None:
    """The first CUDA device's memory, or None where torch or a GPU is missing (the check is then skipped)."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def check(a, tn) -> int:
    """--check ENGINE_DIR: the engine against the validated decoding (trtllm_network.check_engine)."""
    eng = Path(a.check)
    if not (eng / "rank0.engine").is_file() or not (eng / "config.json").is_file():
        print(f"error: --check {a.check} has no rank0.engine + config.json (build one with --tier custom --out DIR)", file=sys.stderr)
        return 2
    try:
        cfg = json.loads((eng / "config.json").read_text())
    except json.JSONDecodeError as e:
        print(f"error: {eng / 'config.json'} is not JSON ({e}): not an engine directory written by --tier custom --out", file=sys.stderr)
        return 2
    cfile = Path(a.check_file) if a.check_file else Path(cfg.get("bundle") or ".") / tn.CHECK_FILE
    if not cfile.is_file():
        print(f"error: {cfile} does not exist: give the export's plugin_bundle/{tn.CHECK_FILE} with --check-file (written when the "
              f"export ran the network check)", file=sys.stderr)
        return 2
    if importlib.util.find_spec("tensorrt_llm") is None:
        print(f"error: tensorrt_llm is not importable here; install tensorrt_llm=={PINNED} on a GPU host", file=sys.stderr)
        return 2
    missing = [f"rank{r}.engine" for r in range(cfg.get("tp", 1)) if not (eng / f"rank{r}.engine").is_file()]
    if missing:
        print(f"error: --check {a.check} is a {cfg['tp']}-rank engine without {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        r = tn.check_engine(eng, cfile)
    except ValueError as e:  # a check file from another export, more tokens than the engine holds, or not under mpirun -n tp
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{'PASS' if r['pass'] else 'FAIL'}: the engine vs the validated decoding on {r['tokens']} tokens: mean KL {r['kl_mean']:.2e} "
          f"(tolerance {r['kl_tolerance']:.1e}; the CPU oracle's {r['cpu_oracle_kl_mean']:.2e}), max {r['kl_max']:.2e}, "
          f"top-1 agreement {r['top1_agreement']:.3f}")
    return 0 if r["pass"] else 1


def custom_tier(a) -> int:
    tn = _network_module()
    if a.check:
        return check(a, tn)
    if a.run:
        if not a.prompt:
            print("error: --run needs --prompt", file=sys.stderr)
            return 2
        if not (Path(a.run) / "rank0.engine").is_file() or not (Path(a.run) / "config.json").is_file():
            print(f"error: --run {a.run} has no rank0.engine + config.json (build one with --tier custom --out DIR)", file=sys.stderr)
            return 2
        if importlib.util.find_spec("tensorrt_llm") is None:
            print(f"error: tensorrt_llm is not importable here; install tensorrt_llm=={PINNED} on a GPU host", file=sys.stderr)
            return 2
        try:
            texts = tn.generate(Path(a.run), a.prompt, a.max_new_tokens)
        except ValueError as e:  # more prompts or tokens than the engine takes, or a tensor-parallel engine not under mpirun -n tp
            print(f"error: {e}", file=sys.stderr)
            return 2
        for text in texts:
            print(text)
        return 0
    missing = [f"--{n.replace('_', '-')}" for n in ("bundle", "plugin_lib", "out") if not getattr(a, n)]
    if missing:
        print(f"error: --tier custom needs {' '.join(missing)} (or --run ENGINE_DIR --prompt TEXT)", file=sys.stderr)
        return 2
    try:
        spec = tn.load_spec(Path(a.bundle))
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.max_seq_len is None:  # the default, capped where the asymmetric keys' ranges stop holding
        a.max_seq_len = min(8192, spec.get("key_max_position") or 8192)
    try:
        tn.check_max_seq_len(spec, a.max_seq_len)
    except tn.WeightsMismatch as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    hf_dir = Path(a.hf_dir or spec["weights"]["hf_dir"] or "")
    if not any(hf_dir.glob("*.safetensors")):
        print(f"error: --hf-dir {hf_dir} has no *.safetensors (give the HF directory of the model the run validated)", file=sys.stderr)
        return 2
    if not Path(a.plugin_lib).is_file():
        print(f"error: --plugin-lib {a.plugin_lib} does not exist (build it: plugins/CMakeLists.txt, or lib/<arch>/ in the bundle)", file=sys.stderr)
        return 2
    if importlib.util.find_spec("tensorrt_llm") is None:
        print(f"error: tensorrt_llm is not importable here; install tensorrt_llm=={PINNED} on a GPU host", file=sys.stderr)
        return 2
    try:
        tn.check_tp(spec, a.tp)
    except tn.WeightsMismatch as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    mem = tn.engine_memory(spec, hf_dir, a.max_batch_size, a.max_seq_len, a.tp)
    total = gpu_bytes()
    if total is not None and mem["weights_bytes"] + mem["cache_bytes"] > total:
        print(f"error: the custom-tier engine needs {tn.memory_line(mem)}, more than this GPU's {tn.size(total)}: raise --tp (it "
              f"divides the weights and the cache across GPUs), lower --max-batch-size / --max-seq-len, or serve the native tier", file=sys.stderr)
        return 2
    print(f"custom-tier engine: {tn.memory_line(mem)}" + (f" of {tn.size(total)}" if total else "") + ", before TensorRT's activations and workspace")
    try:
        out = tn.build_engine(Path(a.bundle), hf_dir, Path(a.plugin_lib), Path(a.out), a.max_batch_size, a.max_seq_len, a.splits, a.tp)
    except tn.WeightsMismatch as e:  # a --hf-dir that is not the model the bundle was exported for
        print(f"error: {e}", file=sys.stderr)
        return 2
    launch = f"mpirun -n {a.tp} " if a.tp > 1 else ""
    print(f"custom-tier engine written to {out}; run it: {launch}python {Path(__file__).name} --tier custom --run {out} --prompt '...'")
    return 0


def positive(text: str) -> int:
    """argparse type: an integer >= 1 (batch sizes, lengths, split and token counts)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tier", choices=["native", "custom"], default="native")
    ap.add_argument("--ckpt", help="native tier: export/trtllm_ckpt/tp<N>")
    ap.add_argument("--out")
    ap.add_argument("--bundle", help="custom tier: export/plugin_bundle")
    ap.add_argument("--hf-dir", help="custom tier: the model's HF directory (default: network.json's weights.hf_dir)")
    ap.add_argument("--plugin-lib", help="custom tier: libkvcompress_trt.so built for this GPU")
    ap.add_argument("--tp", type=positive, default=1, help="custom tier: tensor-parallel GPUs (a divisor of the model's kv heads, or a multiple of "
                    "them dividing its query heads: kv heads replicated; --run / --check then under mpirun -n TP)")
    ap.add_argument("--splits", type=positive, default=None, help="custom tier: split-K count of the decode plugin (default: network.json)")
    ap.add_argument("--run", help="custom tier: an engine directory to generate with")
    ap.add_argument("--prompt", action="append", help="custom tier --run: a prompt (repeat for a batch)")
    ap.add_argument("--check", help="custom tier: an engine directory to check against the validated decoding (PASS/FAIL)")
    ap.add_argument("--check-file", help="custom tier --check: the export's network_check.safetensors (default: in the bundle the engine was built from)")
    ap.add_argument("--max-new-tokens", type=positive, default=32)
    ap.add_argument("--kv-cache", choices=["checkpoint", "fp16"], default="checkpoint",
                    help="checkpoint: the validated quantized KV cache; fp16: the rollback with an unquantized KV cache")
    ap.add_argument("--max-seq-len", type=positive, default=None,
                    help="default 8192 (custom tier with asymmetric keys: at most network.json's key_max_position)")
    ap.add_argument("--max-batch-size", type=positive, default=64)
    a = ap.parse_args()
    if a.tier == "custom":
        return custom_tier(a)
    if not a.ckpt or not a.out:
        print("error: the native tier needs --ckpt and --out", file=sys.stderr)
        return 2
    ckpt = Path(a.ckpt)
    if not (ckpt / "config.json").is_file():
        print(f"error: --ckpt {a.ckpt} has no config.json (expected export/trtllm_ckpt/tp<N>)", file=sys.stderr)
        return 2
    if importlib.util.find_spec("tensorrt_llm") is None:
        print(f"error: tensorrt_llm is not importable here; install tensorrt_llm=={PINNED} on a GPU host", file=sys.stderr)
        return 2
    import tensorrt_llm  # noqa: F401  (version check)

    if tensorrt_llm.__version__ != PINNED:
        print(f"warning: tensorrt_llm {tensorrt_llm.__version__} != pinned {PINNED}", file=sys.stderr)
    exe = shutil.which("trtllm-build")
    if exe is None:
        print("error: trtllm-build not found (TensorRT engine backend removed after the 1.2 line)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvc_fp16kv_") as d:  # the fp16-KV view lives as long as the build
        if a.kv_cache == "fp16":
            ckpt = fp16_kv_view(ckpt, Path(d))
            print(f"fp16 KV fallback: building from {ckpt} (removed after the build)")
        cmd = native_cmd(exe, ckpt, a.out, a.max_seq_len or 8192, a.max_batch_size)
        print(" ".join(cmd))
        return subprocess.run(cmd).returncode


if __name__ == "__main__":
    sys.exit(main())
