"""Ahead-of-time compilation of the Triton kernels for NVIDIA targets, on a machine without a GPU.

    python -m kvcompress.kernels.aot --arch sm_90 --out DIR [--variants default]

For every variant (kv format x head geometry) and kernel it writes DIR/<name>.ptx and
DIR/<name>.cubin, DIR/kernels.json with the signature, constexprs, launch shape, shared memory and
cuobjdump's resource report of the cubin (registers, stack, local memory = spills), and
DIR/audit.json, the SASS audit of every kernel (kvcompress.kernels.audit: occupancy, load widths).
Pointer arguments are compiled as 16-byte aligned (POINTER_ALIGN), so contiguous loads vectorize.
The plugin bundle of the export reuses this output.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvcompress.kernels import plan
from kvcompress.kernels.audit import audit_dir, nvidia_tool
from kvcompress.kernels.ops import decode_launch_params, grouped_constants, grouped_decode_words, per_token_constants
from kvcompress.kernels.triton_grp import decode_split_grp_kernel, kv_append_grp_kernel
from kvcompress.kernels.triton_kv import decode_split_kernel, kv_append_kernel
from kvcompress.kernels.triton_rot import decode_split_rot_kernel, kv_append_rot_kernel
from kvcompress.kernels.triton_steps import decode_reduce_kernel

ARCHS = {"sm_80": 80, "sm_90": 90}
SMEM_LIMIT = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}  # max dynamic shared memory per block


@dataclass(frozen=True)
class Variant:
    """One specialisation: kv format and head geometry (G = query heads per kv head). Tile sizes
    default to kvcompress.kernels.plan's choice; the split count is a launch argument."""

    name: str
    head_dim: int
    gqa: int
    key_bits: int
    value_bits: int
    group: int
    n_sink: int
    window: int
    n_out: int
    block_t: int = 0  # 0: plan.block_t(head_dim, value_bits)
    decode_warps: int = 0  # 0: plan.decode_warps(head_dim)
    # the per-token family (kv.key.granularity=token, e.g. kv=rot4): kv_append_rot / decode_split_rot
    key_group: int = 0  # > 0: per-token symmetric key scales over key_group channels
    key_rotate: bool = False
    value_symmetric: bool = False
    value_rotate: bool = False
    value_coded_min: bool = False
    # the grouped family (kv.key.group_tokens, e.g. kv=wf4): kv_append_grp / decode_split_grp; key_bits is the mean width
    # (the per-channel widths are a runtime table, so one build serves every water-filled allocation)
    key_group_tokens: int = 0
    decode_maxnreg: int = 0  # 0: plan.decode_maxnreg(head_dim, grouped, gqa) (None: 0 after init, no cap); -1: no cap

    @property
    def per_token(self) -> bool:
        return bool(self.key_group)

    @property
    def grouped(self) -> bool:
        return bool(self.key_group_tokens)

    def __post_init__(self):
        if not self.decode_warps:
            object.__setattr__(self, "decode_warps", plan.decode_warps(self.head_dim, self.per_token or self.grouped))
        if not self.block_t:
            object.__setattr__(self, "block_t", plan.block_t(self.head_dim, self.value_bits, self.decode_warps, self.key_group_tokens))
        if not self.decode_maxnreg:
            object.__setattr__(self, "decode_maxnreg", plan.decode_maxnreg(self.head_dim, self.grouped, self.gqa) or 0)
        if self.grouped:  # a decode tile lies in one key group
            object.__setattr__(self, "block_t", min(self.block_t, self.key_group_tokens))


VARIANTS = {
    "default": [
        # Llama-3-70B / 8B: head dim 128, 8 query heads per kv head
        Variant("d128_g8_int8k_int4v", 128, 8, 8, 4, 32, 4, 128, 0),
        Variant("d128_g8_int8", 128, 8, 8, 8, 128, 4, 128, 0),
        Variant("d128_g8_int4", 128, 8, 4, 4, 32, 4, 128, 2),
        # SmolLM2-135M: head dim 64, 3 query heads per kv head
        Variant("d64_g3_int8k_int4v", 64, 3, 8, 4, 32, 4, 128, 0),
    ],
    # kv=rot4 (Hadamard-rotated per-token int4 keys and values) and kv=rot8k_int4v (rotated per-token
    # int8 keys, rotated asymmetric int4 values in groups of 32, the min a byte): in the custom tier
    "per_token": [
        Variant("d128_g8_rot4", 128, 8, 4, 4, 128, 4, 128, 0, key_group=128, key_rotate=True, value_symmetric=True, value_rotate=True),
        Variant("d64_g3_rot4", 64, 3, 4, 4, 64, 4, 128, 0, key_group=64, key_rotate=True, value_symmetric=True, value_rotate=True),
        Variant("d128_g8_rot8k_int4v", 128, 8, 8, 4, 32, 4, 128, 0, key_group=128, key_rotate=True, value_rotate=True, value_coded_min=True),
        # kv=rot7k_int5v: 7-bit keys and 5-bit values (a nibble plus bit planes per row), at rot8k_int4v's bytes
        Variant("d128_g8_rot7k_int5v", 128, 8, 7, 5, 32, 4, 128, 0, key_group=128, key_rotate=True, value_rotate=True, value_coded_min=True),
        Variant("d64_g3_rot7k_int5v", 64, 3, 7, 5, 32, 4, 128, 0, key_group=64, key_rotate=True, value_rotate=True, value_coded_min=True),
    ],
    # kv=wf4 (token-grouped keys of water-filled widths, mean 4 bits, groups of 128 tokens; rotated symmetric int4 values):
    # in the custom tier (the plugins built for a grouped variant take the widths and bit offsets)
    "grouped": [
        Variant("d128_g8_wf4", 128, 8, 4, 4, 128, 4, 128, 0, value_symmetric=True, value_rotate=True, key_group_tokens=128),
        Variant("d64_g3_wf4", 64, 3, 4, 4, 64, 4, 128, 0, value_symmetric=True, value_rotate=True, key_group_tokens=128),
        # kv=wf5 / kv=wf6: mean widths 5 and 6 (key rows of 80 / 96 bytes at head dim 128, 40 / 48 at 64), 5- and 6-bit values
        Variant("d128_g8_wf5", 128, 8, 5, 5, 128, 4, 128, 0, value_symmetric=True, value_rotate=True, key_group_tokens=128),
        Variant("d128_g8_wf6", 128, 8, 6, 6, 128, 4, 128, 0, value_symmetric=True, value_rotate=True, key_group_tokens=128),
        Variant("d64_g3_wf5", 64, 3, 5, 5, 64, 4, 128, 0, value_symmetric=True, value_rotate=True, key_group_tokens=128),
        Variant("d64_g3_wf6", 64, 3, 6, 6, 64, 4, 128, 0, value_symmetric=True, value_rotate=True, key_group_tokens=128),
    ],
    # kv=wf3 (the grouped family at a mean of 3 bits: key rows of 48 / 24 bytes read as 32 / 16 words, 3-bit values as
    # three bit planes): 3 CTAs (12 warps) per SM on sm_90 as the grouped set (168 registers under the cap at d128, 139 at d64)
    "grouped_3bit": [
        Variant("d128_g8_wf3", 128, 8, 3, 3, 128, 4, 128, 0, value_symmetric=True, value_rotate=True, key_group_tokens=128),
        Variant("d64_g3_wf3", 64, 3, 3, 3, 64, 4, 128, 0, value_symmetric=True, value_rotate=True, key_group_tokens=128),
    ],
}

def num_stages(arch: str, kname: str, v: Variant) -> int:
    """The num_stages a kernel of variant v is built with for arch (ops' JIT launches use the same: plan)."""
    return plan.decode_stages(arch, v.head_dim, v.grouped) if kname.startswith("decode_split") else plan.STAGES


def _key_ptr(bits: int) -> str:
    """The key payload's pointer type: signed int8 codes as they are, narrower codes packed offset-binary bytes."""
    return "*i8" if bits == 8 else "*u8"


def _specs(v: Variant) -> list[tuple[str, object, dict, dict, int]]:
    """(kernel name, jit fn, signature, constexprs, num_warps) for the three kernels of a variant."""
    if v.per_token:
        return _per_token_specs(v)
    if v.grouped:
        return _grouped_specs(v)
    fp16 = v.key_bits == 16  # an fp16 layer of a per-layer format: the store holds fp16 K and V rows
    kp = "*fp16" if fp16 else _key_ptr(v.key_bits)
    store = {"SK": "*fp16", "SV": "*fp16", "WK": "*fp16", "WV": "*fp16", "KP": kp, "KO": "*fp16", "VP": "*fp16" if fp16 else "*u8", "VS": "*fp16",
             "VM": "*fp16", "LENS": "*i32"}
    common = dict(D=v.head_dim, NS=v.n_sink, W=v.window, N_OUT=v.n_out, KEY_BITS=v.key_bits, VAL_BITS=v.value_bits, GROUP=v.group)
    launch = decode_launch_params(v.gqa, v.n_sink, v.n_out, v.block_t)
    n_out_pad = launch["N_OUT_PAD"]
    append_sig = {"KN": "*fp16", "VN": "*fp16", "KS": "*fp32", "KZ": "*fp32", "OIDX": "*i32", **store, "H": "i32", "CAP": "i32"}
    split_sig = {"Q": "*fp16", "KS": "*fp32", "KZM": "*fp32", "OIDX": "*i32", **store, "MO": "*fp32", "LO": "*fp32", "AO": "*fp32", "sm_scale": "fp32", "H": "i32", "CAP": "i32", "SPLITS": "i32"}
    reduce_sig = {"MO": "*fp32", "LO": "*fp32", "AO": "*fp32", "OUT": "*fp32", "SPLITS": "i32"}
    return [
        ("kv_append", kv_append_kernel, append_sig, {**common, "N_OUT_PAD": n_out_pad}, plan.append_warps(False, False)),
        ("decode_split", decode_split_kernel, split_sig, {**common, **launch}, v.decode_warps),
        ("decode_reduce", decode_reduce_kernel, reduce_sig, {"D": v.head_dim}, plan.REDUCE_WARPS),
    ]


def _per_token_specs(v: Variant) -> list[tuple[str, object, dict, dict, int]]:
    kp = _key_ptr(v.key_bits)
    vp = "*i8" if v.value_symmetric and v.value_bits == 8 else "*u8"
    store = {"SK": "*fp16", "SV": "*fp16", "WK": "*fp16", "WV": "*fp16", "KP": kp, "KSC": "*fp16", "VP": vp, "VS": "*fp16",
             "VM": "*u8" if v.value_coded_min else "*fp16", "LENS": "*i32"}
    common = dict(NS=v.n_sink, W=v.window, **per_token_constants(v.head_dim, v.key_bits, v.key_group, v.key_rotate, v.value_bits, v.group,
                                                                  v.value_symmetric, v.value_rotate, v.value_coded_min))
    append_sig = {"KN": "*fp16", "VN": "*fp16", **store, "H": "i32", "CAP": "i32"}
    split_sig = {"Q": "*fp16", "QR": "*fp16", **store, "MO": "*fp32", "LO": "*fp32", "AO": "*fp32", "sm_scale": "fp32", "H": "i32", "CAP": "i32", "SPLITS": "i32"}
    reduce_sig = {"MO": "*fp32", "LO": "*fp32", "AO": "*fp32", "OUT": "*fp32", "SPLITS": "i32"}
    return [
        ("kv_append_rot", kv_append_rot_kernel, append_sig, common, plan.append_warps(True, False)),
        ("decode_split_rot", decode_split_rot_kernel, split_sig, {**common, **decode_launch_params(v.gqa, v.n_sink, 0, v.block_t, per_token=True)}, v.decode_warps),
        ("decode_reduce", decode_reduce_kernel, reduce_sig, {"D": v.head_dim}, plan.REDUCE_WARPS),
    ]


def _grouped_specs(v: Variant) -> list[tuple[str, object, dict, dict, int]]:
    vp = "*i8" if v.value_symmetric and v.value_bits == 8 else "*u8"
    store = {"SK": "*fp16", "SV": "*fp16", "WK": "*fp16", "WV": "*fp16", "KP": "*u8", "KB": "*i32", "KOFF": "*i32", "KGS": "*fp16", "KGM": "*fp16",
             "VP": vp, "VS": "*fp16", "VM": "*u8" if v.value_coded_min else "*fp16", "LENS": "*i32"}
    common = dict(NS=v.n_sink, W=v.window, **grouped_constants(v.head_dim, v.key_group_tokens, v.key_bits, v.value_bits, v.group, v.value_symmetric,
                                                                v.value_rotate, v.value_coded_min))
    append_sig = {"KN": "*fp16", "VN": "*fp16", **store, "H": "i32", "CAP": "i32", "CAPG": "i32"}
    split_sig = {"Q": "*fp16", **store, "MO": "*fp32", "LO": "*fp32", "AO": "*fp32", "sm_scale": "fp32", "H": "i32", "CAP": "i32", "CAPG": "i32", "SPLITS": "i32"}
    reduce_sig = {"MO": "*fp32", "LO": "*fp32", "AO": "*fp32", "OUT": "*fp32", "SPLITS": "i32"}
    return [
        ("kv_append_grp", kv_append_grp_kernel, append_sig, common, plan.append_warps(False, True)),
        ("decode_split_grp", decode_split_grp_kernel, split_sig,
         {**common, **grouped_decode_words(common), **decode_launch_params(v.gqa, v.n_sink, 0, v.block_t, per_token=True)}, v.decode_warps),
        ("decode_reduce", decode_reduce_kernel, reduce_sig, {"D": v.head_dim}, plan.REDUCE_WARPS),
    ]


POINTER_ALIGN = 16  # bytes: every buffer the launchers pass must start on a 16-byte boundary (checked by the launchers)


def aligned_attrs(fn, sig: dict) -> dict:
    """Triton's divisibility hint for every pointer argument: the base address is a multiple of
    POINTER_ALIGN bytes, so loads of contiguous rows can be vectorized (what Triton's JIT assumes
    for 16-byte-aligned tensors). The C launchers refuse misaligned buffers."""
    return {(fn.arg_names.index(k),): [["tt.divisibility", POINTER_ALIGN]] for k, t in sig.items() if t.startswith("*")}


def resource_usage(cubin: Path) -> dict:
    """Registers, stack and local (spill) memory of the compiled cubin, as cuobjdump reports them."""
    r = subprocess.run([nvidia_tool("cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True, text=True)
    text = r.stdout + r.stderr
    if r.returncode:
        raise RuntimeError(f"cuobjdump failed on {cubin.name}: {text.strip()[-400:]}")

    def grab(key: str) -> int:
        m = re.search(rf"{key}:(\d+)", text)
        if m is None:
            raise RuntimeError(f"cuobjdump reported no {key} for {cubin.name}: {text.strip()[-300:]}")
        return int(m.group(1))

    # spilled registers live in local memory: LOCAL > 0 (or a stack frame) means spills
    return {"registers": grab("REG"), "stack": grab("STACK"), "local": grab("LOCAL"), "spills": grab("LOCAL") > 0 or grab("STACK") > 0,
            "shared_static": grab("SHARED")}


def compile_all(arch: str, out: Path, variants: list[Variant]) -> dict:
    target = GPUTarget("cuda", ARCHS[arch], 32)
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for v in variants:
        for kname, fn, sig, consts, warps in _specs(v):
            full_sig = {**sig, **{k: "constexpr" for k in consts}}
            src = ASTSource(fn=fn, signature=full_sig, constexprs=consts, attrs=aligned_attrs(fn, sig))
            opts = {"num_warps": warps, "num_stages": num_stages(arch, kname, v)}
            if kname.startswith("decode_split") and v.decode_maxnreg > 0:
                opts["maxnreg"] = v.decode_maxnreg
            ck = triton.compile(src, target=target, options=opts)
            name = f"{kname}_{v.name}"
            (out / f"{name}.ptx").write_text(ck.asm["ptx"])
            (out / f"{name}.cubin").write_bytes(ck.asm["cubin"])
            entry = {
                "name": name,
                "kernel": kname,
                "function": ck.metadata.name,
                "variant": asdict(v),
                "signature": sig,
                "constexprs": consts,
                "num_warps": warps,
                "num_stages": opts["num_stages"],
                "maxnreg": opts.get("maxnreg"),
                "shared": ck.metadata.shared,
                "smem_limit": SMEM_LIMIT[arch],
                **resource_usage(out / f"{name}.cubin"),
            }
            entries.append(entry)
    meta = {"arch": arch, "triton": triton.__version__, "kernels": entries}
    (out / "kernels.json").write_text(json.dumps(meta, indent=2))
    audit_dir(out)  # the SASS audit of every AOT build, stored beside it
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", required=True, help=f"one of {', '.join(ARCHS)}")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--variants", default="default", help=f"one of {', '.join(VARIANTS)}")
    ap.add_argument("--variant-json", default=None, help="compile the variant(s) given as JSON instead: Variant fields, or a list of them")
    a = ap.parse_args(argv)
    if a.arch not in ARCHS:
        print(f"kvcompress: error: --arch={a.arch} is not supported; allowed: {', '.join(ARCHS)}", file=sys.stderr)
        return 2
    if a.variants not in VARIANTS:
        print(f"kvcompress: error: --variants={a.variants} is unknown; allowed: {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    try:
        given = json.loads(a.variant_json) if a.variant_json else None
        variants = [Variant(**v) for v in (given if isinstance(given, list) else [given])] if given else VARIANTS[a.variants]
    except (ValueError, TypeError) as e:  # not JSON, not an object (or a list of them), or not Variant's fields
        print(f"kvcompress: error: --variant-json is not a Variant or a list of them ({type(e).__name__}: {str(e).splitlines()[0]}); "
              f"fields: {', '.join(f.name for f in dataclasses.fields(Variant))}", file=sys.stderr)
        return 2
    meta = compile_all(a.arch, a.out, variants)
    for e in meta["kernels"]:
        print(f"{e['name']:<36} regs {e['registers']:>3}  stack {e['stack']}  local {e['local']}  smem {e['shared']:>6} B")
    print(f"wrote {len(meta['kernels'])} kernels for {a.arch} to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
