"""The TensorRT plugin library compiles against TensorRT's real public headers (when given)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcompress.targets import launchers
from kvcompress.targets.plugin_lib import build, defined_symbols, undefined_symbols

TRT = os.environ.get("TENSORRT_INCLUDE_DIR")
needs_trt = pytest.mark.skipif(not TRT, reason="TENSORRT_INCLUDE_DIR not set: point it at include/ of NVIDIA/TensorRT v10.13.3 "
                                                "(the TensorRT of TensorRT-LLM 1.2.1; see plugins/README.md)")
VARIANTS = {"d128_g8_int8k_int4v": (128, 8, 8, 4, 32, 4, 128, 0), "d64_g3_int8k_int4v": (64, 3, 8, 4, 32, 4, 128, 0),
            "d128_g8_int4": (128, 8, 4, 4, 32, 4, 128, 2)}
FIELDS = ("head_dim", "gqa", "key_bits", "value_bits", "group", "n_sink", "window", "n_out")


def _kernels(tmp_path: Path, name: str) -> Path:
    import json

    out = tmp_path / name
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    v = json.dumps({"name": name, **dict(zip(FIELDS, VARIANTS[name]))})
    p = subprocess.run([sys.executable, "-m", "kvcompress.kernels.aot", "--arch", "sm_90", "--out", str(out), "--variant-json", v],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    launchers.generate(out)
    return out


@needs_trt
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_plugin_library_compiles_against_tensorrt_headers_without_warnings(tmp_path, variant):
    lib = tmp_path / "libkvcompress_trt.so"
    build(Path(TRT), _kernels(tmp_path, variant), variant, lib)  # -Wall -Wextra -Werror
    undefined = {s.split("@")[0] for s in undefined_symbols(lib)}
    # only TensorRT's registry and the CUDA driver remain for load time (plus the C/C++ runtime)
    ours = {s for s in undefined if not s.startswith(("_Z", "_", "mem", "str"))}
    assert ours <= {"getPluginRegistry", "cuLaunchKernel", "cuModuleGetFunction", "cuModuleLoadData", "cuFuncSetAttribute"}, ours
    assert {"getPluginRegistry", "cuLaunchKernel"} <= ours
    defined = set(defined_symbols(lib))
    assert {f"kvc_decode_split_{variant}_launch", f"kvc_decode_reduce_{variant}_launch"} <= defined  # C linkage: unmangled, resolved inside


def test_plugin_lib_cli_rejects_a_directory_without_headers(tmp_path):
    p = subprocess.run([sys.executable, "-m", "kvcompress.targets.plugin_lib", "--trt-include", str(tmp_path), "--kernels", str(tmp_path),
                        "--variant", "x"], capture_output=True, text=True)
    assert p.returncode == 1 and "has no NvInferRuntime.h" in p.stderr and "Traceback" not in p.stderr


@needs_trt
def test_export_compiles_the_plugin_library_and_says_so(tmp_path):
    import json

    from conftest import run_cli

    run = tmp_path / "r"
    p = run_cli("model=tiny_llama", "calib=smoke", "eval=smoke", "export.archs=[sm_90]", f"hydra.run.dir={run}", cache_dir=tmp_path / "c")
    assert p.returncode == 0, p.stderr[-2000:]
    m = json.loads((run / "export" / "manifest.json").read_text())
    rows = [c for c in m["checks"] if c["check"].startswith("plugin library sm_90")]
    assert len(rows) == 1 and rows[0]["status"] == "passed"
    assert (run / "export" / "plugin_bundle" / "lib" / "sm_90" / "libkvcompress_trt.so").is_file() or any(
        (run / "export").rglob("libkvcompress_trt.so"))
    assert "compiled in this run" in m["not_verified_here"]["TensorRT plugin wrapper"]
