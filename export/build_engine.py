"""Build a TensorRT-LLM engine from an exported checkpoint. Runs only where TensorRT-LLM is installed.

    python build_engine.py --ckpt export/trtllm_ckpt/tp1 --out engine [--max-seq-len 8192]
    python build_engine.py --ckpt export/trtllm_ckpt/tp1 --out engine_fp16kv --kv-cache fp16   # rollback

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


def fp16_kv_view(ckpt: Path) -> Path:
    """A checkpoint directory that is `ckpt` with kv_cache_quant_algo = null (rank files symlinked)."""
    view = Path(tempfile.mkdtemp(prefix="kvc_fp16kv_"))
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization"]["kv_cache_quant_algo"] = None
    (view / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in ckpt.glob("rank*.safetensors"):
        (view / f.name).symlink_to(f.resolve())
    return view


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--kv-cache", choices=["checkpoint", "fp16"], default="checkpoint",
                    help="checkpoint: the validated quantized KV cache; fp16: the rollback with an unquantized KV cache")
    ap.add_argument("--max-seq-len", type=int, default=8192)
    ap.add_argument("--max-batch-size", type=int, default=64)
    a = ap.parse_args()
    ckpt = Path(a.ckpt)
    if not (ckpt / "config.json").is_file():
        print(f"error: --ckpt {a.ckpt} has no config.json (expected export/trtllm_ckpt/tp<N>)", file=sys.stderr)
        return 2
    if a.kv_cache == "fp16":
        ckpt = fp16_kv_view(ckpt)
        print(f"fp16 KV fallback: building from {ckpt}")
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
    cmd = [exe, "--checkpoint_dir", str(ckpt), "--output_dir", a.out, "--gemm_plugin", "auto", "--kv_cache_type", "paged",
           "--max_seq_len", str(a.max_seq_len), "--max_batch_size", str(a.max_batch_size)]
    print(" ".join(cmd))
    return subprocess.run(cmd).returncode


if __name__ == "__main__":
    sys.exit(main())
