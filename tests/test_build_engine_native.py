"""export/build_engine.py, native tier: the trtllm-build command it runs, against a stand-in tensorrt_llm package and a
stand-in trtllm-build that records its arguments (TensorRT-LLM is not installable here; the real build is not run)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT

STUB = """#!{py}
import json, os, sys
with open(os.environ["KVC_TEST_ARGV"], "w") as f:
    json.dump(sys.argv[1:], f)
ckpt = sys.argv[sys.argv.index("--checkpoint_dir") + 1]  # what the build reads, as it is while the build runs
with open(os.environ["KVC_TEST_ARGV"] + ".ckpt", "w") as f:
    json.dump({{"config": json.load(open(os.path.join(ckpt, "config.json"))), "rank0": os.path.realpath(os.path.join(ckpt, "rank0.safetensors"))}}, f)
sys.exit(int(os.environ.get("KVC_TEST_RC", "0")))
"""


def _setup(tmp_path, rc=0):
    pkg = tmp_path / "site" / "tensorrt_llm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "1.2.1"\n')
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "trtllm-build"
    exe.write_text(STUB.format(py=sys.executable))
    exe.chmod(0o755)
    ckpt = tmp_path / "trtllm_ckpt" / "tp1"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text(json.dumps({"architecture": "LlamaForCausalLM", "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}))
    (ckpt / "rank0.safetensors").write_bytes(b"stand-in")
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "PYTHONPATH": str(tmp_path / "site"), "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}",
           "KVC_TEST_ARGV": str(tmp_path / "argv.json"), "KVC_TEST_RC": str(rc)}
    return ckpt, env


def _run(env, *args):
    return subprocess.run([sys.executable, str(ROOT / "export" / "build_engine.py"), *args], capture_output=True, text=True, env=env)


def _flags(argv: list[str]) -> dict[str, str]:
    return dict(zip(argv[::2], argv[1::2]))


def test_native_tier_builds_with_the_gemm_plugin_in_the_model_dtype(tmp_path):
    ckpt, env = _setup(tmp_path)
    p = _run(env, "--ckpt", str(ckpt), "--out", str(tmp_path / "engine"))
    assert p.returncode == 0, p.stderr
    flags = _flags(json.loads((tmp_path / "argv.json").read_text()))
    assert flags == {"--checkpoint_dir": str(ckpt), "--output_dir": str(tmp_path / "engine"), "--gemm_plugin": "auto",
                     "--kv_cache_type": "paged", "--max_seq_len": "8192", "--max_batch_size": "64"}


def test_native_tier_fp16_fallback_builds_from_a_view_without_kv_quantization(tmp_path):
    ckpt, env = _setup(tmp_path)
    p = _run(env, "--ckpt", str(ckpt), "--out", str(tmp_path / "engine"), "--kv-cache", "fp16", "--max-seq-len", "4096")
    assert p.returncode == 0, p.stderr
    flags = _flags(json.loads((tmp_path / "argv.json").read_text()))
    assert flags["--checkpoint_dir"] != str(ckpt) and flags["--max_seq_len"] == "4096"
    seen = json.loads((tmp_path / "argv.json.ckpt").read_text())  # the view as trtllm-build read it
    assert seen["config"]["quantization"] == {"quant_algo": "FP8", "kv_cache_quant_algo": None}  # the weights' quantization kept
    assert seen["rank0"] == str((ckpt / "rank0.safetensors").resolve())
    assert not os.path.exists(flags["--checkpoint_dir"]) and not list((tmp_path / "tmp").iterdir())  # removed after the build


def test_native_tier_returns_trtllm_builds_exit_code(tmp_path):
    ckpt, env = _setup(tmp_path, rc=3)
    assert _run(env, "--ckpt", str(ckpt), "--out", str(tmp_path / "engine")).returncode == 3


def test_native_tier_refuses_a_directory_without_config_in_one_line(tmp_path):
    _, env = _setup(tmp_path)
    p = _run(env, "--ckpt", str(tmp_path / "bin"), "--out", str(tmp_path / "engine"))
    assert p.returncode == 2 and not (tmp_path / "argv.json").exists()
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and str(tmp_path / "bin") in lines[0] and "config.json" in lines[0]


def test_counts_and_lengths_must_be_positive_integers_in_one_line(tmp_path):
    """--max-batch-size, --max-seq-len, --splits and --max-new-tokens take integers >= 1 (0 or a negative used to reach
    the build); argparse's one-line usage error, exit 2, for either tier."""
    ckpt, env = _setup(tmp_path)
    for args in (["--ckpt", str(ckpt), "--out", str(tmp_path / "e"), "--max-batch-size", "0"],
                 ["--tier", "custom", "--max-seq-len", "-5"], ["--tier", "custom", "--splits", "x"], ["--tier", "custom", "--max-new-tokens", "0"]):
        p = _run(env, *args)
        flag = next(a for a in args if a.startswith("--max") or a == "--splits")
        assert p.returncode == 2 and "Traceback" not in p.stderr and f"argument {flag}:" in p.stderr and "is not an integer >= 1" in p.stderr, p.stderr
        assert not (tmp_path / "argv.json").exists()  # trtllm-build never ran
