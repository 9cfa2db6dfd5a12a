"""ONNX acceptance kit for the TensorRT plugin: one small ONNX model per case whose single node is
the custom op (name, version, namespace and fields exactly as the plugin registers them), with
golden inputs and outputs (.npz) computed by kvcompress's reference numerics on real K/V.

Two ops: KvcDecodeAttention (goldens: `kvcompress.kernels.ops.decode_attention_reference` on a cache
of n tokens) and KvcAppend (goldens: the cache of n + 1 tokens as `PackedKV.from_reference` builds
it). On CPU (here, in CI): `onnx.checker` validates every model, and `onnx.reference` runs it with
Python implementations of the ops that are thin wrappers over the reference numerics
(`reference_output`, `reference_append`): they must reproduce the goldens exactly (`check_kit`). On a TensorRT
host: `python acceptance/verify.py --plugin-lib libkvcompress_trt.so` (written into the kit) builds
each model with TensorRT, runs it on the GPU and compares with the goldens at the stated tolerance.

Cases cross the boundaries the kernels care about: fewer tokens than the sinks, exactly the sinks
plus the window, one token into the compressed store, several main-loop blocks split unevenly, and a
batch of mixed lengths. K/V rows are real: the calibration run's sampled keys and values of one
layer (kv_stats sample_k / sample_v); queries are drawn at the keys' scale (seeded).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from kvcompress import reference as ref
from kvcompress.kernels import ops
from kvcompress.kernels.layout import PackedKV
from kvcompress.reference import KeyParams
from kvcompress.targets.trtllm_network import CACHE, CACHE_GROUPED, CACHE_PER_TOKEN

OP = "KvcDecodeAttention"  # plugins/trt/kvcDecodeAttentionPlugin.cpp: kNAME, kVERSION, namespace
OP_VERSION, OP_NAMESPACE, OP_DOMAIN = "1", "kvcompress", "trt.plugins"
INPUTS = ("q", "k_scale", "k_zero_masked", "outlier_idx", *CACHE, "lens")
TOLERANCE = {"atol": 3e-3, "rtol": 3e-3}  # fp16 dot inputs, fp32 accumulation (tests/test_kernels.py DECODE_TOL)


# the grouped family (kv=wf4): the key widths and bit offsets replace the static key parameters
INPUTS_GROUPED = ("q", "k_bits", "k_offsets", *CACHE_GROUPED, "lens")


# the per-token family (kv=rot8k_int4v): no key parameters; qr, the query in the keys' basis, beside q
INPUTS_PER_TOKEN = ("q", "qr", *CACHE_PER_TOKEN, "lens")


def is_grouped(variant: dict | None) -> bool:
    return bool((variant or {}).get("key_group_tokens"))


def is_per_token(variant: dict | None) -> bool:
    return bool((variant or {}).get("key_group"))


def decode_inputs(variant: dict | None = None) -> tuple[str, ...]:
    return INPUTS_GROUPED if is_grouped(variant) else INPUTS_PER_TOKEN if is_per_token(variant) else INPUTS


def _per_token_packed(t: dict[str, torch.Tensor], D: int, variant: dict) -> PackedKV:
    """PackedKV of the per-token family from the op's buffers (its options come from the variant)."""
    return PackedKV(t["sink_k"], t["sink_v"], t["win_k"], t["win_v"], t["k_payload"], torch.zeros(*t["k_payload"].shape[:3], 0, dtype=torch.float16),
                    t["v_payload"], t["v_scale"], t["v_min"], t["lens"], _row_bits(t["k_payload"], D),
                    _row_bits(t["v_payload"], D), D // t["v_scale"].shape[-1], k_scale=t["k_scale"], key_group=int(variant["key_group"]),
                    key_rotate=bool(variant["key_rotate"]), value_symmetric=bool(variant["value_symmetric"]),
                    value_rotate=bool(variant["value_rotate"]), value_coded_min=bool(variant["value_coded_min"]))


def _grouped_packed(t: dict[str, torch.Tensor], D: int, variant: dict) -> PackedKV:
    """PackedKV of the grouped family from the op's buffers (the value options come from the variant)."""
    value_bits = _row_bits(t["v_payload"], D)
    return PackedKV(t["sink_k"], t["sink_v"], t["win_k"], t["win_v"], t["k_payload"], torch.zeros(*t["k_payload"].shape[:3], 0, dtype=torch.float16),
                    t["v_payload"], t["v_scale"], t["v_min"], t["lens"], _row_bits(t["k_payload"], D), value_bits, D // t["v_scale"].shape[-1],
                    value_symmetric=bool(variant["value_symmetric"]), value_rotate=bool(variant["value_rotate"]),
                    value_coded_min=bool(variant["value_coded_min"]), key_group_tokens=int(variant["key_group_tokens"]),
                    key_bits_table=t["k_bits"], k_gscale=t["k_gscale"], k_gmin=t["k_gmin"])


def _row_bits(payload: torch.Tensor, D: int) -> int:
    """A payload's code width from its buffer (reference.row_bits): fp16 rows (an fp16 layer), rows of D * bits / 8 bytes."""
    return ref.row_bits(D, payload.shape[-1], payload.dtype)


def packed_from_inputs(x: dict[str, np.ndarray], variant: dict | None = None) -> tuple[torch.Tensor, PackedKV, KeyParams | None]:
    """The op's 14 inputs -> (q, PackedKV, KeyParams) for the reference. The static family's format is read
    from the buffers' shapes and dtypes; the grouped family's value options from `variant`."""
    t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in x.items()}
    D = t["q"].shape[-1]
    if is_grouped(variant):
        return t["q"], _grouped_packed(t, D, variant), None
    if is_per_token(variant):
        return t["q"], _per_token_packed(t, D, variant), None
    key_bits = _row_bits(t["k_payload"], D)
    value_bits = _row_bits(t["v_payload"], D)
    kv = PackedKV(t["sink_k"], t["sink_v"], t["win_k"], t["win_v"], t["k_payload"], t["k_outliers"], t["v_payload"], t["v_scale"], t["v_min"],
                  t["lens"], key_bits, value_bits, D // t["v_scale"].shape[-1])
    p = KeyParams(key_bits, t["k_scale"], t["k_zero_masked"], t["outlier_idx"].long())
    return t["q"], kv, p


APPEND_OP = "KvcAppend"
APPEND_INPUTS = ("k_new", "v_new", "k_scale", "k_zero", "outlier_idx", *CACHE, "lens")
APPEND_OUTPUTS = CACHE  # aliased to their inputs in the plugin
APPEND_INPUTS_GROUPED = ("k_new", "v_new", "k_bits", "k_offsets", *CACHE_GROUPED, "lens")
APPEND_OUTPUTS_GROUPED = CACHE_GROUPED
APPEND_INPUTS_PER_TOKEN = ("k_new", "v_new", *CACHE_PER_TOKEN, "lens")


def append_inputs(variant: dict | None = None) -> tuple[str, ...]:
    return APPEND_INPUTS_GROUPED if is_grouped(variant) else APPEND_INPUTS_PER_TOKEN if is_per_token(variant) else APPEND_INPUTS


def append_outputs(variant: dict | None = None) -> tuple[str, ...]:
    return APPEND_OUTPUTS_GROUPED if is_grouped(variant) else CACHE_PER_TOKEN if is_per_token(variant) else APPEND_OUTPUTS


def reference_append(x: dict[str, np.ndarray], variant: dict | None = None) -> dict[str, np.ndarray]:
    """KvcAppend with the reference numerics: the new token goes to its sink slot or the fp16 ring; the
    token it evicts from the ring is encoded (reference encoders) into the compressed store (layout.py).
    The grouped family (`variant` key_group_tokens = GT): when the evicted token starts a key group, the
    whole group (it and its GT - 1 successors, all still in the ring) is encoded at once."""
    t = {k: torch.from_numpy(np.array(v, copy=True)) for k, v in x.items()}
    NS, W = t["sink_k"].shape[2], t["win_k"].shape[2]
    D = t["k_new"].shape[-1]
    value_bits = _row_bits(t["v_payload"], D)
    group = D // t["v_scale"].shape[-1]
    grp, tok = is_grouped(variant), is_per_token(variant)
    if grp or tok:
        how = "hadamard" if variant["value_rotate"] else "none"
        vopt = (bool(variant["value_symmetric"]), how, bool(variant["value_coded_min"]))
    if grp:
        GT, bits = int(variant["key_group_tokens"]), t["k_bits"].long()
    else:
        key_bits = _row_bits(t["k_payload"], D)
    if not (grp or tok):
        p = KeyParams(key_bits, t["k_scale"], t["k_zero"], t["outlier_idx"].long())
    kn, vn = t["k_new"].half(), t["v_new"].half()
    for b, pos in enumerate(t["lens"].tolist()):
        if pos < NS:
            t["sink_k"][b, :, pos], t["sink_v"][b, :, pos] = kn[b], vn[b]
            continue
        j = pos - NS
        if W == 0 or j >= W:  # a token leaves the window (or there is none): encode it at compressed index c
            c, ko, vo = (j, kn[b], vn[b]) if W == 0 else (j - W, t["win_k"][b, :, j % W], t["win_v"][b, :, j % W])
            if grp:
                if c % GT == 0:
                    codes, gs, gm = ref.quantize_keys_grouped(t["win_k"][b][:, [(c + i) % W for i in range(GT)]], bits.unsqueeze(-2), GT)
                    t["k_payload"][b, :, c : c + GT] = ref.pack_key_codes(codes, bits)
                    t["k_gscale"][b, :, c // GT], t["k_gmin"][b, :, c // GT] = gs[:, 0], gm[:, 0]
            if tok:  # the key's codes and per-token scales (reference.encode_rotated, in the keys' basis)
                kp, ks = ref.encode_rotated(ko.unsqueeze(1), key_bits, int(variant["key_group"]), True, "hadamard" if variant["key_rotate"] else "none")
                t["k_payload"][b, :, c], t["k_scale"][b, :, c] = kp[:, 0], ks[:, 0]
            if grp or tok:
                for name, part in zip(("v_payload", "v_scale", "v_min"), ref.encode_rotated(vo.unsqueeze(1), value_bits, group, *vopt)):
                    t[name][b, :, c] = part[:, 0]
            elif key_bits == ref.FP16_BITS:  # an fp16 layer: the token itself
                t["k_payload"][b, :, c], t["v_payload"][b, :, c] = ko, vo
            else:
                kp, kout = ref.encode_keys(ko.float().unsqueeze(1), p)
                vp, vs, vm = ref.encode_values(vo.float().unsqueeze(1), value_bits, group)
                t["k_payload"][b, :, c], t["k_outliers"][b, :, c] = kp[:, 0], kout[:, 0]
                t["v_payload"][b, :, c], t["v_scale"][b, :, c], t["v_min"][b, :, c] = vp[:, 0], vs[:, 0], vm[:, 0]
        if W:
            t["win_k"][b, :, j % W], t["win_v"][b, :, j % W] = kn[b], vn[b]
    return {k: t[k].numpy() for k in append_outputs(variant)}


def reference_output(x: dict[str, np.ndarray], sm_scale: float, variant: dict | None = None) -> np.ndarray:
    """KvcDecodeAttention with the reference numerics. The per-token family's qr must be the query in the
    keys' basis (what the kernel scores the compressed keys with): a graph that feeds anything else fails here."""
    if is_per_token(variant):
        q32 = torch.from_numpy(np.ascontiguousarray(x["q"])).float()
        want = ref.rotate(q32, "hadamard" if variant["key_rotate"] else "none").float()
        qr = torch.from_numpy(np.ascontiguousarray(x["qr"])).float()
        if not torch.allclose(qr, want, rtol=2e-3, atol=2e-3 * float(want.abs().max())):
            raise ValueError(f"KvcDecodeAttention: qr is not the query in the keys' basis (max abs difference {float((qr - want).abs().max()):.3g})")
    q, kv, p = packed_from_inputs(x, variant)
    return ops.decode_attention_reference(q, kv, p, sm_scale).numpy()


def make_model(op: str, x: dict[str, np.ndarray], inputs, outputs: dict[str, np.ndarray], attrs: dict, namespace: str = OP_NAMESPACE):
    """A one-node model: the plugin `op` (name, version, namespace as it registers) with `attrs` as its fields."""
    from onnx import helper

    def vi(name, arr):
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(arr.dtype), list(arr.shape))

    node = helper.make_node(op, list(inputs), list(outputs), domain=OP_DOMAIN, plugin_version=OP_VERSION, plugin_namespace=namespace, **attrs)
    graph = helper.make_graph([node], f"{op}_case", [vi(n, x[n]) for n in inputs], [vi(n, a) for n, a in outputs.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(OP_DOMAIN, 1)],
                             producer_name="kvcompress")


def case_lengths(n_sink: int, window: int, block: int, group_tokens: int = 0) -> list[list[int]]:
    """Sequence lengths of the cases; with token-grouped keys also past the end of the first key group
    (a second group written, the next about to be)."""
    first = n_sink + window
    out = [[max(1, n_sink - 1)], [max(1, first)], [first + 1], [first + 3 * block + 5], [first + 2 * block - 1, 7]]
    if group_tokens:
        out.append([first + group_tokens, first + 2 * group_tokens - 1, first + group_tokens - 1])
    return out


def write_kit(out: Path, variant: dict, key_params: KeyParams, k_rows: torch.Tensor, v_rows: torch.Tensor, splits: int = 3, seed: int = 0,
              key_bits_table: torch.Tensor | None = None) -> list[dict]:
    """Cases for one variant; k_rows, v_rows: [N, H, D] real rows of one layer. Returns the case list.
    variant["namespace"] (optional): the plugin namespace the variant registers in (default kvcompress).
    The grouped family (variant key_group_tokens > 0) takes the layer's key widths `key_bits_table` [H, D]."""
    import onnx

    ns = variant.get("namespace", OP_NAMESPACE)
    out.mkdir(parents=True, exist_ok=True)
    H, D, G = k_rows.shape[1], variant["head_dim"], variant["gqa"]
    grp, tok = is_grouped(variant), is_per_token(variant)
    vopt = dict(value_symmetric=bool(variant.get("value_symmetric")), value_rotate=bool(variant.get("value_rotate")),
                value_coded_min=bool(variant.get("value_coded_min")))
    fam = (dict(key_group_tokens=variant["key_group_tokens"], key_bits_table=key_bits_table, **vopt) if grp
           else dict(key_group=variant["key_group"], key_rotate=bool(variant["key_rotate"]), **vopt) if tok else {})
    g = torch.Generator().manual_seed(seed)
    cases = []
    for i, lens in enumerate(case_lengths(variant["n_sink"], variant["window"], variant["block_t"], variant.get("key_group_tokens", 0))):
        ks = [k_rows[torch.arange(n) % k_rows.shape[0]].transpose(0, 1).float() for n in lens]  # [H, n, D]
        vs = [v_rows[torch.arange(n) % v_rows.shape[0]].transpose(0, 1).float() for n in lens]
        kv = PackedKV.from_reference(ks, vs, key_params, n_sink=variant["n_sink"], window=variant["window"], value_bits=variant["value_bits"],
                                     group=variant["group"], cap=max(lens) + 1, **fam)  # + 1: room for the appended token (no window: it goes to the store)
        q = (torch.randn(len(lens), H * G, D, generator=g) * k_rows.float().std()).to(torch.float16)
        if tok:
            tables = {}  # no key parameters; the query in the keys' basis beside the query
            x = {"q": q, "qr": ref.rotate(q, kv.key_how).to(torch.float16), **{k: getattr(kv, k) for k in (*CACHE_PER_TOKEN, "lens")}}
        elif grp:
            tables = {"k_bits": kv.key_bits_table.to(torch.int32), "k_offsets": kv.key_bit_offsets}
            x = {"q": q, **tables, **{k: getattr(kv, k) for k in ("sink_k", "sink_v", "win_k", "win_v", "k_payload")},
                 "k_gscale": kv.k_gscale, "k_gmin": kv.k_gmin, **{k: getattr(kv, k) for k in ("v_payload", "v_scale", "v_min", "lens")}}
        else:
            scale, _, zm, idx = ops.kernel_key_params(key_params, "cpu")
            x = {"q": q, "k_scale": scale, "k_zero_masked": zm, "outlier_idx": idx, "sink_k": kv.sink_k, "sink_v": kv.sink_v, "win_k": kv.win_k,
                 "win_v": kv.win_v, "k_payload": kv.k_payload, "k_outliers": kv.k_outliers, "v_payload": kv.v_payload, "v_scale": kv.v_scale,
                 "v_min": kv.v_min, "lens": kv.lens}
        x = {k: v.contiguous().numpy() for k, v in x.items()}
        sm_scale = float(D) ** -0.5
        attrs = {"H": H, "G": G, "D": D, "splits": splits, "cap": int(kv.k_payload.shape[2]), "sm_scale": sm_scale}
        name = f"case{i}_len{'-'.join(map(str, lens))}"
        expected = reference_output(x, sm_scale, variant)
        onnx.save(make_model(OP, x, decode_inputs(variant), {"out": expected}, attrs, ns), str(out / f"{name}.onnx"))
        np.savez(out / f"{name}.npz", **x, expected=expected)
        cases.append({"name": name, "op": OP, "lens": lens, "attrs": attrs, "outputs": ["out"]})
        # the append of the next token: from the cache of `lens` tokens to the cache of lens + 1 (built by the reference)
        nxt = [k_rows[torch.tensor([n % k_rows.shape[0]])].transpose(0, 1).float() for n in lens]  # [H, 1, D]
        nxv = [v_rows[torch.tensor([n % v_rows.shape[0]])].transpose(0, 1).float() for n in lens]
        full = PackedKV.from_reference([torch.cat([k, a], 1) for k, a in zip(ks, nxt)], [torch.cat([v, a], 1) for v, a in zip(vs, nxv)], key_params,
                                       n_sink=variant["n_sink"], window=variant["window"], value_bits=variant["value_bits"], group=variant["group"],
                                       cap=int(kv.k_payload.shape[2]), **fam)
        new = {"k_new": torch.cat([a[:, 0] for a in nxt]).view(len(lens), H, D).half(), "v_new": torch.cat([a[:, 0] for a in nxv]).view(len(lens), H, D).half()}
        consts = tables if grp or tok else {"k_scale": scale, "k_zero": key_params.zero.float().contiguous(), "outlier_idx": idx}
        names_in, names_out = append_inputs(variant), append_outputs(variant)
        ax = {**new, **consts, **{k: x[k] for k in names_out}, "lens": x["lens"]}
        ax = {k: (v.contiguous().numpy() if isinstance(v, torch.Tensor) else v) for k, v in ax.items()}
        after = {k: getattr(full, k).numpy() for k in names_out}
        aname = f"append{i}_len{'-'.join(map(str, lens))}"
        aattrs = {"H": H, "D": D, "cap": int(kv.k_payload.shape[2])}
        onnx.save(make_model(APPEND_OP, ax, names_in, {f"{k}_out": after[k] for k in names_out}, aattrs, ns), str(out / f"{aname}.onnx"))
        np.savez(out / f"{aname}.npz", **ax, **{f"expected_{k}_out": after[k] for k in names_out})
        cases.append({"name": aname, "op": APPEND_OP, "lens": lens, "attrs": aattrs, "outputs": [f"{k}_out" for k in names_out]})
    (out / "cases.json").write_text(json.dumps({"op": OP, "version": OP_VERSION, "namespace": ns, "domain": OP_DOMAIN,
                                                "variant": variant, "tolerance": TOLERANCE, "cases": cases}, indent=2))
    (out / "verify.py").write_text(VERIFY)
    return cases


def reference_ops(variant: dict | None = None):
    """The two ops for onnx.reference: thin wrappers over the reference numerics (for the grouped family
    the variant supplies the value options the buffers' shapes cannot show)."""
    from onnx.reference.op_run import OpRun

    class KvcDecodeAttention(OpRun):
        op_domain = OP_DOMAIN

        def _run(self, *inputs, H=None, G=None, D=None, splits=None, cap=None, sm_scale=None, plugin_version=None, plugin_namespace=None):
            return (reference_output(dict(zip(decode_inputs(variant), inputs)), sm_scale, variant),)

    class KvcAppend(OpRun):
        op_domain = OP_DOMAIN

        def _run(self, *inputs, H=None, D=None, cap=None, plugin_version=None, plugin_namespace=None):
            out = reference_append(dict(zip(append_inputs(variant), inputs)), variant)
            return tuple(out[k] for k in append_outputs(variant))

    return [KvcDecodeAttention, KvcAppend]


def check_kit(kit: Path) -> dict[str, bool]:
    """onnx.checker + onnx.reference on every case; {case: reproduces the golden exactly}."""
    import onnx
    from onnx.reference import ReferenceEvaluator

    meta = json.loads((kit / "cases.json").read_text())
    res = {}
    for c in meta["cases"]:
        model = onnx.load(str(kit / f"{c['name']}.onnx"))
        onnx.checker.check_model(model, full_check=True)
        data = dict(np.load(kit / f"{c['name']}.npz"))
        expected = [data.pop(f"expected_{o}") if f"expected_{o}" in data else data.pop("expected") for o in c["outputs"]]
        got = ReferenceEvaluator(model, new_ops=reference_ops(meta["variant"])).run(None, data)
        res[c["name"]] = all(g.shape == e.shape and g.dtype == e.dtype and np.array_equal(g, e) for g, e in zip(got, expected))
    return res


def kit_for_bundle(out: Path, variant: dict, stats_path: Path, book, layer: int | None = None) -> list[dict]:
    """The bundle's kit: real K/V rows of one layer (default the middle one) from the run's kv_stats,
    that layer's key params."""
    from kvcompress.stats import KVStats

    stats = KVStats.load(stats_path)
    L = stats["sample_k"].shape[0]
    layer = L // 2 if layer is None else layer
    bits = book.key_bits(layer) if is_grouped(variant) else None
    table = (bits if isinstance(bits, torch.Tensor) else torch.full((stats["sample_k"].shape[2], variant["head_dim"]), bits)) if bits is not None else None
    H = stats["sample_k"].shape[2]
    p = ref.fp16_key_params(H, variant["head_dim"]) if variant["key_bits"] == ref.FP16_BITS else book.key_params(layer)
    return write_kit(out, variant, p, stats["sample_k"][layer], stats["sample_v"][layer], key_bits_table=table)


VERIFY = '''"""Verify the kvcompress TensorRT plugin against the goldens of this kit, on a TensorRT host with a GPU.

    python verify.py --plugin-lib /path/to/libkvcompress_trt.so

For every case: parse the ONNX model (its node is the plugin KvcDecodeAttention or KvcAppend,
namespace kvcompress, version 1), build a strongly typed engine (aliased plugin I/O enabled for
KvcAppend), run it on the GPU with the golden inputs and compare: the decode output at the kit's
tolerance, the appended cache buffers bit-exact. One PASS/FAIL line per case; exit 1 if
any case fails, 2 (one line, no case run) without TensorRT, torch with CUDA, or the plugin library.
Written by kvcompress (kvcompress/targets/acceptance.py); NOT run where kvcompress is
developed (no GPU, no TensorRT there).
"""
import argparse
import ctypes
import json
import sys
from pathlib import Path

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plugin-lib", required=True)
    a = ap.parse_args()
    try:
        import tensorrt as trt
        import torch
    except ImportError as e:
        print(f"verify.py: error: needs TensorRT and torch on a GPU host ({e})", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("verify.py: error: no CUDA device visible to torch: the kit runs its engines on a GPU", file=sys.stderr)
        return 2
    if not Path(a.plugin_lib).is_file():
        print(f"verify.py: error: --plugin-lib {a.plugin_lib} does not exist (build it with the bundle's CMakeLists.txt)", file=sys.stderr)
        return 2
    ctypes.CDLL(a.plugin_lib, mode=ctypes.RTLD_GLOBAL)  # its static registrar adds the creator to TensorRT's registry
    logger = trt.Logger(trt.Logger.WARNING)
    here = Path(__file__).resolve().parent
    meta = json.loads((here / "cases.json").read_text())
    tol = meta["tolerance"]
    failed = 0
    for c in meta["cases"]:
        builder = trt.Builder(logger)
        net = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
        parser = trt.OnnxParser(net, logger)
        if not parser.parse((here / (c["name"] + ".onnx")).read_bytes()):
            print(f"FAIL {c['name']}: ONNX parse: " + "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors)))
            failed += 1
            continue
        config = builder.create_builder_config()
        config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)  # KvcAppend writes its cache in place
        plan = builder.build_serialized_network(net, config)
        if plan is None:
            print(f"FAIL {c['name']}: engine build failed")
            failed += 1
            continue
        engine = trt.Runtime(logger).deserialize_cuda_engine(plan)
        ctx = engine.create_execution_context()
        data = dict(np.load(here / (c["name"] + ".npz")))
        expected = {o: torch.from_numpy(data.pop(f"expected_{o}") if f"expected_{o}" in data else data.pop("expected")) for o in c["outputs"]}
        bufs = {k: torch.from_numpy(v).cuda() for k, v in data.items()}
        for o, e in expected.items():
            bufs[o] = torch.zeros_like(e).cuda()
        for name, t in bufs.items():
            ctx.set_tensor_address(name, t.data_ptr())
        ok = ctx.execute_async_v3(torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        # decode: fp32 output at the kit's tolerance; append: the written cache buffers bit-exact
        worst, good = 0.0, bool(ok)
        for o, e in expected.items():
            got = bufs[o].cpu()
            if e.dtype == torch.float32:
                worst = max(worst, float((got - e).abs().max()))
                good = good and torch.allclose(got, e, atol=tol["atol"], rtol=tol["rtol"])
            else:
                good = good and torch.equal(got, e)
        failed += not good
        print(f"{'PASS' if good else 'FAIL'} {c['name']}: " + (f"max abs error {worst:.2e} (atol {tol['atol']}, rtol {tol['rtol']})" if c["op"] == "KvcDecodeAttention" else "cache bytes bit-exact" if good else "cache bytes differ"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
'''
