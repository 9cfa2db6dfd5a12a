"""export: the deployment of a run (DESIGN §5), written only from the ScaleBooks validate measured.

    export/trtllm_ckpt/tp{N}/   native tier: TensorRT-LLM 1.2.x checkpoint, INT8/FP8 KV, folded weights
    export/hf_ckpt/             native tier: folded HF checkpoint with FP8 KV scales (trtllm-serve, vLLM)
    export/plugin_bundle/       custom tier: ScaleBook + spec, AOT kernels + C launchers, plugin sources
    export/manifest.json        what was written, from which validated format, and the checks that ran

The stage only sequences: plan (which validated ScaleBook feeds which artifact), writers
(kvcompress.targets.*), checks (kvcompress.targets.recheck: the written checkpoints are read
back and re-measured; a mismatch with the validated numbers fails the export). Everything is
written into a temporary directory that is renamed to export/ when complete, manifest last.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import torch

from kvcompress.artifacts import atomic_write_json
from kvcompress.data import load_texts, token_windows
from kvcompress.errors import UserError
from kvcompress.fold import check_range, fold_state_dict, guard_factors
from kvcompress.hashing import file_fingerprint
from kvcompress.kernels.aot import Variant
from kvcompress.models.base import DTYPES
from kvcompress.scalebook import ScaleBook
from kvcompress.spec import NATIVE_ALGO
from kvcompress.targets import launchers, recheck, trtllm_reader
from kvcompress.targets.hf_ckpt import write_hf_checkpoint
from kvcompress.targets.trtllm_ckpt import TRTLLM_VERSION, check_tp, write_checkpoint

log = logging.getLogger("kvcompress")
ROOT = Path(__file__).resolve().parents[2]
SUPPORTED_ARCH = ("LlamaForCausalLM",)
FORMAT_VERSION = 2


def check_exportable(model) -> None:
    """export=trtllm writes Llama-family checkpoints only: say so before profiling, not after validating."""
    arch = type(model).__name__
    if arch not in SUPPORTED_ARCH:
        raise UserError(f"export=trtllm supports {', '.join(SUPPORTED_ARCH)}; this model is {arch}: add export=none to profile, fit and validate it")


def engine_status(policy: str) -> tuple[bool, str]:
    """(build now?, why) for export.build_engine; `always` without TensorRT-LLM + GPU is a user error."""
    have_trtllm = importlib.util.find_spec("tensorrt_llm") is not None
    have_gpu = torch.cuda.is_available()
    missing = [n for n, ok in (("tensorrt_llm", have_trtllm), ("a CUDA GPU", have_gpu)) if not ok]
    if policy == "never":
        return False, "export.build_engine=never"
    if missing:
        if policy == "always":
            raise UserError(f"export.build_engine=always but this machine lacks {' and '.join(missing)}; use build_engine=auto or run on a TensorRT-LLM GPU host")
        return False, f"this machine lacks {' and '.join(missing)}"
    return True, "TensorRT-LLM and a GPU are present"


class Checks:
    """The checks that ran in this export, in order; the manifest records exactly these."""

    def __init__(self):
        self.rows: list[dict] = []

    def add(self, name: str, passed: bool, detail) -> bool:
        self.rows.append({"check": name, "status": "passed" if passed else "failed", "detail": detail})
        return passed


def plugin_bundle(book: ScaleBook, geom, out: Path, archs: list[str], checks: Checks) -> dict:
    """ScaleBook + spec, AOT kernels for each arch (compiled in parallel) with C launchers, plugin sources."""
    out.mkdir(parents=True, exist_ok=True)
    book.save(out / "scalebook.safetensors")
    atomic_write_json(out / "kv_spec.json", {"spec": book.spec.model_dump(), "geometry": book.geometry, "layout": "kvcompress.kernels.layout"})
    s = book.spec
    v = Variant(
        f"d{geom.head_dim}_g{geom.n_heads // geom.n_kv_heads}_{s.name}", geom.head_dim, geom.n_heads // geom.n_kv_heads,
        s.key.bits, s.value.bits, s.value_group(geom.head_dim), s.sink_tokens, s.window, s.outlier_channels,
    )
    env = {k: val for k, val in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    procs = {arch: subprocess.Popen([sys.executable, "-m", "kvcompress.kernels.aot", "--arch", arch, "--out", str(out / "kernels" / arch),
                                     "--variant-json", json.dumps(v.__dict__)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for arch in archs}
    kernels = {}
    for arch, p in procs.items():
        _, err = p.communicate()
        if p.returncode:
            raise RuntimeError(f"AOT compile for {arch} failed: {err.strip()[-600:]}")
        kdir = out / "kernels" / arch
        files = launchers.generate(kdir)
        meta = json.loads((kdir / "kernels.json").read_text())["kernels"]
        kernels[arch] = [k["name"] for k in meta]
        checks.add(f"AOT kernels {arch}: no spills (cuobjdump)", not any(k["spills"] for k in meta),
                   {k["name"]: {"registers": k["registers"], "local": k["local"], "stack": k["stack"]} for k in meta})
        _compile_launchers(kdir, files, arch, checks)
    shutil.copytree(ROOT / "plugins", out / "plugins", dirs_exist_ok=True)
    shutil.copy(ROOT / "export" / "build_engine.py", out / "build_engine.py")
    return {"variant": v.__dict__, "kernels": kernels}


def _compile_launchers(kdir: Path, files: list[Path], arch: str, checks: Checks) -> None:
    inc = launchers.cuda_include_dirs()
    if shutil.which("gcc") is None or not inc:
        return  # not run: recorded by its absence from the checks
    errs = []
    for src in (f for f in files if f.suffix == ".c"):
        c = subprocess.run(["gcc", "-c", "-Wall", "-Werror", f"-I{inc[0]}", f"-I{kdir}", str(src), "-o", "/dev/null"], capture_output=True, text=True)
        if c.returncode:
            errs.append(c.stderr.strip()[-300:])
    checks.add(f"C launchers {arch} compile against cuda.h (gcc -Wall -Werror)", not errs, errs or f"{len(files) - 1} files")


def _book_for(books: dict[str, ScaleBook], fmt: str) -> ScaleBook:
    return next(b for b in books.values() if b.spec.format == fmt)


def _validated(report: dict, name: str) -> dict:
    """The validated FormatResult (as a dict) of the format `name` in report.json."""
    if report["kv"]["name"] == name:
        return {"quality": report["quality"], "verdict": report["verdict"]}
    return next(f for f in report["fallbacks"] if f["name"] == name)


def _folded(state: dict, geom, book: ScaleBook, dtype: torch.dtype, checks: Checks, label: str) -> tuple[dict, dict]:
    sigma, guard = guard_factors(state, geom, book.tensors["fold_k"], dtype)
    folded = fold_state_dict(state, geom, sigma, book.tensors["fold_v"])
    bad = check_range(folded, dtype)
    checks.add(f"{label}: folded q/k/v/o weights within {str(dtype).removeprefix('torch.')} range (no overflow, no rows flushed)", not bad,
               {"factors_raised_by_guard": guard["raised"], "layers": guard["layers"], "problems": bad[:5]})
    if bad:
        raise UserError(f"export: folding {book.spec.name} puts weights outside {dtype}: {bad[0]}; nothing exported")
    return folded, guard


def export(run, books: dict[str, ScaleBook], report: dict, out: Path) -> dict:
    lm, cfg = run.lm, run.cfg
    ecfg = cfg.export
    geom = lm.geometry
    check_exportable(lm.model)
    for tp in ecfg.tp_sizes:
        check_tp(geom, tp)
    dtype = DTYPES[ecfg.dtype]
    checks = Checks()
    state = {k: v.detach() for k, v in lm.model.state_dict().items()}  # references: nothing is copied
    trt_book, hf_book = _book_for(books, cfg.trtllm_format()), _book_for(books, "native_fp8")
    artifacts = {}

    # ---- writers
    trt_state, trt_guard = _folded(state, geom, trt_book, dtype, checks, "trtllm_ckpt")
    algo = NATIVE_ALGO[trt_book.spec.format]
    tp_dirs = [out / "trtllm_ckpt" / f"tp{tp}" for tp in ecfg.tp_sizes]
    for tp, d in zip(ecfg.tp_sizes, tp_dirs):
        write_checkpoint(trt_state, geom, d, tp, ecfg.dtype, algo, trt_book.tensors["native_scale"], hf_config=lm.model.config)
    del trt_state
    hf_state, hf_guard = _folded(state, geom, hf_book, dtype, checks, "hf_ckpt")
    write_hf_checkpoint(hf_state, lm.model.config, lm.tokenizer, out / "hf_ckpt", hf_book.tensors["native_scale"], dtype, ecfg.shard_mb)
    del hf_state
    primary = books["primary"]
    if primary.spec.tier == "custom":
        artifacts["plugin_bundle"] = {
            "tier": "custom", "what": f"full kvcompress format {primary.spec.name}: ScaleBook + fused dequant-attention kernels (AOT) + TensorRT plugin sources",
            "validated_as": primary.spec.name, "verdict": report["verdict"], **plugin_bundle(primary, geom, out / "plugin_bundle", ecfg.archs, checks),
        }

    # ---- checks: read back and re-measure what was written
    windows, base = run.baseline if run.baseline and run.baseline[1] is not None else (None, None)
    if base is None:
        windows = token_windows(lm.tokenizer, load_texts(cfg.eval), cfg.eval.n_windows, cfg.eval.seq_len, seed=cfg.eval.seed)
        base = recheck.baseline_logprobs(lm.model, windows, cfg.eval.batch_size)
    tol = (ecfg.recheck_rel_tol, ecfg.recheck_abs_tol)
    v_trt = _validated(report, trt_book.spec.name)
    c_trt = recheck.compare(v_trt["quality"], recheck.remeasure_trtllm(tp_dirs[0], windows, base, cfg.eval.batch_size), *tol)
    checks.add(f"trtllm_ckpt/tp{ecfg.tp_sizes[0]} re-measured (reader, {ecfg.dtype} weights, {algo} KV from its stored scales) matches validated {trt_book.spec.name}", c_trt["passed"], c_trt)
    ref_tensors = trtllm_reader.merge_shards(tp_dirs[0])[1]
    for tp, d in list(zip(ecfg.tp_sizes, tp_dirs))[1:]:
        other = trtllm_reader.merge_shards(d)[1]
        same = other.keys() == ref_tensors.keys() and all(torch.equal(other[k], ref_tensors[k]) for k in ref_tensors)
        checks.add(f"trtllm_ckpt/tp{tp} shards merge to exactly the tensors of tp{ecfg.tp_sizes[0]}", same, None)
    v_hf = _validated(report, hf_book.spec.name)
    c_hf = recheck.compare(v_hf["quality"], recheck.remeasure_hf(out / "hf_ckpt", books["primary"].geometry, windows, base, cfg.eval.batch_size), *tol)
    checks.add(f"hf_ckpt re-measured (transformers reads config.json + shards, FP8 KV from k_scale/v_scale) matches validated {hf_book.spec.name}", c_hf["passed"], c_hf)
    for label, c in (("trtllm_ckpt", c_trt), ("hf_ckpt", c_hf)):
        if not c["passed"]:
            raise UserError(f"export: the written {label} re-measures KL {c['remeasured_kl']:.3e} but validate measured {c['validated_kl']:.3e} "
                            f"(tolerance {c['tolerance']:.1e}); nothing exported")

    artifacts["trtllm_ckpt"] = {
        "tier": "native", "what": f"TensorRT-LLM {TRTLLM_VERSION} checkpoint(s) tp {ecfg.tp_sizes}, kv_cache_quant_algo={algo} (one scale per layer), {ecfg.dtype} weights with the fold of {trt_book.spec.name}",
        "paths": [str(d.relative_to(out)) for d in tp_dirs], "validated_as": trt_book.spec.name, "verdict": v_trt["verdict"],
        "fold": {k: trt_book.fit_info.get(k) for k in ("fold_strength_keys", "fold_strength_values")}, "fold_guard": trt_guard, "remeasured": c_trt,
    }
    artifacts["hf_ckpt"] = {
        "tier": "native", "what": f"Hugging Face checkpoint ({ecfg.dtype}, sharded) with FP8 KV scales, ModelOpt unified format, fold of {hf_book.spec.name}",
        "paths": ["hf_ckpt"], "validated_as": hf_book.spec.name, "verdict": v_hf["verdict"],
        "fold": {k: hf_book.fit_info.get(k) for k in ("fold_strength_keys", "fold_strength_values")}, "fold_guard": hf_guard, "remeasured": c_hf,
    }
    shutil.copy(ROOT / "export" / "build_engine.py", out / "build_engine.py")
    build, why = engine_status(ecfg.build_engine)
    ckpt0 = f"export/trtllm_ckpt/tp{ecfg.tp_sizes[0]}"
    manifest = {
        "format_version": FORMAT_VERSION,
        "run": str(run.dir),
        "artifacts": artifacts,
        "checks": checks.rows,
        "engine_built": False,
        "engine_reason": why,
        "next_step_on_gpu_host": f"python export/build_engine.py --ckpt {ckpt0} --out engine   (tensorrt_llm=={TRTLLM_VERSION}; the native tier)",
        "fallback_fp16_kv": f"python export/build_engine.py --ckpt {ckpt0} --out engine_fp16kv --kv-cache fp16"
        "   (the same folded weights with an unquantized KV cache: a rollback without re-exporting)",
        "not_verified_here": {
            "trtllm-build / trtllm-serve / vLLM acceptance": "TensorRT-LLM and vLLM cannot be installed on this machine",
            "TensorRT plugin wrapper": "no TensorRT headers here; compiled only on a TensorRT host (plugins/CMakeLists.txt)",
            "kernel speed": "needs a GPU (scripts/bench_decode_attention.py)",
        },
        "files": {str(p.relative_to(out)): file_fingerprint(p) for p in sorted(out.rglob("*.safetensors"))},
    }
    return manifest, build


def _build(ckpt: Path, engine: Path) -> dict:
    p = subprocess.run([sys.executable, str(ROOT / "export" / "build_engine.py"), "--ckpt", str(ckpt), "--out", str(engine)], capture_output=True, text=True)
    return {"returncode": p.returncode, "log_tail": (p.stdout + p.stderr)[-2000:]}


@contextmanager
def _uninterruptible():
    """Ignore further Ctrl-C while cleaning up after an interrupt (a second one must not leave half a temp dir)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def export_run(run, book_paths: dict[str, Path]) -> dict[str, Path]:
    """Pipeline glue: export into a temporary directory, rename to export/ when complete."""
    report_path = run.dir / "report.json"
    if not report_path.is_file() or any(not Path(p).is_file() for p in book_paths.values()):
        raise UserError("stage export ships only what validate measured: run it with fit and validate (the default stages)")
    report = json.loads(report_path.read_text())
    books = {role: run.scalebook(Path(p)) for role, p in book_paths.items()}
    final, tmp = run.dir / "export", run.dir / ".export.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        manifest, build = export(run, books, report, tmp)
        atomic_write_json(tmp / "manifest.json", manifest)  # last: a directory with a manifest is complete
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        with _uninterruptible():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if build:
        manifest["engine_build"] = _build(final / "trtllm_ckpt" / f"tp{run.cfg.export.tp_sizes[0]}", final / "engine")
        manifest["engine_built"] = manifest["engine_build"]["returncode"] == 0
        atomic_write_json(final / "manifest.json", manifest)
    failed = [c["check"] for c in manifest["checks"] if c["status"] != "passed"]
    log.info("export: wrote %s (%s); %d checks ran, %s; TensorRT engine %s: %s", final, ", ".join(manifest["artifacts"]), len(manifest["checks"]),
             f"FAILED: {failed}" if failed else "all passed", "BUILT" if manifest["engine_built"] else "NOT BUILT", manifest["engine_reason"])
    report["export"] = manifest
    atomic_write_json(report_path, report)
    return {"export": final}
