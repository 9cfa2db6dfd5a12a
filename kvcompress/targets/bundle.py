"""The custom tier's plugin bundle: the ScaleBook and spec, the AOT kernels of each variant (compiled in parallel, retiled
where ptxas spills) with their SASS audit and C launchers, the plugin sources and library, the ONNX acceptance kits, and the
TensorRT-LLM network (network.json, plugin constants) checked on CPU against CompressedCache decoding.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from kvcompress.artifacts import atomic_write_json, uninterruptible
from kvcompress.data import load_texts
from kvcompress.errors import UserError
from kvcompress.kernels.aot import Variant
from kvcompress.scalebook import ScaleBook
from kvcompress.targets import launchers
from kvcompress.targets.network_check import CHECK_FILE
from kvcompress.targets.checks import Checks
from kvcompress.targets.trtllm_ckpt import TRTLLM_VERSION

log = logging.getLogger("kvcompress")
ROOT = Path(__file__).resolve().parents[2]
# the custom-tier network's code (kvcompress/targets/), copied beside build_engine.py, which imports trtllm_network.py
NETWORK_FILES = ("trtllm_network.py", "network_weights.py", "network_check.py")
# the weight readers its loader (network_weights.py) imports beside it in the bundle: FP8, integer (pack-quantized, GPTQ, AWQ)
# and NVFP4 sources' dequantization
WEIGHT_READERS = ("fp8_weights.py", "int_weights.py", "nvfp4_weights.py")


def copy_network(out: Path) -> None:
    """build_engine.py's companions: the network's code and the weight readers."""
    for f in NETWORK_FILES:
        shutil.copy(ROOT / "kvcompress" / "targets" / f, out / f)
    for f in WEIGHT_READERS:
        shutil.copy(ROOT / "kvcompress" / "models" / f, out / f)


def bundle_variants(book: ScaleBook, geom) -> tuple[list[Variant], list[str]]:
    """(the kernel variants of a ScaleBook, the variant of each layer): one for a uniform format; one
    per distinct layer format for per-layer formats (named after the spec and the layer format)."""
    D, G = geom.head_dim, geom.n_heads // geom.n_kv_heads
    variants: dict[str, Variant] = {}
    per_layer = []
    for i in range(geom.n_layers):
        s = book.layer_spec(i)
        name = f"d{D}_g{G}_{book.spec.name}" + (f"_{book.spec.layers[i].label}" if book.spec.is_mixed else "")
        if s.is_baseline:  # an fp16 layer: the static kernels storing fp16 K and V (layout.py), the spec's sinks and window
            variants.setdefault(name, Variant(name, D, G, 16, 16, D, s.sink_tokens, s.window, 0))
            per_layer.append(name)
            continue
        vopt = dict(value_symmetric=s.value.symmetric, value_rotate=s.value.rotate != "none", value_coded_min=s.coded_min)
        fam = (dict(key_group_tokens=s.key.group_tokens, **vopt) if s.key.group_tokens  # the grouped family (kv=wf4)
               else dict(key_group=s.key_group(D), key_rotate=s.key.rotate != "none", **vopt) if s.token_keys else {})  # per-token (kv=rot8k_int4v)
        variants.setdefault(name, Variant(name, D, G, s.key.bits, s.value.bits, s.value_group(D), s.sink_tokens, s.window, s.outlier_channels, **fam))
        per_layer.append(name)
    return list(variants.values()), per_layer


def _aot_compile(out: Path, archs: list[str], variants: list[Variant]) -> None:
    """python -m kvcompress.kernels.aot for every arch, in parallel (subprocesses: no Triton interpreter)."""
    env = {k: val for k, val in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = {}
    try:
        for arch in archs:
            procs[arch] = subprocess.Popen([sys.executable, "-m", "kvcompress.kernels.aot", "--arch", arch, "--out", str(out / "kernels" / arch),
                                            "--variant-json", json.dumps([v.__dict__ for v in variants])], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        errs = {arch: p.communicate()[1] for arch, p in procs.items()}
    except BaseException:  # Ctrl-C: stop the compilers before the caller removes the directory they write into
        with uninterruptible():
            for p in procs.values():  # os-level: an interrupted communicate() can leave the Popen's wait lock held
                try:
                    os.kill(p.pid, signal.SIGKILL)
                    os.waitpid(p.pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass  # already exited and reaped
        raise
    for arch, p in procs.items():
        if p.returncode:
            raise RuntimeError(f"AOT compile for {arch} failed: {errs[arch].strip()[-600:]}")


def retile(variants: list, spilled: set[str], log: dict) -> tuple[list, bool]:
    """The next compile of the variants whose decode kernel needs a stack frame on some arch (a ptxas choice): first
    without plan.decode_maxnreg's register cap, if it had one, then with half the token tile (down to 16), the same on
    every arch (the plugin and kit read it). `log` collects, per variant, what was tried. (variants, anything changed)."""
    out, changed = [], False
    for v in variants:
        if v.name in spilled and v.decode_maxnreg > 0:
            log.setdefault(v.name, [f"block_t {v.block_t}, maxnreg {v.decode_maxnreg}"]).append(f"block_t {v.block_t}, no register cap")
            v, changed = dataclasses.replace(v, decode_maxnreg=-1), True
        elif v.name in spilled and v.block_t > 16:
            log.setdefault(v.name, [f"block_t {v.block_t}"]).append(f"block_t {v.block_t // 2}")
            v, changed = dataclasses.replace(v, block_t=v.block_t // 2), True
        out.append(v)
    return out, changed


def plugin_bundle(book: ScaleBook, geom, out: Path, archs: list[str], checks: Checks, stats_path: Path | None = None) -> dict:
    """ScaleBook + spec, AOT kernels for each arch (compiled in parallel) with their SASS audit and C
    launchers, the plugin sources (and the plugin library when TensorRT's headers are given), and the
    ONNX acceptance kit built from the run's real K/V (`stats_path`) and checked on CPU. Per-layer
    formats: every variant is compiled, gets its kit, and is linked into the one plugin library
    (plugins registered under kvcompress.<variant>)."""
    from kvcompress.targets.plugin_lib import plugin_namespace

    out.mkdir(parents=True, exist_ok=True)
    book.save(out / "scalebook.safetensors")
    atomic_write_json(out / "kv_spec.json", {"spec": book.spec.model_dump(), "geometry": book.geometry, "layout": "kvcompress.kernels.layout"})
    variants, per_layer = bundle_variants(book, geom)
    retiled = {}
    while True:  # ends: retile drops a cap once and halves a tile down to 16, so the last build is of the final variants
        _aot_compile(out, archs, variants)
        spilled = {k["variant"]["name"] for arch in archs for k in json.loads((out / "kernels" / arch / "kernels.json").read_text())["kernels"]
                   if k["spills"] and k["kernel"].startswith("decode_split")}
        variants, changed = retile(variants, spilled, retiled)
        if not changed:
            break
    kernels = {}
    for arch in archs:
        kdir = out / "kernels" / arch
        files = launchers.generate(kdir)
        meta = json.loads((kdir / "kernels.json").read_text())["kernels"]
        kernels[arch] = [k["name"] for k in meta]
        checks.add(f"AOT kernels {arch}: no spills (cuobjdump)", not any(k["spills"] for k in meta),
                   {k["name"]: {"registers": k["registers"], "local": k["local"], "stack": k["stack"], "block_t": k["constexprs"].get("BLOCK_T")} for k in meta}
                   | ({"recompiled after a stack frame (variant: builds tried)": retiled} if retiled else {}))
        audit = json.loads((kdir / "audit.json").read_text())["kernels"]  # written by the AOT build (kvcompress.kernels.audit)
        loops = {k["name"]: k["main_loop"]["narrowest_payload_bits"] for k in audit if "main_loop" in k}
        checks.add(f"AOT kernels {arch}: decode payload read by >= 64-bit loads (SASS audit, audit.json)", all(b >= 64 for b in loops.values()),
                   {n: f"{b}-bit" for n, b in loops.items()})
        _compile_launchers(kdir, files, arch, checks)
        _compile_plugin(kdir, [v.name for v in variants], out / "lib" / arch, arch, checks)
    ns = {v.name: plugin_namespace(v.name, len(variants)) for v in variants}
    if stats_path is not None and stats_path.is_file() and importlib.util.find_spec("onnx") is not None:
        from kvcompress.targets.acceptance import check_kit, kit_for_bundle

        for v in variants:
            kit = out / "acceptance" / v.name
            layer = None if len(variants) == 1 else per_layer.index(v.name)  # a layer that runs this variant
            kit_for_bundle(kit, {**v.__dict__, "namespace": ns[v.name]}, stats_path, book, layer)
            res = check_kit(kit)
            checks.add(f"ONNX acceptance kit {v.name}: onnx.checker + onnx.reference reproduce the reference goldens exactly", all(res.values()),
                       {"cases": res, "on a TensorRT host": f"python acceptance/{v.name}/verify.py --plugin-lib lib/<arch>/libkvcompress_trt.so"})
    shutil.copytree(ROOT / "plugins", out / "plugins", dirs_exist_ok=True)
    shutil.copy(ROOT / "export" / "build_engine.py", out / "build_engine.py")
    copy_network(out)
    info = {"variant": variants[0].__dict__, "kernels": kernels}
    if book.spec.is_mixed:
        info |= {"variants": {v.name: {**v.__dict__, "namespace": ns[v.name]} for v in variants}, "layer_variants": per_layer}
    return info


NETWORK_NEW_TOKENS = 8  # generated after the prompt in the network check
TP_SIZES = (1, 2, 4, 8)  # the custom-tier engine's tensor-parallel sizes the export plans for (one node)


def custom_network(run, book: ScaleBook, variant: dict, out: Path, checks: Checks, layers: list[dict] | None = None) -> dict:
    """network.json + plugin_params.safetensors for build_engine.py --tier custom, and the CPU check of
    that network's graph (trtllm_network.decoder_step, plugins = reference numerics) against
    CompressedCache decoding of the same tokens on the run's model: a prompt of held-out text long
    enough to cross the window into the compressed store, then greedy tokens."""
    from kvcompress.kernels import plan
    from kvcompress.targets import network_oracle as no
    from kvcompress.targets import trtllm_network as tn

    lm, cfg = run.lm, run.cfg
    g = lm.geometry
    token_bytes = tn.token_bytes(variant, g.head_dim)
    n_comp = max(1, min(g.max_position, 8192) - variant["n_sink"] - variant["window"])
    splits = plan.choose_splits(1, g.n_kv_heads, n_comp, variant["gqa"], g.head_dim, token_bytes, variant["block_t"])
    spec = no.network_spec(book, variant, lm.model.config, g, lm.identity, splits, layers)
    # a tensor-parallel rank holds n_kv_heads / tp heads (one, replicated, above them): fewer CTAs a launch, so more splits fill
    # its GPU (build_engine --tp)
    spec["splits_by_tp"] = {str(tp): plan.choose_splits(1, tn.kv_heads_per_rank(spec, tp), n_comp, variant["gqa"], g.head_dim, token_bytes,
                                                        variant["block_t"]) for tp in TP_SIZES if tn.tp_allowed(g.n_heads, g.n_kv_heads, tp)}
    no.write_network_files(out, spec, no.plugin_params(book))
    hf_dir = spec["weights"]["hf_dir"]
    # the commands that build and check its engine: the manifest's next_step_custom_tier_on_gpu_host (custom_tier_steps)
    info = {"files": [no.tn.SPEC_FILE, no.tn.PARAMS_FILE, *NETWORK_FILES, *WEIGHT_READERS], "splits_at_8k": splits, "weights_hf_dir": hf_dir}
    moe = spec["arch"].get("moe")
    if moe:  # the graph's expert MLP is exact but dense: say what it costs where the operator reads the export
        E, k = moe["num_experts"], moe["top_k"]
        info["moe_mlp"] = {"experts": E, "top_k": k, "work_vs_routed": E / k,
                           "note": f"every expert runs on every token, summed by the routing weights (0 for the {E - k} not chosen): {E / k:g}x the "
                                   f"routed experts' work, and a decode step reads all {E} experts' weights whatever the batch; a correctness "
                                   f"path, not TensorRT-LLM's MoE plugin (its native-tier checkpoint routes sparsely)"}
        log.warning("export: the custom-tier network runs all %d experts on every token (%gx the routed work of top-%d routing); "
                    "the native-tier checkpoint routes sparsely (manifest: plugin_bundle.network.moe_mlp)", E, E / k, k)
    if hf_dir and any(Path(hf_dir).glob("*.safetensors")):  # what each GPU must hold, at the fewest tensor-parallel GPUs that hold it
        mem = tn.fewest_gpus(spec, Path(hf_dir), min(g.max_position, 8192), cfg.export.gpu_memory_gb * 1e9, TP_SIZES)
        fits = mem.pop("fits")
        info["engine_memory"] = mem | {"gpus": mem["tp"], "gpu_memory_gb": cfg.export.gpu_memory_gb, "fits": fits,
                                       "note": "the fewest tensor-parallel GPUs (build_engine.py --tp) that hold the fp16 weights and one "
                                               "sequence's cache; build_engine.py refuses an engine larger than its GPU; TensorRT's "
                                               "activations and workspace come on top"}
        if not fits:
            log.warning("export: the custom-tier engine needs %s, more than a %g GB GPU holds (export.gpu_memory_gb) even split over "
                        "its most tensor-parallel GPUs (a divisor of its %d kv heads up to %d)", tn.memory_line(mem), cfg.export.gpu_memory_gb,
                        g.n_kv_heads, TP_SIZES[-1])
    if lm.streamer is not None or not hf_dir or not any(Path(hf_dir).glob("*.safetensors")):
        why = "streamed model: the CPU oracle would hold every layer" if lm.streamer is not None else "no HF weights directory (model built in code)"
        checks.skip("custom-tier network graph (CPU oracle, reference plugins) decodes like CompressedCache", why)
        return info | {"check": {"skipped": why}}
    text = " ".join(load_texts(cfg.eval, "eval").texts)
    n = variant["n_sink"] + variant["window"] + 8
    prompt = lm.tokenizer.encode(text)[:n]
    tol = cfg.export.recheck_abs_tol
    res = no.check_network(out, Path(hf_dir), lm.model, book, prompt, NETWORK_NEW_TOKENS, kl_tolerance=tol)
    res["kl_tolerance"] = tol
    info["files"].append(res["check_file"])
    tp = (info.get("engine_memory") or {}).get("tp", 1)
    info["engine_check"] = (f"{f'mpirun -n {tp} ' if tp > 1 else ''}python build_engine.py --tier custom --check engine_custom: the network check's tokens through the engine against "
                            f"the validated decoding ({res['check_file']}; not run here)")
    ok = res["kl_mean"] <= tol
    checks.add(f"custom-tier network graph (CPU oracle of trtllm_network.decoder_step, reference plugins, fp16 weights) decodes like "
               f"CompressedCache on {res['tokens']} tokens{' crossing into the compressed store' if res['crossed_into_store'] else ''}", ok, res)
    if not ok:
        raise UserError(f"export: the custom-tier network's CPU oracle differs from the validated decoding (mean KL {res['kl_mean']:.2e} > {tol:.1e}); nothing exported")
    return info | {"check": res}


def _compile_launchers(kdir: Path, files: list[Path], arch: str, checks: Checks) -> None:
    inc = launchers.cuda_include_dirs()
    if shutil.which("gcc") is None or not inc:
        return  # not run: recorded by its absence from the checks
    errs = []
    for src in (f for f in files if f.suffix == ".c"):
        c = subprocess.run(["gcc", "-c", "-Wall", "-Werror", f"-I{inc[0]}", f"-I{kdir}", str(src), "-o", "/dev/null"], capture_output=True, text=True)
        if c.returncode:
            errs.append(c.stderr.strip()[-300:])
    checks.add(f"C launchers {arch} compile against cuda.h (gcc -Wall -Werror)", not errs, errs or f"{sum(f.suffix == '.c' for f in files)} files")


def custom_tier_steps(bundle: Path, info: dict) -> str:
    """The commands, from the run directory, that take the custom tier to a checked engine on a GPU host of the bundle's first
    architecture (sm_90 where the export built it; kernels/sm_80 for an A100): the plugin library with CMake unless this
    export compiled it (TENSORRT_INCLUDE_DIR), each variant's acceptance kit, the engine (over the fewest tensor-parallel GPUs
    that hold it), and its check against the validated decoding where the export wrote one (else a short run), under
    mpirun -n N for an engine of N tensor-parallel ranks.
    info: the manifest's plugin_bundle artifact (its variant, or its per-layer variants)."""
    variants = list(info.get("variants") or [info["variant"]["name"]])
    archs = sorted(info.get("kernels") or ["sm_90"], key=lambda a: a != "sm_90")
    lib = f"lib/{archs[0]}/libkvcompress_trt.so"
    steps = ["cd export/plugin_bundle"]
    if not (bundle / lib).is_file():
        lib = "build/libkvcompress_trt.so"
        steps.append(f'cmake -S plugins -B build -DTENSORRT_ROOT=<TensorRT install> -DKVC_KERNELS=kernels/{archs[0]} -DKVC_VARIANTS="{";".join(variants)}" '
                     "&& cmake --build build")
    steps += [f"python acceptance/{v}/verify.py --plugin-lib {lib}" for v in variants]
    tp = ((info.get("network") or {}).get("engine_memory") or {}).get("tp", 1)  # the fewest GPUs that hold the engine
    # a tensor-parallel engine is built for its N ranks and runs one process per rank (engine_rank refuses otherwise)
    build_tp, launch = (f" --tp {tp}", f"mpirun -n {tp} ") if tp > 1 else ("", "")
    steps.append(f"python build_engine.py --tier custom --bundle . --plugin-lib {lib} --out engine_custom{build_tp}")
    steps.append(f"{launch}python build_engine.py --tier custom --check engine_custom" if (bundle / CHECK_FILE).is_file()
                 else f"{launch}python build_engine.py --tier custom --run engine_custom --prompt 'Hello'")
    return " && ".join(steps) + f"   (tensorrt_llm=={TRTLLM_VERSION}; not run here)"


def _compile_plugin(kdir: Path, variant: list[str], out: Path, arch: str, checks: Checks) -> None:
    """libkvcompress_trt.so when TensorRT's headers are given (TENSORRT_INCLUDE_DIR); else not run."""
    from kvcompress.targets.plugin_lib import build

    trt = os.environ.get("TENSORRT_INCLUDE_DIR")
    if not trt or shutil.which("g++") is None:
        return  # not run: recorded by its absence from the checks (and in not_verified_here)
    out.mkdir(parents=True, exist_ok=True)
    try:
        build(Path(trt), kdir, variant if len(variant) > 1 else variant[0], out / "libkvcompress_trt.so")
        checks.add(f"plugin library {arch} compiles against TensorRT headers (-Wall -Wextra -Werror)", True, {"headers": trt, "lib": str(out / "libkvcompress_trt.so")})
    except RuntimeError as e:
        checks.add(f"plugin library {arch} compiles against TensorRT headers (-Wall -Wextra -Werror)", False, str(e)[-800:])
