"""Compile libkvcompress_trt.so (the TensorRT plugin + the AOT kernels' C launchers) without CMake.

    python -m kvcompress.targets.plugin_lib --trt-include DIR --kernels DIR --variant NAME [NAME ...] --out libkvcompress_trt.so

DIR of --trt-include: TensorRT's public headers (include/ of NVIDIA's open-source TensorRT
repository at the tag TensorRT-LLM 1.2.1 depends on, v10.13.3; or a TensorRT install). --kernels:
an AOT output directory with the generated launchers (plugin_bundle/kernels/<arch>/). The sources
compile with -Wall -Wextra -Werror (C++17); TensorRT's and CUDA's headers are system headers
(-isystem), so warnings inside them do not count. The library is linked with its TensorRT and CUDA
symbols left undefined (resolved at load time by libnvinfer and libcuda); `undefined_symbols`
lists them so a test can check nothing else is missing.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kvcompress.targets.launchers import cuda_include_dirs

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_SOURCES = [ROOT / "plugins" / "trt" / "kvcDecodeAttentionPlugin.cpp", ROOT / "plugins" / "trt" / "kvcAppendPlugin.cpp"]
WARN = ["-Wall", "-Wextra", "-Werror"]


def plugin_namespace(variant: str, n_variants: int) -> str:
    """The plugin namespace a variant registers in: kvcompress, or kvcompress.<variant> in a library
    holding several variants (a per-layer format: one variant per distinct layer format)."""
    return "kvcompress" if n_variants == 1 else f"kvcompress.{variant}"


def kernel_family(kernels: Path, variant: str) -> str:
    """The kernel-name suffix of a variant's AOT build: "_grp" (grouped family), "_rot" (per-token family) or "" (static)."""
    for suffix in ("_grp", "_rot"):
        if (Path(kernels) / f"kvc_decode_split{suffix}_{variant}.c").is_file():
            return suffix
    return ""


def variant_defines(variant: str, n_variants: int = 1, family: str = "") -> list[str]:
    """Compiler definitions that bind the plugin sources to one variant's launchers and constants
    (`family`: kernel_family's suffix). With several variants in one library each copy also gets its own
    C++ namespace (no symbol clashes) and plugin namespace."""
    defs = [f"-DKVC_DECODE_SPLIT_LAUNCH=kvc_decode_split{family}_{variant}_launch", f"-DKVC_DECODE_REDUCE_LAUNCH=kvc_decode_reduce_{variant}_launch",
            f"-DKVC_APPEND_LAUNCH=kvc_kv_append{family}_{variant}_launch", f'-DKVC_VARIANT_HEADER="kvc_variant_{variant}.h"']
    if n_variants > 1:
        defs += [f"-Dkvc=kvc_{variant}", f'-DKVC_PLUGIN_NAMESPACE="{plugin_namespace(variant, n_variants)}"']
    return defs


def build(trt_include: Path, kernels: Path, variant: str | list[str], out: Path) -> list[list[str]]:
    """Compile and link; raises RuntimeError with the compiler's message on failure. Returns the commands.
    `variant`: one name, or several (one library registering every variant's plugins, each under
    kvcompress.<variant>)."""
    cuda = cuda_include_dirs()
    if not cuda:
        raise RuntimeError("no cuda.h found (CUDA toolkit or Triton's copy)")
    if not (Path(trt_include) / "NvInferRuntime.h").is_file():
        raise RuntimeError(f"--trt-include={trt_include} has no NvInferRuntime.h")
    names = [variant] if isinstance(variant, str) else list(variant)
    launchers = {v: sorted(Path(kernels).glob(f"kvc_*_{v}.c")) for v in names}
    for v, files in launchers.items():
        if not files:
            raise RuntimeError(f"--kernels={kernels} has no launchers for --variant={v}")
    sys_inc = ["-isystem", str(trt_include), "-isystem", str(cuda[0])]
    cmds, objs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for v in names:
            for src in launchers[v]:
                objs.append(Path(tmp) / (src.stem + ".o"))
                cmds.append(["gcc", "-std=c11", *WARN, "-fPIC", "-c", str(src), *sys_inc, f"-I{kernels}", "-o", str(objs[-1])])
            for src in PLUGIN_SOURCES:
                objs.append(Path(tmp) / f"{src.stem}_{v}.o")
                cmds.append(["g++", "-std=c++17", *WARN, "-fPIC", "-c", str(src), *sys_inc, f"-I{kernels}", f"-I{src.parent}",
                             *variant_defines(v, len(names), kernel_family(kernels, v)), "-o", str(objs[-1])])
        cmds.append(["g++", "-shared", "-o", str(out), *map(str, objs)])
        for c in cmds:
            r = subprocess.run(c, capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"{' '.join(c[:4])} ... failed:\n{(r.stdout + r.stderr).strip()[-3000:]}")
    return cmds


HARNESS = ROOT / "plugins" / "test" / "plugin_harness.cpp"


def build_harness(trt_include: Path, kernels: Path, variant: str, out: Path) -> None:
    """An executable: the plugin sources + launchers + plugins/test/plugin_harness.cpp (stand-ins for TensorRT's
    registry and logger and the CUDA driver), which drives the plugins' build-time and serialization logic on CPU."""
    cuda = cuda_include_dirs()
    sys_inc = ["-isystem", str(trt_include), "-isystem", str(cuda[0])]
    defs = variant_defines(variant, 1, kernel_family(kernels, variant))
    with tempfile.TemporaryDirectory() as tmp:
        objs = []
        for src in sorted(Path(kernels).glob(f"kvc_*_{variant}.c")):
            objs.append(str(Path(tmp) / (src.stem + ".o")))
            _run(["gcc", "-std=c11", *WARN, "-c", str(src), *sys_inc, f"-I{kernels}", "-o", objs[-1]])
        for src in [*PLUGIN_SOURCES, HARNESS]:
            objs.append(str(Path(tmp) / (src.stem + ".o")))
            _run(["g++", "-std=c++17", *WARN, "-c", str(src), *sys_inc, f"-I{kernels}", f"-I{PLUGIN_SOURCES[0].parent}", *defs, "-o", objs[-1]])
        _run(["g++", "-o", str(out), *objs])


def _run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed:\n{(r.stdout + r.stderr).strip()[-3000:]}")


def undefined_symbols(lib: Path) -> list[str]:
    r = subprocess.run(["nm", "-D", "--undefined-only", str(lib)], capture_output=True, text=True, check=True)
    return [ln.split()[-1] for ln in r.stdout.splitlines() if ln.strip()]


def defined_symbols(lib: Path) -> list[str]:
    r = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True)
    return [ln.split()[-1] for ln in r.stdout.splitlines() if ln.strip()]


def compiler_version() -> str:
    return subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout.splitlines()[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trt-include", type=Path, required=True)
    ap.add_argument("--kernels", type=Path, required=True)
    ap.add_argument("--variant", required=True, nargs="+", help="one variant, or several (a per-layer format's bundle)")
    ap.add_argument("--out", type=Path, default=Path("libkvcompress_trt.so"))
    a = ap.parse_args(argv)
    if shutil.which("g++") is None or shutil.which("gcc") is None:
        print("kvcompress: error: needs gcc and g++ on PATH", file=sys.stderr)
        return 2
    try:
        build(a.trt_include, a.kernels, a.variant if len(a.variant) > 1 else a.variant[0], a.out)
    except RuntimeError as e:
        print(f"kvcompress: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {a.out} ({compiler_version()}; -Wall -Wextra -Werror, C++17); undefined at link time (resolved by TensorRT/CUDA at load): "
          f"{', '.join(s for s in undefined_symbols(a.out) if not s.startswith(('_Z', '__', 'mem', 'str')))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
