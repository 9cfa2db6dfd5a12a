"""C launchers for the AOT-compiled Triton kernels (CUDA driver API, cubin embedded).

For each kernel in kernels.json: `kvc_<name>_load()` loads the embedded cubin and
`kvc_<name>_launch(stream, gx, gy, gz, <typed kernel args>)` launches it with the block size and
shared memory Triton compiled it for, after checking every buffer is 16-byte aligned (the kernels
are compiled for aligned, vectorized loads; a misaligned buffer returns CUDA_ERROR_INVALID_VALUE). Triton kernels take two trailing scratch pointers
(global and profile scratch), passed as null since these kernels need none.
"""
from __future__ import annotations

import json
from pathlib import Path

from kvcompress.kernels.aot import POINTER_ALIGN

C_TYPES = {"i32": "int32_t", "fp32": "float"}


def _ctype(t: str) -> str:
    return "CUdeviceptr" if t.startswith("*") else C_TYPES[t]


def generate(kernel_dir: Path) -> list[Path]:
    """Write kvc_launchers.h and one .c per kernel next to the cubins; returns the paths."""
    meta = json.loads((kernel_dir / "kernels.json").read_text())
    header = ["/* kvcompress AOT kernel launchers (generated; do not edit). C linkage: the TensorRT plugin (C++) calls them. */",
              "#pragma once", "#include <cuda.h>", "#include <stdint.h>", "", "#ifdef __cplusplus", 'extern "C" {', "#endif", ""]
    files = []
    for k in meta["kernels"]:
        name = k["name"]
        params = ", ".join(f"{_ctype(t)} {a}" for a, t in k["signature"].items())
        header += [f"CUresult kvc_{name}_load(void);", f"CUresult kvc_{name}_launch(CUstream stream, unsigned gx, unsigned gy, unsigned gz, {params});", ""]
        cubin = (kernel_dir / f"{name}.cubin").read_bytes()
        data = ",".join(str(b) for b in cubin)
        args = ", ".join(f"&{a}" for a in k["signature"]) + ", &global_scratch, &profile_scratch"
        align_check = " || ".join(f"({a} % {POINTER_ALIGN})" for a, t in k["signature"].items() if t.startswith("*")) or "0"
        src = f"""/* {name}: Triton kernel `{k['function']}` for {meta['arch']}, {k['num_warps']} warps, {k['shared']} B shared memory.
   constexprs: {json.dumps(k['constexprs'])} */
#include "kvc_launchers.h"

static const unsigned char CUBIN[{len(cubin)}] = {{{data}}};
static CUmodule module_ = 0;
static CUfunction function_ = 0;

CUresult kvc_{name}_load(void) {{
  if (function_) return CUDA_SUCCESS;
  CUresult r = cuModuleLoadData(&module_, CUBIN);
  if (r != CUDA_SUCCESS) return r;
  r = cuModuleGetFunction(&function_, module_, "{k['function']}");
  if (r != CUDA_SUCCESS) return r;
  if ({k['shared']} > 49152)
    r = cuFuncSetAttribute(function_, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, {k['shared']});
  return r;
}}

CUresult kvc_{name}_launch(CUstream stream, unsigned gx, unsigned gy, unsigned gz, {params}) {{
  CUdeviceptr global_scratch = 0, profile_scratch = 0;
  /* compiled for {POINTER_ALIGN}-byte-aligned buffers (vectorized loads): refuse anything else */
  if ({align_check}) return CUDA_ERROR_INVALID_VALUE;
  void *args[] = {{{args}}};
  if (!function_) {{ CUresult r = kvc_{name}_load(); if (r != CUDA_SUCCESS) return r; }}
  return cuLaunchKernel(function_, gx, gy, gz, {32 * k['num_warps']}, 1, 1, {k['shared']}, stream, args, NULL);
}}
"""
        path = kernel_dir / f"kvc_{name}.c"
        path.write_text(src)
        files.append(path)
    header += ["#ifdef __cplusplus", "}", "#endif"]
    h = kernel_dir / "kvc_launchers.h"
    h.write_text("\n".join(header) + "\n")
    return [h, *files, *variant_headers(meta, kernel_dir)]


VARIANT_MACROS = {"D": "head_dim", "G": "gqa", "KEY_BITS": "key_bits", "VAL_BITS": "value_bits", "GROUP": "group", "NS": "n_sink",
                  "W": "window", "N_OUT": "n_out", "BLOCK_T": "block_t",
                  # the grouped family (0 for the static family): tokens per key group and the values' options
                  "GT": "key_group_tokens", "V_SYM": "value_symmetric", "V_ROT": "value_rotate", "V_CODE": "value_coded_min",
                  # the per-token family (0 otherwise): channels per key scale, keys rotated
                  "KGROUP": "key_group", "KROT": "key_rotate"}


def variant_headers(meta: dict, kernel_dir: Path) -> list[Path]:
    """kvc_variant_<name>.h per variant: the compiled constants, so the plugin checks shapes against them."""
    out = {}
    for k in meta["kernels"]:
        v = k["variant"]
        if v["name"] in out:
            continue
        lines = [f"/* kvcompress variant {v['name']} (generated): the constants its kernels were compiled with. */", "#pragma once",
                 f'#define KVC_VARIANT_NAME "{v["name"]}"', *(f"#define KVC_{m} {int(v.get(f, 0))}" for m, f in VARIANT_MACROS.items())]
        path = kernel_dir / f"kvc_variant_{v['name']}.h"
        path.write_text("\n".join(lines) + "\n")
        out[v["name"]] = path
    return list(out.values())


def cuda_include_dirs() -> list[Path]:
    """Where cuda.h is: the CUDA toolkit, else the copy Triton ships."""
    import triton

    cands = [Path("/usr/local/cuda/include"), Path(triton.__file__).parent / "backends" / "nvidia" / "include"]
    return [p for p in cands if (p / "cuda.h").is_file()]
