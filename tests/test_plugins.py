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
FIELDS = ("head_dim", "gqa", "key_bits", "value_bits", "group", "n_sink", "window", "n_out")
VARIANTS = {"d128_g8_int8k_int4v": dict(zip(FIELDS, (128, 8, 8, 4, 32, 4, 128, 0))), "d64_g3_int8k_int4v": dict(zip(FIELDS, (64, 3, 8, 4, 32, 4, 128, 0))),
            "d128_g8_int4": dict(zip(FIELDS, (128, 8, 4, 4, 32, 4, 128, 2))),
            # the grouped family (kv=wf4): token-grouped keys of water-filled widths, rotated symmetric int4 values
            "d64_g3_wf4": dict(zip(FIELDS, (64, 3, 4, 4, 64, 4, 128, 0)), value_symmetric=True, value_rotate=True, key_group_tokens=128),
            # kv=wf5: a mean of 5 bits (40-byte key rows read as 16 words, 6 masked), 5-bit values in bit planes
            "d64_g3_wf5": dict(zip(FIELDS, (64, 3, 5, 5, 64, 4, 128, 0)), value_symmetric=True, value_rotate=True, key_group_tokens=128),
            # the per-token family (kv=rot8k_int4v): rotated per-token int8 keys, rotated int4 values with a coded min
            "d128_g8_rot8k_int4v": dict(zip(FIELDS, (128, 8, 8, 4, 32, 4, 128, 0)), key_group=128, key_rotate=True, value_rotate=True,
                                        value_coded_min=True),
            # kv=rot7k_int5v: 7-bit keys and 5-bit values, rows of nibbles plus bit planes
            "d64_g3_rot7k_int5v": dict(zip(FIELDS, (64, 3, 7, 5, 32, 4, 128, 0)), key_group=64, key_rotate=True, value_rotate=True,
                                       value_coded_min=True),
            # an fp16 layer of a per-layer format (kv=auto): the static family storing fp16 K and V
            "d128_g8_auto_fp16": dict(zip(FIELDS, (128, 8, 16, 16, 128, 4, 128, 0)))}


def _kernels(tmp_path: Path, name: str) -> Path:
    import json

    out = tmp_path / name
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    v = json.dumps({"name": name, **VARIANTS[name]})
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
    assert ours <= {"getPluginRegistry", "getLogger", "cuLaunchKernel", "cuModuleGetFunction", "cuModuleLoadData", "cuFuncSetAttribute"}, ours
    assert {"getPluginRegistry", "cuLaunchKernel"} <= ours
    defined = set(defined_symbols(lib))
    fam = "_grp" if "key_group_tokens" in VARIANTS[variant] else "_rot" if "key_group" in VARIANTS[variant] else ""
    assert {f"kvc_decode_split{fam}_{variant}_launch", f"kvc_decode_reduce_{variant}_launch", f"kvc_kv_append{fam}_{variant}_launch"} <= defined  # C linkage
    # both plugins' static registrars are in the library
    text = subprocess.run(["strings", str(lib)], capture_output=True, text=True).stdout
    assert "KvcDecodeAttention" in text and "KvcAppend" in text


@needs_trt
def test_one_library_holds_several_variants_each_in_its_own_namespace(tmp_path):
    """Per-layer formats: one AOT build of two variants, one library; each variant's plugins register
    under kvcompress.<variant> and live in their own C++ namespace (no duplicate symbols at link)."""
    import json

    names = ["d64_g3_int8k_int4v", "d128_g8_int4"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    vs = json.dumps([{"name": n, **VARIANTS[n]} for n in names])
    p = subprocess.run([sys.executable, "-m", "kvcompress.kernels.aot", "--arch", "sm_90", "--out", str(tmp_path / "k"), "--variant-json", vs],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    launchers.generate(tmp_path / "k")
    lib = tmp_path / "libkvcompress_trt.so"
    build(Path(TRT), tmp_path / "k", names, lib)
    text = subprocess.run(["strings", str(lib)], capture_output=True, text=True).stdout
    assert all(f"kvcompress.{n}" in text for n in names)
    demangled = subprocess.run(["nm", "-C", "--defined-only", str(lib)], capture_output=True, text=True).stdout
    assert all(f"kvc_{n}::" in demangled for n in names)


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


# ---------------------------------------------------------------- the ONNX acceptance kit
onnx = pytest.importorskip("onnx")


def _perturb(kit, case: str, key: str, change) -> None:
    """Change one golden array of a kit case in place (change(array) mutates a writable copy)."""
    import numpy as np

    data = dict(np.load(kit / f"{case}.npz"))
    data[key] = data[key].copy()
    change(data[key])
    np.savez(kit / f"{case}.npz", **data)


def _kit(tmp_path, n_out=0, key_bits=8):
    import torch

    from kvcompress.reference import KeyParams, key_qmax
    from kvcompress.targets.acceptance import write_kit

    from kvcompress.reference import fp16_key_params

    H, D = 2, 64
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(150, H, D, generator=g) * 2, torch.randn(150, H, D, generator=g)
    idx = torch.arange(n_out).repeat(H, 1) if n_out else torch.zeros(H, 0, dtype=torch.long)
    if key_bits == 16:  # an fp16 layer of a per-layer format: fp16 K and V in the store
        p = fp16_key_params(H, D)
        variant = {"name": "t", "head_dim": D, "gqa": 3, "key_bits": 16, "value_bits": 16, "group": D, "n_sink": 4, "window": 16, "n_out": 0, "block_t": 32}
    else:
        p = KeyParams(key_bits, k.abs().amax(0) / key_qmax(key_bits), torch.zeros(H, D), idx)
        variant = {"name": "t", "head_dim": D, "gqa": 3, "key_bits": key_bits, "value_bits": 4, "group": 32, "n_sink": 4, "window": 16,
                   "n_out": n_out, "block_t": 32}
    write_kit(tmp_path, variant, p, k, v)
    return tmp_path


@pytest.mark.parametrize("n_out,key_bits", [(0, 8), (2, 4), (0, 16)])
def test_acceptance_kit_passes_on_cpu_and_fails_on_a_perturbed_golden(tmp_path, n_out, key_bits):
    import json

    from kvcompress.targets.acceptance import OP, check_kit

    kit = _kit(tmp_path, n_out, key_bits)
    meta = json.loads((kit / "cases.json").read_text())
    ops_ = [c["op"] for c in meta["cases"]]
    assert ops_.count(OP) == 5 and ops_.count("KvcAppend") == 5 and (kit / "verify.py").is_file()
    model = onnx.load(str(kit / f"{meta['cases'][0]['name']}.onnx"))
    node = model.graph.node[0]
    assert node.op_type == OP and {a.name for a in node.attribute} >= {"H", "G", "D", "splits", "cap", "sm_scale", "plugin_version", "plugin_namespace"}
    assert all(check_kit(kit).values())
    if key_bits == 8:  # the GPU host's verify.py, here: TensorRT, CUDA or the library missing is one line and exit 2 (was a traceback)
        import subprocess
        import sys

        p = subprocess.run([sys.executable, str(kit / "verify.py"), "--plugin-lib", str(tmp_path / "missing.so")], capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith("verify.py: error:"), p.stderr
    # negative: one golden value off (decode: by 1e-3; append: one payload byte) must fail that case, and only it
    dec = next(c["name"] for c in meta["cases"][6:] if c["op"] == OP)
    app = next(c["name"] for c in meta["cases"][6:] if c["op"] == "KvcAppend")
    _perturb(kit, dec, "expected", lambda a: a.flat.__setitem__(5, a.flat[5] + 1e-3))
    _perturb(kit, app, "expected_v_payload_out", lambda a: a.flat.__setitem__(0, a.flat[0] + 1 if a.dtype.kind == "f" else a.flat[0] ^ 1))
    res = check_kit(kit)
    assert res[dec] is False and res[app] is False and sum(res.values()) == len(res) - 2


@pytest.mark.parametrize("key_bits", [8, 16])
def test_acceptance_goldens_agree_with_the_triton_kernels(tmp_path, key_bits):
    """The goldens the GPU host compares against are what the shipped kernels compute (interpreter); 16: an fp16 layer."""
    import json

    import numpy as np
    import torch

    from kvcompress.kernels import ops
    from kvcompress.targets.acceptance import APPEND_INPUTS, packed_from_inputs

    kit = _kit(tmp_path, key_bits=key_bits)
    for c in json.loads((kit / "cases.json").read_text())["cases"]:
        data = dict(np.load(kit / f"{c['name']}.npz"))
        if c["op"] == "KvcAppend":  # the Triton append kernel writes exactly the golden bytes
            t = {k: torch.from_numpy(v) for k, v in data.items()}
            x = {k[len("expected_"):-len("_out")]: v for k, v in t.items() if k.startswith("expected_")}
            cache = {k: t[k].clone() for k in APPEND_INPUTS[5:]}
            q = {"q": torch.zeros(t["k_new"].shape[0], 1, t["k_new"].shape[-1], dtype=torch.float16), "k_zero_masked": t["k_zero"], **cache}
            _, kv, p = packed_from_inputs({**{k: v.numpy() for k, v in q.items()}, "k_scale": data["k_scale"], "outlier_idx": data["outlier_idx"]})
            ops.append(kv, t["k_new"], t["v_new"], p)
            for k, want in x.items():
                assert torch.equal(getattr(kv, k), want), (c["name"], k)
            continue
        expected = torch.from_numpy(data.pop("expected"))
        q, kv, p = packed_from_inputs(data)
        got = ops.decode_attention(q, kv, p, c["attrs"]["sm_scale"], splits=c["attrs"]["splits"])
        torch.testing.assert_close(got, expected, atol=3e-3, rtol=3e-3)


@needs_trt
@pytest.mark.parametrize("variant", ["d128_g8_int8k_int4v", "d128_g8_int4", "d64_g3_wf4", "d64_g3_wf5", "d128_g8_rot8k_int4v", "d64_g3_rot7k_int5v", "d128_g8_auto_fp16"])
def test_plugins_build_time_logic_and_serialization_on_cpu(tmp_path, variant):
    """plugins/test/plugin_harness.cpp: the plugin sources linked with stand-ins for TensorRT's registry and
    logger and the CUDA driver; creators registered, fields round-trip, shapes checked against the variant."""
    from kvcompress.targets.plugin_lib import build_harness

    exe = tmp_path / "harness"
    build_harness(Path(TRT), _kernels(tmp_path, variant), variant, exe)
    p = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    grouped = "key_group_tokens" in VARIANTS[variant]
    assert len(lines) == 15 + grouped and all(ln.startswith("OK ") for ln in lines), p.stdout
    assert f"dim 2 is {VARIANTS[variant]['head_dim'] + 2}" in p.stdout  # the logged reason names the input, the dim and the compiled value
    if grouped:
        assert "aliases its 10 cache outputs to inputs 4..13" in p.stdout and "whole number of key groups of 128 tokens" in p.stdout
    if "key_group" in VARIANTS[variant]:  # per-token: no key parameters, the rotated query beside the query
        assert "aliases its 9 cache outputs to inputs 2..10" in p.stdout and "has 12 inputs" in p.stdout


def _grouped_kit(tmp_path, mean=4):
    """A kit of the grouped family (kv=wf4's variant at head dim 64, or kv=wf5's / kv=wf3's with mean=5 / 3) with uneven water-filled widths."""
    import torch

    from kvcompress.kernels.aot import Variant
    from kvcompress.reference import KeyParams
    from kvcompress.targets.acceptance import write_kit

    H, D = 2, 64
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(400, H, D, generator=g) * torch.linspace(0.5, 1.5, D), torch.randn(400, H, D, generator=g)
    bits = torch.full((H, D), mean)
    eight = {3: [8, 1, 5, 1, 4, 2, 1, 2], 4: [8, 1, 6, 2, 7, 3, 1, 4], 5: [8, 2, 7, 3, 8, 4, 2, 6]}[mean]
    bits[:, :8] = torch.tensor(eight)  # widths 1..8 that spend what eight of the mean do
    bits[1] = bits[1].flip(0)
    assert int(bits.sum(-1).max()) == int(bits.sum(-1).min()) == mean * D and int(bits.max()) <= 8
    variant = {**Variant("t", D, 3, mean, mean, D, 4, 128, 0, value_symmetric=True, value_rotate=True, key_group_tokens=128).__dict__}
    write_kit(tmp_path, variant, KeyParams(mean, torch.ones(H, D), torch.zeros(H, D), torch.zeros(H, 0, dtype=torch.long)), k, v, key_bits_table=bits)
    return tmp_path


def test_grouped_acceptance_kit_passes_on_cpu_and_fails_on_a_perturbed_golden(tmp_path):
    """kv=wf4's plugins: 14 decode inputs (k_bits, k_offsets instead of the static key parameters), KvcAppend's
    10 aliased cache outputs; a case writes a whole key group (the evicted token starts one)."""
    import json

    import numpy as np

    from kvcompress.targets.acceptance import INPUTS_GROUPED, OP, check_kit

    kit = _grouped_kit(tmp_path)
    meta = json.loads((kit / "cases.json").read_text())
    assert meta["variant"]["key_group_tokens"] == 128 and len(meta["cases"]) == 12
    node = onnx.load(str(kit / f"{meta['cases'][0]['name']}.onnx")).graph.node[0]
    assert node.op_type == OP and list(node.input) == list(INPUTS_GROUPED)
    app = [c for c in meta["cases"] if c["op"] == "KvcAppend"]
    assert all(len(c["outputs"]) == 10 for c in app)
    # the last case appends position 260 = 4 sinks + 128 window + 128: compressed index 128 starts the second key group
    last = dict(np.load(kit / f"{app[-1]['name']}.npz"))
    assert 260 in last["lens"].tolist()
    before, after = last["k_gscale"], last["expected_k_gscale_out"]
    b = last["lens"].tolist().index(260)
    assert not np.array_equal(before[b, :, 1], after[b, :, 1]) and np.array_equal(before[b, :, 0], after[b, :, 0])
    assert all(check_kit(kit).values())
    _perturb(kit, app[-1]["name"], "expected_k_payload_out", lambda a: a.__setitem__((b, 0, 128 + 5, 3), a[b, 0, 128 + 5, 3] ^ 4))  # a bit of the new group
    res = check_kit(kit)
    assert res[app[-1]["name"]] is False and sum(res.values()) == len(res) - 1


def _kit_agrees_with_the_kernels(kit) -> None:
    """Every case of a grouped or per-token kit: KvcAppend's goldens are the bytes the Triton append kernel writes,
    KvcDecodeAttention's are the split-K decode's output within the kit's tolerance (interpreter)."""
    import json

    import numpy as np
    import torch

    from kvcompress.kernels import ops
    from kvcompress.targets.acceptance import append_outputs, packed_from_inputs

    meta = json.loads((kit / "cases.json").read_text())
    variant = meta["variant"]
    for c in meta["cases"]:
        data = dict(np.load(kit / f"{c['name']}.npz"))
        if c["op"] == "KvcAppend":
            t = {k: torch.from_numpy(v) for k, v in data.items()}
            q = torch.zeros(t["k_new"].shape[0], 3 * t["k_new"].shape[1], t["k_new"].shape[-1], dtype=torch.float16)
            _, kv, _ = packed_from_inputs({"q": q.numpy(), **{k: v.copy() for k, v in data.items() if not k.startswith("expected_")}}, variant)
            ops.append(kv, t["k_new"], t["v_new"], None)
            for k in append_outputs(variant):
                assert torch.equal(getattr(kv, k), t[f"expected_{k}_out"]), (c["name"], k)
            continue
        expected = torch.from_numpy(data.pop("expected"))
        q, kv, _ = packed_from_inputs(data, variant)
        got = ops.decode_attention(q, kv, None, c["attrs"]["sm_scale"], splits=c["attrs"]["splits"])
        torch.testing.assert_close(got, expected, atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("mean", [4, 5, 3])
def test_grouped_acceptance_goldens_agree_with_the_triton_kernels(tmp_path, mean):
    """The grouped kit's goldens are what kv_append_grp / decode_split_grp compute (interpreter); kv=wf5's and kv=wf3's
    (3-bit values as three bit planes) too."""
    _kit_agrees_with_the_kernels(_grouped_kit(tmp_path, mean))


def _per_token_kit(tmp_path, key_bits=8):
    """A kit of the per-token family (kv=rot8k_int4v's options at head dim 64; key_bits=4: kv=rot4's; key_bits=7: kv=rot7k_int5v's)."""
    import torch

    from kvcompress.kernels.aot import Variant
    from kvcompress.reference import KeyParams
    from kvcompress.targets.acceptance import write_kit

    H, D = 2, 64
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(300, H, D, generator=g) * torch.linspace(0.5, 1.5, D), torch.randn(300, H, D, generator=g)
    opts = dict(value_symmetric=True) if key_bits == 4 else dict(value_coded_min=True)
    variant = Variant("t", D, 3, key_bits, 5 if key_bits == 7 else 4, D if key_bits == 4 else 32, 4, 16, 0, key_group=D, key_rotate=True, value_rotate=True,
                      **opts).__dict__
    write_kit(tmp_path, variant, KeyParams(key_bits, torch.ones(H, D), torch.zeros(H, D), torch.zeros(H, 0, dtype=torch.long)), k, v)
    return tmp_path


@pytest.mark.parametrize("key_bits", [8, 4, 7])
def test_per_token_acceptance_kit_passes_on_cpu_and_catches_a_wrong_query_basis(tmp_path, key_bits):
    """kv=rot8k_int4v / kv=rot4's plugins: 12 decode inputs (q and qr, the query in the keys' basis; no key parameters),
    KvcAppend with 12 inputs and 9 aliased outputs (k_scale replaces k_outliers). A qr that is not the rotated query
    (a wiring error the GPU would turn into wrong scores) is refused by the reference op; a flipped code bit fails."""
    import json

    import numpy as np
    import torch

    from kvcompress import reference as ref
    from kvcompress.targets.acceptance import INPUTS_PER_TOKEN, OP, check_kit

    kit = _per_token_kit(tmp_path, key_bits)
    meta = json.loads((kit / "cases.json").read_text())
    node = onnx.load(str(kit / f"{meta['cases'][0]['name']}.onnx")).graph.node[0]
    assert node.op_type == OP and list(node.input) == list(INPUTS_PER_TOKEN) and len(INPUTS_PER_TOKEN) == 12
    app = [c for c in meta["cases"] if c["op"] == "KvcAppend"]
    assert all(len(c["outputs"]) == 9 for c in app) and "k_scale_out" in app[0]["outputs"]
    assert all(check_kit(kit).values())
    dec = next(c["name"] for c in meta["cases"][4:] if c["op"] == OP)
    data = dict(np.load(kit / f"{dec}.npz"))
    data["qr"] = data["q"].copy()  # the unrotated query where the rotated one belongs
    np.savez(kit / f"{dec}.npz", **data)
    with pytest.raises(ValueError, match="qr is not the query in the keys' basis"):
        check_kit(kit)
    data["qr"] = ref.rotate(torch.from_numpy(data["q"]), "hadamard").half().numpy()  # restored
    np.savez(kit / f"{dec}.npz", **data)
    _perturb(kit, app[-1]["name"], "expected_k_payload_out", lambda a: a.flat.__setitem__(0, a.flat[0] ^ 1))
    res = check_kit(kit)
    assert res[app[-1]["name"]] is False and sum(res.values()) == len(res) - 1


@pytest.mark.parametrize("key_bits", [8, 7])
def test_per_token_acceptance_goldens_agree_with_the_triton_kernels(tmp_path, key_bits):
    """The per-token kit's goldens are what kv_append_rot / decode_split_rot compute (interpreter)."""
    _kit_agrees_with_the_kernels(_per_token_kit(tmp_path, key_bits))


@needs_trt
@pytest.mark.skipif(not __import__("shutil").which("cmake"), reason="cmake not on PATH")
def test_cmake_builds_one_library_of_every_family(tmp_path):
    """plugins/CMakeLists.txt (what a GPU host builds with) for a static, a grouped and a per-token variant in one
    library: each family's launch symbols are bound and defined, each variant in its own namespace. TensorRT's
    and driver libraries are stubs here (empty libnvinfer.so, libcuda.so): their symbols stay undefined until load time, as with
    plugin_lib."""
    import json
    import shutil

    names = ["d64_g3_int8k_int4v", "d64_g3_wf4", "d128_g8_rot8k_int4v"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    vs = json.dumps([{"name": n, **VARIANTS[n]} for n in names])
    k = tmp_path / "k"
    p = subprocess.run([sys.executable, "-m", "kvcompress.kernels.aot", "--arch", "sm_90", "--out", str(k), "--variant-json", vs],
                       capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    launchers.generate(k)
    root = tmp_path / "trt"
    (root / "lib").mkdir(parents=True)
    shutil.copytree(TRT, root / "include")
    (tmp_path / "empty.c").write_text("")
    for stub in ("libnvinfer.so", "libcuda.so"):  # TensorRT's library and the CUDA driver: stubs (no GPU stack here)
        subprocess.run(["gcc", "-shared", "-o", str(root / "lib" / stub), str(tmp_path / "empty.c")], check=True)
    src = Path(__file__).resolve().parents[1] / "plugins"
    for argv in (["cmake", "-S", str(src), "-B", str(tmp_path / "build"), f"-DTENSORRT_ROOT={root}", f"-DKVC_KERNELS={k}", f"-DKVC_VARIANTS={';'.join(names)}",
                  f"-DCUDA_cuda_driver_LIBRARY={root / 'lib' / 'libcuda.so'}"],
                 ["cmake", "--build", str(tmp_path / "build"), "-j", "2"]):
        r = subprocess.run(argv, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    lib = tmp_path / "build" / "libkvcompress_trt.so"
    defined = set(defined_symbols(lib))
    for n in names:
        fam = "_grp" if "key_group_tokens" in VARIANTS[n] else "_rot" if "key_group" in VARIANTS[n] else ""
        assert {f"kvc_decode_split{fam}_{n}_launch", f"kvc_decode_reduce_{n}_launch", f"kvc_kv_append{fam}_{n}_launch"} <= defined
    undefined = {s.split("@")[0] for s in undefined_symbols(lib)}
    assert not {s for s in undefined if s.startswith("kvc_")}, undefined  # every launcher the plugins call is in the library
    text = subprocess.run(["strings", str(lib)], capture_output=True, text=True).stdout
    assert all(f"kvcompress.{n}" in text for n in names)
    demangled = subprocess.run(["nm", "-C", "--defined-only", str(lib)], capture_output=True, text=True).stdout
    assert all(f"kvc_{n}::" in demangled for n in names)
