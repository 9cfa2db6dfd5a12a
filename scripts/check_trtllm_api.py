"""Development-time check (not in CI): every TensorRT and TensorRT-LLM name the custom-tier network
(kvcompress/targets/trtllm_network.py) uses exists in the pinned sources, with the arguments it passes.

    python scripts/check_trtllm_api.py --trt-src /path/to/TensorRT@v10.13.3 --trtllm-src /path/to/TensorRT-LLM@v1.2.1 [--record]

--trt-src: a checkout of github.com/NVIDIA/TensorRT at tag v10.13.3 (the Python bindings' pybind11
sources under python/src/infer/ are what `import tensorrt` exposes). --trtllm-src: a checkout of
github.com/NVIDIA/TensorRT-LLM at tag v1.2.1, or the site-packages directory of an installed
tensorrt_llm==1.2.1 wheel (the tensorrt_llm/ package is read as source, never imported). Either may
be omitted; its names are then reported "not checked". --record writes the result to
export/TRTLLM_API_CHECK.md.

How: the uses are extracted from trtllm_network.py's syntax tree (attribute accesses on the TensorRT
module, network, registry, creator, layers and builder config; calls on TensorRT-LLM's Builder,
Network, Tensor, Session), so a new call cannot escape the check. TensorRT names are looked up in the
pybind11 definitions (.def / .def_property / .value / m.attr / py::class_) of their class, with the
keyword names of the arguments ("x"_a) counted against the positional arguments passed; TensorRT-LLM
names in the package's syntax tree (function and method signatures, properties, dataclass fields).
"""
from __future__ import annotations

import argparse
import ast
import datetime
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NETWORK = ROOT / "kvcompress" / "targets" / "trtllm_network.py"
RECORD = ROOT / "export" / "TRTLLM_API_CHECK.md"

# receivers in trtllm_network.py -> the TensorRT Python class they are (by construction of the code)
TRT_RECEIVERS = {"trt": "<module>", "self.trt": "<module>", "self.net": "INetworkDefinition", "self.registry": "IPluginRegistry",
                 "creator": "IPluginCreatorV3One", "layer": "ILayer", "config.trt_builder_config": "IBuilderConfig", "x": "ITensor", "op": "MatrixOperation"}
LAYER_SUBCLASS = {"reshape_dims": "IShuffleLayer", "axes": "ISoftMaxLayer"}  # properties of a specific layer class
# TensorRT-LLM: receiver -> (file, class); imported names -> (file, qualname)
TRTLLM_RECEIVERS = {"builder": ("tensorrt_llm/builder.py", "Builder"), "network": ("tensorrt_llm/network.py", "Network"),
                    "config": ("tensorrt_llm/builder.py", "BuilderConfig"), "session": ("tensorrt_llm/runtime/session.py", "Session")}
TRTLLM_IMPORTS = {"tensorrt_llm.builder": "tensorrt_llm/builder.py", "tensorrt_llm.network": "tensorrt_llm/network.py", "tensorrt_llm._utils": "tensorrt_llm/_utils.py",
                  "tensorrt_llm.functional": "tensorrt_llm/functional.py", "tensorrt_llm.runtime.session": "tensorrt_llm/runtime/session.py"}


def dotted(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def extract_uses(src: Path = NETWORK) -> dict:
    """{"trt": {(class, name): [n_positional, ...]}, "trtllm": {(file, qual, name): [(n_pos, kwargs)]}} from the code."""
    tree = ast.parse(src.read_text())
    trt_uses: dict[tuple, list] = {}
    llm_uses: dict[tuple, list] = {}
    imported = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in TRTLLM_IMPORTS:
            for n in node.names:
                imported[n.asname or n.name] = (TRTLLM_IMPORTS[node.module], n.name)
    calls = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for node in ast.walk(tree):
        call = calls.get(id(node))
        arity = (len(call.args), sorted(k.arg for k in call.keywords if k.arg)) if call else None
        if isinstance(node, ast.Attribute):
            base = dotted(node.value)
            owner = None
            if base in TRT_RECEIVERS:
                owner = TRT_RECEIVERS[base]
            elif base and (base.startswith("trt.") or base.startswith("self.trt.")) and base.count(".") == (1 if base.startswith("trt.") else 2):
                owner = base.rsplit(".", 1)[1]  # an enum or class of the module: trt.MatrixOperation.NONE
            elif isinstance(node.value, ast.Call) and (dotted(node.value.func) or "").startswith("self.net.add_"):
                owner = "ILayer"  # self.net.add_X(...).get_output(0)
            if owner == "ILayer" and node.attr in LAYER_SUBCLASS:
                owner = LAYER_SUBCLASS[node.attr]
            if owner:
                trt_uses.setdefault((owner, node.attr), []).append(arity)
            if base in TRTLLM_RECEIVERS:
                f, cls = TRTLLM_RECEIVERS[base]
                llm_uses.setdefault((f, cls, node.attr), []).append(arity)
            if base in imported:  # Session.from_serialized_engine
                f, name = imported[base]
                llm_uses.setdefault((f, name, node.attr), []).append(arity)
            if node.attr == "trt_tensor":
                llm_uses.setdefault(("tensorrt_llm/functional.py", "Tensor", "trt_tensor"), []).append(None)
        elif isinstance(node, ast.Name) and node.id in imported and call is not None:
            f, name = imported[node.id]
            llm_uses.setdefault((f, name, "__call__"), []).append(arity)
    return {"trt": trt_uses, "trtllm": llm_uses}


# ---------------------------------------------------------------------------------------------- TensorRT

def trt_bindings(trt_src: Path) -> dict[str, dict[str, list[str] | None]]:
    """{class or '<module>': {name: keyword names of its arguments (None for values/properties)}} from the pybind11 sources."""
    files = sorted((trt_src / "python" / "src").rglob("*.cpp"))
    if not files:
        raise FileNotFoundError(f"{trt_src}/python/src has no pybind11 sources (give a TensorRT checkout at v10.13.3)")
    api: dict[str, dict] = {"<module>": {}}
    owner_re = re.compile(r'py::(class_|enum_|bind_vector|bind_map)\s*<[^;]*?>\s*\(\s*m\s*,\s*"(\w+)"')
    item_re = re.compile(r'(m\.def|\.def_property_readonly|\.def_property|\.def_readwrite|\.def_static|\.def|\.value|m\.attr)\s*\(\s*"(\w+)"')
    for f in files:
        text = f.read_text(errors="replace")
        owners = [(m.start(), m.group(2)) for m in owner_re.finditer(text)]
        for m in owners:
            api.setdefault(m[1], {})
        items = list(item_re.finditer(text))
        for j, m in enumerate(items):
            kind, name = m.group(1), m.group(2)
            end = items[j + 1].start() if j + 1 < len(items) else len(text)
            body = text[m.end(): end]
            body = body[: body.find(";") + 1] if ";" in body else body
            owner = "<module>" if kind.startswith("m.") else next((o for pos, o in reversed(owners) if pos < m.start()), "<module>")
            args = re.findall(r'"(\w+)"_a', body) if kind in (".def", "m.def", ".def_static") else None
            prev = api.setdefault(owner, {}).get(name)
            api[owner][name] = (args if prev is None else (prev if args is None else max(prev, args, key=len)))
        for m in re.finditer(r'm\.attr\("(\w+)"\)', text):
            api["<module>"][m.group(1)] = None
    return api


def check_trt(uses: dict, trt_src: Path) -> list[tuple[str, bool, str]]:
    api = trt_bindings(trt_src)
    rows = []
    for (owner, name), arities in sorted(uses.items()):
        label = f"trt.{name}" if owner == "<module>" else f"{owner}.{name}"
        if owner not in api:
            rows.append((label, False, f"class {owner} not bound"))
            continue
        if name not in api[owner] and not (owner == "<module>" and name in api):
            rows.append((label, False, "not bound"))
            continue
        args = api[owner].get(name)
        if owner == "<module>" and name in api and name not in api["<module>"]:
            rows.append((label, True, "class bound (constructor arguments not checked)"))
            continue
        bad = [a for a in arities if a and args is not None and (a[0] > len(args) or any(k not in args for k in a[1]))]
        rows.append((label, not bad, f"args {args}" if args is not None else "bound" if not bad else f"passed {bad}"))
    return rows


# ---------------------------------------------------------------------------------------------- TensorRT-LLM

def _params(fn: ast.FunctionDef) -> tuple[list[str], bool]:
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    return names, a.kwarg is not None


def _find_class(tree, name):
    return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)


def check_trtllm(uses: dict, trtllm_src: Path) -> list[tuple[str, bool, str]]:
    root = trtllm_src if (trtllm_src / "tensorrt_llm").is_dir() else trtllm_src.parent
    if not (root / "tensorrt_llm").is_dir():
        raise FileNotFoundError(f"{trtllm_src} has no tensorrt_llm/ package (a checkout at v1.2.1 or site-packages of the wheel)")
    version = re.search(r'__version__\s*=\s*"([^"]+)"', (root / "tensorrt_llm" / "version.py").read_text())
    rows = [("tensorrt_llm.__version__", bool(version and version.group(1) == "1.2.1"), version.group(1) if version else "unknown")]
    trees = {}
    for (f, qual, name), arities in sorted(uses.items()):
        label = f"{f.removesuffix('.py').replace('/', '.')}.{qual}" + ("" if name == "__call__" else f".{name}")
        p = root / f
        if not p.is_file():
            rows.append((label, False, f"{f} missing"))
            continue
        tree = trees.setdefault(f, ast.parse(p.read_text()))
        top = next((n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == qual), None)
        if top is None:
            rows.append((label, False, f"{qual} not defined in {f}"))
            continue
        if isinstance(top, ast.FunctionDef):  # a function called directly (net_guard)
            fn = top if name == "__call__" else None
        else:
            members = {n.name: n for n in top.body if isinstance(n, ast.FunctionDef)}
            fields = [n.target.id for n in top.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
            if name == "__call__":
                fn = members.get("__init__")
                if fn is None:  # a dataclass (its fields), or object's constructor (no arguments)
                    bad = [a for a in arities if a and (a[0] > len(fields) or any(k not in fields for k in a[1]))]
                    rows.append((label, not bad, f"dataclass fields {fields}" if fields else "no __init__: takes no arguments"))
                    continue
            elif name not in members and name in fields + [t.id for n in top.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)]:
                rows.append((label, True, "class attribute"))  # an enum member (AllReduceStrategy.NCCL) or a field
                continue
            elif name in members:
                fn = members[name]
                decos = {dotted(d) for d in fn.decorator_list}
                if "property" in decos:
                    rows.append((label, True, "property"))
                    continue
            else:
                rows.append((label, False, f"{qual}.{name} not defined"))
                continue
        if fn is None:
            rows.append((label, False, "not callable as used"))
            continue
        params, var_kw = _params(fn)
        bound = params[1:] if params[:1] in (["self"], ["cls"]) else params
        bad = [a for a in arities if a and (a[0] > len(bound) or (not var_kw and any(k not in params for k in a[1])))]
        rows.append((label, not bad, f"params {bound}" + (" **kwargs" if var_kw else "")))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trt-src", type=Path, help="TensorRT checkout at v10.13.3")
    ap.add_argument("--trtllm-src", type=Path, help="TensorRT-LLM checkout at v1.2.1, or site-packages of the wheel")
    ap.add_argument("--record", action="store_true", help=f"write the result to {RECORD.relative_to(ROOT)}")
    a = ap.parse_args()
    uses = extract_uses()
    sections = []
    ok = True
    for label, src, fn, key in (("TensorRT (pybind11 sources)", a.trt_src, check_trt, "trt"), ("TensorRT-LLM (Python sources)", a.trtllm_src, check_trtllm, "trtllm")):
        if src is None:
            sections.append((label, None, [(f"{len(uses[key])} names", None, "not checked: no source tree given")]))
            continue
        try:
            rows = fn(uses[key], src)
        except FileNotFoundError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        ok &= all(r[1] for r in rows)
        sections.append((label, str(src), rows))
    lines = []
    for label, src, rows in sections:
        lines.append(f"## {label}" + (f": `{src}`" if src else ""))
        lines += ["", "| name | status | found |", "|---|---|---|"]
        lines += [f"| `{n}` | {'PASS' if s else 'not checked' if s is None else 'FAIL'} | {d} |" for n, s, d in rows]
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if a.record:
        head = (f"# Last result of scripts/check_trtllm_api.py ({datetime.date.today().isoformat()})\n\n"
                f"Names used by kvcompress/targets/trtllm_network.py, checked against the pinned sources. Command:\n"
                f"`python scripts/check_trtllm_api.py {'--trt-src ' + str(a.trt_src) if a.trt_src else ''} {'--trtllm-src ' + str(a.trtllm_src) if a.trtllm_src else ''} --record`\n\n")
        RECORD.write_text(head + text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
