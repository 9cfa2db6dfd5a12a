"""SASS audit of the AOT-compiled kernels: what the compiled code really does, on a CPU machine.

    python -m kvcompress.kernels.audit --arch sm_90 [--variants default|per_token|grouped|grouped_3bit|all] [--variant NAME ...] [--aot DIR] [--out audit.json]

Compiles the variants (or reads an AOT output directory), disassembles each cubin with the
cuobjdump Triton ships, and reports per kernel: registers per thread, spills (local memory /
stack), static and dynamic shared memory, threads per block, theoretical occupancy on sm_80 and
sm_90 (published per-architecture limits), and for the decode kernel's main loop (the first loop
of decode_split_kernel: its compressed-store loop) the global loads by width and the bytes they
bring per iteration, beside what the layout needs (kvcompress.kernels.bytes_model). Which loads
read the packed codes (KP, VP) and how wide they are comes from the same loop in the kernel's
PTX, where each load's address can be followed back to the argument it is computed from (SASS
does not name buffers). Every AOT build writes this as audit.json next to kernels.json (the
plugin bundle ships it).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from kvcompress import reference as ref
from kvcompress.kernels.bytes_model import CacheFormat, main_loop_bytes

# Published limits (CUDA C Programming Guide, "Compute Capabilities" table; occupancy calculator).
ARCH_LIMITS = {
    "sm_80": {"regs_per_sm": 65536, "max_warps_per_sm": 64, "max_ctas_per_sm": 32, "smem_per_sm": 167936, "smem_reserved_per_cta": 1024,
              "reg_alloc_unit": 256, "max_regs_per_thread": 255},
    "sm_90": {"regs_per_sm": 65536, "max_warps_per_sm": 64, "max_ctas_per_sm": 32, "smem_per_sm": 233472, "smem_reserved_per_cta": 1024,
              "reg_alloc_unit": 256, "max_regs_per_thread": 255},
}
_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")


SPLIT_KERNELS = ("decode_split", "decode_split_rot", "decode_split_grp")  # the kernels with a main loop over the compressed store
PAYLOAD_BUFFERS = ("KP", "VP")  # the packed key and value codes (every kernel family names them so)
_PTX_LINE = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.:]*)\s*(.*?);", re.M)
_PTX_WIDTH = re.compile(r"\.(?:b|u|s|f)(8|16|32|64)\b")

def nvidia_tool(name: str) -> str:
    """Triton's bundled copy of an NVIDIA binary tool (cuobjdump, nvdisasm), else the CUDA toolkit's on PATH."""
    import shutil

    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    found = str(bundled) if bundled.is_file() else shutil.which(name)
    if found is None:
        raise RuntimeError(f"no {name} found (Triton's bundled one or the CUDA toolkit's)")
    return found


def sass(cubin: Path) -> str:
    r = subprocess.run([nvidia_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"cuobjdump -sass failed on {cubin.name}: {r.stderr.strip()[-300:]}")
    return r.stdout


def parse(text: str) -> list[tuple[int, str, str]]:
    """[(address, opcode, operands)] of the SASS listing."""
    return [(int(m.group(1), 16), m.group(3), m.group(4)) for m in _INSTR.finditer(text)]


def loops(instrs: list[tuple[int, str, str]]) -> list[tuple[int, int]]:
    """(start, end) address ranges closed by a backward branch, in program order."""
    out = []
    for addr, op, args in instrs:
        m = re.match(r"\s*(0x[0-9a-f]+)", args)
        if op.startswith("BRA") and m and int(m.group(1), 16) < addr:
            out.append((int(m.group(1), 16), addr))
    return sorted(out)


def load_width_bits(op: str) -> int | None:
    """Width of a global load (LDG, or LDGSTS = cp.async global -> shared), else None."""
    if not (op.startswith("LDG.") or op == "LDG" or op.startswith("LDGSTS")):
        return None
    for suffix, bits in ((".128", 128), (".64", 64), (".U16", 16), (".S16", 16), (".U8", 8), (".S8", 8)):
        if suffix in op:
            return bits
    return 32


def global_loads(instrs, lo: int = 0, hi: int = 1 << 62) -> Counter:
    """{width in bits: number of load instructions} in [lo, hi]."""
    c = Counter()
    for addr, op, _ in instrs:
        w = load_width_bits(op)
        if w is not None and lo <= addr <= hi:
            c[w] += 1
    return c


def ptx_loop_loads(ptx: str, signature: dict[str, str]) -> list[tuple[int, tuple[str, ...]]]:
    """Global loads of the kernel's first loop in its PTX: [(width in bits, buffers)], buffers being
    the pointer arguments the load's address is computed from (its def chain followed back to
    ld.param; a loaded value used as an index does not count). Loads are ld.global* and
    cp.async (global -> shared, Triton's pipelined loads). PTX keeps the vector widths ptxas emits,
    and, unlike SASS, names which buffer each load reads."""
    arg_names = list(signature)  # PTX numbers the kernel's non-constexpr arguments in order: <kernel>_param_<i>
    lines = [(m.start(), m.group(1), m.group(2)) for m in _PTX_LINE.finditer(ptx)]
    defs: dict[str, list[tuple[str, str]]] = {}
    for _, op, args in lines:
        m = re.match(r"\s*(%\w+)\s*,(.*)", args)
        if m and not op.startswith(("st.", "cp.async", "bra", "mma", "ldmatrix", "ld.global")):
            defs.setdefault(m.group(1), []).append((op, m.group(2)))

    def buffers(reg: str, seen: set) -> set[str]:
        if reg in seen:
            return set()
        seen.add(reg)
        out = set()
        for op, src in defs.get(reg, []):
            if op.startswith("ld.param"):
                m = re.search(r"_param_(\d+)\]", src)
                if m and int(m.group(1)) < len(arg_names) and signature[arg_names[int(m.group(1))]].startswith("*"):
                    out.add(arg_names[int(m.group(1))])
            else:
                for r in re.findall(r"%\w+", src):
                    out |= buffers(r, seen)
        return out

    start = re.search(r"^(\$L__BB\d+_\d+):[^\n]*Loop Header", ptx, re.M)
    if start is None:
        return []
    label = start.group(1)
    end = re.search(rf"bra(?:\.uni)?\s+{re.escape(label)};", ptx[start.end():])
    if end is None:
        return []
    lo, hi = start.end(), start.end() + end.end()
    out = []
    for pos, op, args in lines:
        if not lo <= pos < hi:
            continue
        if op.startswith("ld.global"):
            vec = re.search(r"\.v(\d+)", op)
            width = (int(vec.group(1)) if vec else 1) * int(_PTX_WIDTH.search(op).group(1))
            regs = re.findall(r"\[\s*(%\w+)", args)[:1]  # [address]
        elif op.startswith("cp.async") and ".global" in op:
            width = int(re.split(r"\s*,\s*", args)[2], 0) * 8
            regs = re.findall(r"\[\s*(%\w+)", args)[1:2]  # [shared destination], [global source]
        else:
            continue
        out.append((width, tuple(sorted(buffers(regs[0], set()))) if regs else ()))
    return out


def occupancy(regs: int, threads: int, smem: int, arch: str | dict) -> dict:
    """Resident CTAs and warps per SM (the occupancy calculator's three limits); arch: an ARCH_LIMITS key, or a dict
    of the same limits (a device's own, scripts/bench_decode_attention.py)."""
    lim = ARCH_LIMITS[arch] if isinstance(arch, str) else arch
    warps = -(-threads // 32)
    regs_per_warp = -(-max(regs, 1) * 32 // lim["reg_alloc_unit"]) * lim["reg_alloc_unit"]
    by_regs = lim["regs_per_sm"] // (regs_per_warp * warps)
    by_warps = lim["max_warps_per_sm"] // warps
    by_smem = lim["smem_per_sm"] // (smem + lim["smem_reserved_per_cta"])
    ctas = min(by_regs, by_warps, by_smem, lim["max_ctas_per_sm"])
    limiter = min((("registers", by_regs), ("warps", by_warps), ("shared memory", by_smem), ("CTA slots", lim["max_ctas_per_sm"])), key=lambda t: t[1])[0]
    return {"ctas_per_sm": ctas, "warps_per_sm": ctas * warps, "occupancy": ctas * warps / lim["max_warps_per_sm"], "limited_by": limiter}


def audit_kernel(entry: dict, kdir: Path) -> dict:
    cubin = kdir / f"{entry['name']}.cubin"
    instrs = parse(sass(cubin))
    threads = 32 * entry["num_warps"]
    st = entry["shared_static"]  # cuobjdump's resource report, read by the AOT build
    smem = entry["shared"] + st
    out = {
        "name": entry["name"], "kernel": entry["kernel"], "registers": entry["registers"], "spills": entry["spills"],
        "local_bytes": entry["local"], "stack_bytes": entry["stack"], "shared_static": st, "shared_dynamic": entry["shared"],
        "threads_per_block": threads, "occupancy": {a: occupancy(entry["registers"], threads, smem, a) for a in ARCH_LIMITS},
        "global_loads": {str(w): n for w, n in sorted(global_loads(instrs).items())}, "instructions": len(instrs),
    }
    if entry["kernel"] in SPLIT_KERNELS:
        v = entry["variant"]
        lp = loops(instrs)
        if not lp:
            raise RuntimeError(f"{entry['name']}: no loop found in the SASS")
        lo, hi = lp[0]
        loads = global_loads(instrs, lo, hi)
        fmt = CacheFormat(v["name"], v["key_bits"], v["value_bits"], v["group"], v["n_sink"], v["window"], v["n_out"],
                          v.get("key_group", 0), v.get("value_symmetric", False), key_group_tokens=v.get("key_group_tokens", 0))
        need = main_loop_bytes(fmt, v["head_dim"], v["block_t"])
        by_width = {w: n * threads * w // 8 for w, n in loads.items()}  # if every thread executes each load once per iteration
        loop_loads = ptx_loop_loads((kdir / f"{entry['name']}.ptx").read_text(), entry["signature"])
        payload = payload_bytes(entry, loop_loads, threads)
        elems = v["block_t"] * v["head_dim"] * 2
        out["main_loop"] = {
            "range": [hex(lo), hex(hi)], "block_t": v["block_t"], "head_dim": v["head_dim"],
            "loads": {str(w): n for w, n in sorted(loads.items())},
            "bytes_per_iteration_by_width": {str(w): b for w, b in sorted(by_width.items())},
            "layout_bytes_per_iteration": need,
            "wide_bytes": sum(b for w, b in by_width.items() if w >= 64),
            "bytes_per_cache_element": sum(by_width.values()) / (v["block_t"] * v["head_dim"] * 2),
            "format_bytes_per_cache_element": (need["payload"] + need["metadata"]) / (v["block_t"] * v["head_dim"] * 2),
            "payload_bytes_per_iteration": payload,
            "masked_payload_bytes_per_cache_element": sum(b["read"] - b["format"] for b in payload.values()) / elems,
        }
        out["main_loop"].update(payload_loads(loop_loads))
    return out


def payload_bytes(entry: dict, loop_loads: list[tuple[int, tuple[str, ...]]], threads: int) -> dict[str, dict[str, int]]:
    """Per main-loop iteration, for each packed buffer (KP, VP): the bytes the format stores for BLOCK_T tokens
    (`format`), the bytes the kernel is written to read (`read`: a 5..7-bit row as two D/2-byte halves, the second's
    tail masked off; a 3-bit row as four D/8-byte plane slots, the last masked off; a grouped key row as NW_PAD 32-bit words, the words past the row masked off; masked lanes fetch
    nothing) and the bytes its compiled loads issue, every thread's loads counted once (`issued`, from the loop's PTX
    loads of that buffer). issued == read: the payload is read exactly as designed, no load replicated across threads."""
    v, c = entry["variant"], entry.get("constexprs", {})
    D, bt = v["head_dim"], v["block_t"]
    if v.get("key_group_tokens"):
        krow, kread = c["KROW"], 4 * c["NW_PAD"]
    else:
        krow = ref.row_width(D, v["key_bits"])
        kread = D if v["key_bits"] in ref.PLANE_BITS and v["key_bits"] > 4 else krow
    vrow = ref.row_width(D, v["value_bits"])
    vread = (D if v["value_bits"] > 4 else D // 2) if v["value_bits"] in ref.PLANE_BITS else vrow  # 3 bits: the four plane slots
    issued = {b: sum(w // 8 * threads for w, bufs in loop_loads if b in bufs) for b in PAYLOAD_BUFFERS}
    return {"KP": {"format": bt * krow, "read": bt * kread, "issued": issued["KP"]},
            "VP": {"format": bt * vrow, "read": bt * vread, "issued": issued["VP"]}}


def payload_loads(loads: list[tuple[int, tuple[str, ...]]]) -> dict:
    """From the main loop's PTX loads: {buffer: {width: count}} for the payload buffers, and the
    narrowest width any payload load has (0 when a payload buffer is not read in the loop at all:
    then the audit cannot vouch for how it is read)."""
    by_buffer = {b: Counter(w for w, bufs in loads if b in bufs) for b in PAYLOAD_BUFFERS}
    widths = [w for c in by_buffer.values() for w in c]
    narrowest = min(widths) if all(by_buffer.values()) else 0
    return {"payload_loads": {b: {str(w): n for w, n in sorted(c.items())} for b, c in by_buffer.items()}, "narrowest_payload_bits": narrowest}


def audit_dir(kdir: Path) -> dict:
    """Audit every kernel of an AOT output directory; writes and returns kdir/audit.json."""
    meta = json.loads((kdir / "kernels.json").read_text())
    res = {"arch": meta["arch"], "triton": meta["triton"], "tool": "cuobjdump -sass (Triton's bundled copy)",
           "limits": ARCH_LIMITS, "kernels": [audit_kernel(e, kdir) for e in meta["kernels"]]}
    tmp = kdir / "audit.json.tmp"
    tmp.write_text(json.dumps(res, indent=2))
    tmp.replace(kdir / "audit.json")
    return res


def main(argv: list[str] | None = None) -> int:
    from kvcompress.kernels.aot import ARCHS, VARIANTS, compile_all

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", required=True, help=f"one of {', '.join(ARCHS)}")
    ap.add_argument("--variant", action="append", default=None, help="variant name(s), of any set (default: every variant of --variants)")
    ap.add_argument("--variants", default="default", help=f"the set to audit: one of {', '.join([*VARIANTS, 'all'])} (default: default)")
    ap.add_argument("--aot", type=Path, default=None, help="an existing AOT output directory (default: compile now)")
    ap.add_argument("--out", type=Path, default=None, help="also write the audit JSON here")
    a = ap.parse_args(argv)
    if a.arch not in ARCHS:
        print(f"kvcompress: error: --arch={a.arch} is not supported; allowed: {', '.join(ARCHS)}", file=sys.stderr)
        return 2
    if a.variants != "all" and a.variants not in VARIANTS:
        print(f"kvcompress: error: --variants={a.variants} is unknown; allowed: {', '.join([*VARIANTS, 'all'])}", file=sys.stderr)
        return 2
    known = {v.name: v for vs in VARIANTS.values() for v in vs}
    bad = [n for n in (a.variant or []) if n not in known]
    if bad:
        print(f"kvcompress: error: --variant={bad[0]} is unknown; allowed: {', '.join(known)}", file=sys.stderr)
        return 2
    if a.aot is not None and not (a.aot / "kernels.json").is_file():
        print(f"kvcompress: error: --aot={a.aot} has no kernels.json; give an output directory of python -m kvcompress.kernels.aot", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        kdir = a.aot or Path(tmp)
        if a.aot is None:
            chosen = list(known.values()) if a.variants == "all" else VARIANTS[a.variants]
            compile_all(a.arch, kdir, [known[n] for n in a.variant] if a.variant else chosen)
        res = audit_dir(kdir)
    if a.out:
        a.out.write_text(json.dumps(res, indent=2))
    for k in res["kernels"]:
        occ = k["occupancy"][a.arch]
        line = (f"{k['name']:<36} regs {k['registers']:>3} spills {'yes' if k['spills'] else 'no ':<3} smem {k['shared_static'] + k['shared_dynamic']:>6} B "
                f"{k['threads_per_block']:>3} thr  {occ['ctas_per_sm']:>2} CTAs/SM {occ['warps_per_sm']:>2} warps ({occ['limited_by']})")
        if "main_loop" in k:
            ml = k["main_loop"]
            pl = "; ".join(f"{b} " + ", ".join(f"{n}x{w}b" for w, n in c.items()) for b, c in ml["payload_loads"].items())
            pb = ml["payload_bytes_per_iteration"]
            fmt_b, read_b, iss_b = (sum(b[x] for b in pb.values()) for x in ("format", "read", "issued"))
            line += (f"  main loop: loads {', '.join(f'{n}x{w}b' for w, n in ml['loads'].items())}; payload ({pl}) via >= {ml['narrowest_payload_bits']}-bit loads, "
                     f"{iss_b} B per {ml['block_t']}-token tile issued for {fmt_b} in the format"
                     + (f" + {read_b - fmt_b} in masked-off lanes (padded rows)" if read_b > fmt_b else "")
                     + f"; {ml['bytes_per_cache_element']:.3f} B/elem loaded vs {ml['format_bytes_per_cache_element']:.3f} in the format "
                     "(every thread's loads counted, a metadata load broadcast to many threads included)")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
