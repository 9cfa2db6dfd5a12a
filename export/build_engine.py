"""Build a TensorRT-LLM engine from an exported checkpoint. Runs only where TensorRT-LLM is installed.

    python build_engine.py --ckpt export/trtllm_ckpt/tp1 --out engine [--max-seq-len 8192]

Pinned: tensorrt_llm==1.2.1 (the last line with the TensorRT engine backend and trtllm-build).
This file is the only kvcompress code that imports tensorrt_llm. It was not run on the machines
kvcompress is developed on (TensorRT-LLM is not installable there).
"""
from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys

PINNED = "1.2.1"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-seq-len", type=int, default=8192)
    ap.add_argument("--max-batch-size", type=int, default=64)
    a = ap.parse_args()
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
    cmd = [exe, "--checkpoint_dir", a.ckpt, "--output_dir", a.out, "--gemm_plugin", "auto", "--kv_cache_type", "paged",
           "--max_seq_len", str(a.max_seq_len), "--max_batch_size", str(a.max_batch_size)]
    print(" ".join(cmd))
    return subprocess.run(cmd).returncode


if __name__ == "__main__":
    sys.exit(main())
