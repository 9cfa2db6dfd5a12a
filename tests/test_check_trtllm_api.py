"""scripts/check_trtllm_api.py: the development-time name check of the custom-tier network against the
pinned TensorRT / TensorRT-LLM sources. The pinned trees are not in CI; these tests run the checker on
small synthetic trees built from the network's own uses, and show it fails on a missing name or a
signature that cannot take the arguments passed."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import check_trtllm_api as chk  # noqa: E402


def _trt_tree(tmp_path, drop: str | None = None):
    """pybind11-like sources binding exactly what the network uses (minus `drop`)."""
    uses = chk.extract_uses()["trt"]
    owners: dict[str, list[str]] = {}
    for (owner, name), arities in uses.items():
        if f"{owner}.{name}" == drop:
            continue
        n = max((a[0] for a in arities if a), default=0)
        args = "".join(f', "a{i}"_a' for i in range(n))
        owners.setdefault(owner, []).append(f'.def("{name}", &f{args})' if any(arities) else f'.def_property("{name}", &g, &s)')
    lines = []
    for owner, defs in owners.items():
        if owner == "<module>":
            lines += [f'    m.attr("{d.split(chr(34))[1]}") = 1;' for d in defs]
        else:
            lines.append(f'    py::class_<{owner}>(m, "{owner}")\n        ' + "\n        ".join(defs) + ";")
    d = tmp_path / "trt" / "python" / "src" / "infer"
    d.mkdir(parents=True)
    (d / "pyAll.cpp").write_text("void bind(py::module& m) {\n" + "\n".join(lines) + "\n}\n")
    return tmp_path / "trt"


SIGS = {
    "tensorrt_llm/version.py": '__version__ = "1.2.1"\n',
    "tensorrt_llm/builder.py": """
        class BuilderConfig:
            @property
            def trt_builder_config(self):
                return self._c
        class Builder:
            def create_network(self):
                pass
            def create_builder_config(self, precision, timing_cache=None, strongly_typed=True, **kwargs):
                pass
            def build_engine(self, network, builder_config, managed_weights=None):
                pass
        """,
    "tensorrt_llm/network.py": """
        class Network:
            @property
            def trt_network(self):
                return self._n
            @property
            def plugin_config(self):
                return self._p
        def net_guard(network):
            pass
        """,
    "tensorrt_llm/functional.py": """
        class Tensor:
            def __init__(self, name=None, dtype=None, shape=None, dim_range=None, is_network_input=True, network=None, trt_tensor=None):
                pass
            @property
            def trt_tensor(self):
                return self._t
        class AllReduceStrategy(IntEnum):
            NCCL = 0
            AUTO = 3
        class AllReduceParams:
            def __init__(self, strategy=AllReduceStrategy.AUTO, fusion_op=None, bias=None, residual=None):
                pass
        def allreduce(tensor, group, all_reduce_params=None):
            pass
        """,
    "tensorrt_llm/_utils.py": """
        def mpi_rank():
            pass
        def mpi_world_size():
            pass
        """,
    "tensorrt_llm/runtime/session.py": """
        from dataclasses import dataclass
        @dataclass
        class TensorInfo:
            name: str
            dtype: object
            shape: tuple
        class Session:
            @staticmethod
            def from_serialized_engine(engine):
                pass
            def infer_shapes(self, inputs, context=None):
                pass
            def run(self, inputs, outputs, stream, context=None):
                pass
        """,
}


def _llm_tree(tmp_path, patch: tuple[str, str, str] | None = None):
    for f, text in SIGS.items():
        text = textwrap.dedent(text)
        if patch and patch[0] == f:
            text = text.replace(patch[1], patch[2])
        p = tmp_path / "llm" / f
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path / "llm"


def _run(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "check_trtllm_api.py"), *map(str, args)], capture_output=True, text=True)


def test_uses_are_extracted_from_the_network_code():
    u = chk.extract_uses()
    assert ("INetworkDefinition", "add_plugin_v3") in u["trt"] and u["trt"][("INetworkDefinition", "add_plugin_v3")][0][0] == 3
    assert ("PreviewFeature", "ALIASED_PLUGIN_IO_10_03") in u["trt"] and ("IShuffleLayer", "reshape_dims") in u["trt"]
    assert ("tensorrt_llm/runtime/session.py", "Session", "run") in u["trtllm"]
    assert ("tensorrt_llm/functional.py", "Tensor", "__call__") in u["trtllm"]


def test_check_passes_on_trees_that_have_every_name(tmp_path):
    r = _run("--trt-src", _trt_tree(tmp_path), "--trtllm-src", _llm_tree(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FAIL" not in r.stdout and r.stdout.count("| PASS |") > 40


@pytest.mark.parametrize("drop", ["INetworkDefinition.add_plugin_v3", "PreviewFeature.ALIASED_PLUGIN_IO_10_03"])
def test_a_missing_tensorrt_binding_fails(tmp_path, drop):
    r = _run("--trt-src", _trt_tree(tmp_path, drop=drop))
    assert r.returncode == 1 and f"| `{drop}` | FAIL |" in r.stdout, r.stdout


@pytest.mark.parametrize("patch,fails", [
    (("tensorrt_llm/runtime/session.py", "def run(self, inputs, outputs, stream, context=None)", "def run(self, inputs, outputs)"), True),
    (("tensorrt_llm/builder.py", "strongly_typed=True, **kwargs", "**kwargs"), False),  # **kwargs takes strongly_typed=
    (("tensorrt_llm/builder.py", "strongly_typed=True, **kwargs", "other=True"), True),
    (("tensorrt_llm/network.py", "def net_guard(network)", "def other_guard(network)"), True),
    (("tensorrt_llm/functional.py", "NCCL = 0", "ONESHOT = 4"), True),  # the all-reduce strategy the tensor-parallel graph names
    (("tensorrt_llm/functional.py", "def allreduce(tensor, group, all_reduce_params=None)", "def allreduce(tensor, group)"), True),
    (("tensorrt_llm/version.py", "1.2.1", "1.3.0"), True),
], ids=["run-arity", "kwargs-absorbs", "missing-keyword", "missing-function", "missing-enum-member", "allreduce-arity", "version"])
def test_a_trtllm_signature_that_cannot_take_the_call_fails(tmp_path, patch, fails):
    r = _run("--trtllm-src", _llm_tree(tmp_path, patch))
    assert (r.returncode == 1) == fails and ("FAIL" in r.stdout) == fails, r.stdout


def test_a_tree_without_sources_is_a_clear_error(tmp_path):
    r = _run("--trt-src", tmp_path)
    assert r.returncode == 2 and "error:" in r.stderr and "Traceback" not in r.stderr
