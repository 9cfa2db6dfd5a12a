"""export: the deployment of a run (DESIGN §5), written only from the ScaleBooks validate measured.

    export/trtllm_ckpt/tp{N}/   native tier: TensorRT-LLM 1.2.x checkpoint, INT8/FP8 KV, folded weights
    export/hf_ckpt/             native tier: folded HF checkpoint with FP8 KV scales (trtllm-serve, vLLM)
    export/plugin_bundle/       custom tier: ScaleBook + spec, AOT kernels + C launchers, plugin sources
    export/manifest.json        what was written, from which validated format, and the checks that ran

The stage only sequences: plan (kvcompress.targets.route: which artifacts can carry the model, disk and GPUs; and which
validated ScaleBook feeds which artifact), writers (kvcompress.targets.native for the native tier's checkpoints in one
pass over the layers, kvcompress.targets.bundle for the custom tier), checks (kvcompress.targets.recheck: the written
checkpoints are read back and re-measured; a mismatch with the validated numbers fails the export) and the manifest's
notes (kvcompress.targets.source_notes). Everything is written into a temporary directory that is renamed to export/ when
complete, manifest last.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from kvcompress.artifacts import atomic_write_json, uninterruptible
from kvcompress.data import load_texts, token_windows
from kvcompress.errors import UserError
from kvcompress.hashing import file_fingerprint
from kvcompress.scalebook import ScaleBook
from kvcompress.spec import NATIVE_ALGO
from kvcompress.targets import recheck
from kvcompress.targets.bundle import copy_network, custom_network, custom_tier_steps, plugin_bundle
from kvcompress.targets.checks import Checks
from kvcompress.targets.native import write_native_checkpoints
from kvcompress.targets.route import check_disk, check_exportable, engine_status, export_route, hf_only, tp_advice
from kvcompress.targets.source_notes import note_source_weights, text_decoder_note
from kvcompress.targets.trtllm_ckpt import TRTLLM_VERSION, check_tp, trtllm_architecture

log = logging.getLogger("kvcompress")
ROOT = Path(__file__).resolve().parents[2]
FORMAT_VERSION = 2
HF_SERVE_CHECK = ("python export/check_hf_ckpt.py   (vLLM serves hf_ckpt/ on validate's held-out windows, KV unquantized and FP8: its perplexities "
                  "against validate's; not run here)")


def _book_for(books: dict[str, ScaleBook], fmt: str) -> ScaleBook:
    return next(b for b in books.values() if b.spec.format == fmt)


def _validated(report: dict, name: str) -> dict:
    """The validated FormatResult (as a dict) of the format `name` in report.json."""
    if report["kv"]["name"] == name:
        return {"quality": report["quality"], "verdict": report["verdict"]}
    return next(f for f in report["fallbacks"] if f["name"] == name)


def export(run, books: dict[str, ScaleBook], report: dict, out: Path) -> dict:
    lm, cfg = run.lm, run.cfg
    ecfg = cfg.export
    geom = lm.geometry
    check_exportable(lm.model, books["primary"].spec, ecfg.dtype)
    only_hf = hf_only(lm.model)
    check_disk(out.parent, report["model"]["n_params"], ecfg.tp_sizes, only_hf)  # the parameters validate counted
    for tp in ([] if only_hf else ecfg.tp_sizes):
        check_tp(geom, tp, lm.model.config)
    checks = Checks()
    trt_book, hf_book = (None if only_hf else _book_for(books, cfg.trtllm_format())), _book_for(books, "native_fp8")
    artifacts = {}

    # ---- writers: one pass over the layers, nothing larger than a layer held
    tp_dirs = [] if only_hf else [out / "trtllm_ckpt" / f"tp{tp}" for tp in ecfg.tp_sizes]
    trt_fold, hf_fold = write_native_checkpoints(lm, geom, trt_book, hf_book, ecfg, tp_dirs, out / "hf_ckpt", run.progress)
    # what each GPU loads: the largest rank file of each tp size, as written (FP8 weights kept as stored count as they are)
    per_gpu = {f"tp{tp}": max(f.stat().st_size for f in d.glob("rank*.safetensors")) for tp, d in zip(ecfg.tp_sizes, tp_dirs)}
    tp_note = tp_advice(per_gpu[f"tp{max(ecfg.tp_sizes)}"] * max(ecfg.tp_sizes), ecfg.tp_sizes, ecfg.gpu_memory_gb, geom, lm.model.config) if per_gpu else ""
    if tp_note:
        log.warning("export: %s", tp_note)
    if trt_fold is not None:
        trt_fold.record(checks)
    hf_fold.record(checks)
    hf_guard = hf_fold.guard
    if only_hf:
        return _hf_only_manifest(run, out, checks, report, hf_book, hf_guard, hf_fold.weights)
    algo = NATIVE_ALGO[trt_book.spec.format]
    trt_guard = trt_fold.guard
    primary = books["primary"]
    if primary.spec.tier == "custom":
        mixed = " (per-layer formats: one kernel variant per distinct layer format)" if primary.spec.is_mixed else ""
        artifacts["plugin_bundle"] = {
            "tier": "custom", "what": f"full kvcompress format {primary.spec.name}{mixed}: ScaleBook + fused dequant-attention kernels (AOT) + TensorRT plugin sources",
            "validated_as": primary.spec.name, "verdict": report["verdict"], **plugin_bundle(primary, geom, out / "plugin_bundle", ecfg.archs, checks, run.dir / "kv_stats.safetensors"),
        }
        pb = artifacts["plugin_bundle"]
        if primary.spec.value_rotation_folded:
            pb["value_rotation"] = (f"{primary.spec.value.rotate}, folded into W_v and W_o per head by network_weights.load_hf_weights "
                                    "(network.json value_rotation, plugin_params v_rotation); the kernels store the rotated values")
        from kvcompress.targets.network_oracle import key_max_position

        if key_max_position(primary):
            pb["key_positions"] = (f"asymmetric static keys: ranges hold at positions 0..{key_max_position(primary) - 1} (kv.key.max_position, else "
                                   "the model's max_position); build_engine.py --tier custom caps its default --max-seq-len there and refuses a longer one")
        layers = [pb["variants"][n] for n in pb["layer_variants"]] if "layer_variants" in pb else None
        pb["network"] = custom_network(run, primary, pb["variant"], out / "plugin_bundle", checks, layers)

    # ---- checks: read back and re-measure what was written
    base, tol = _baseline(run), (ecfg.recheck_rel_tol, ecfg.recheck_abs_tol)
    g = books["primary"].geometry
    streamed = lm.streamer is not None  # a model that does not fit is re-measured layer by layer, never loaded whole
    how = f"streamed layer by layer into transformers' {type(lm.model).__name__}" if streamed else "reader"
    v_trt = _validated(report, trt_book.spec.name)
    m_trt = recheck.remeasure_trtllm_streamed(tp_dirs[0], lm.model.config, g, base, lm.device) if streamed \
        else recheck.remeasure_trtllm(tp_dirs[0], base)
    c_trt = recheck.compare(v_trt["quality"], m_trt, *tol)
    wdesc = f"the source's FP8 MLP weights and {ecfg.dtype}" if trt_fold.weights["fp8_weights_kept"] else ecfg.dtype
    checks.add(f"trtllm_ckpt/tp{ecfg.tp_sizes[0]} re-measured ({how}, {wdesc} weights, {algo} KV from its stored scales) matches validated {trt_book.spec.name}", c_trt["passed"], c_trt)
    for tp, d in list(zip(ecfg.tp_sizes, tp_dirs))[1:]:
        same = recheck.same_trtllm_tensors(tp_dirs[0], d, geom.n_layers)
        checks.add(f"trtllm_ckpt/tp{tp} shards merge to exactly the tensors of tp{ecfg.tp_sizes[0]}", same, None)
    _refuse_failed("trtllm_ckpt", c_trt)
    v_hf, c_hf = _check_hf(run, out, hf_book, report, checks, base, g)

    artifacts["trtllm_ckpt"] = {
        "tier": "native", "what": f"TensorRT-LLM {TRTLLM_VERSION} checkpoint(s) tp {ecfg.tp_sizes}, kv_cache_quant_algo={algo} (one scale per layer), {wdesc} weights with the fold of {trt_book.spec.name}",
        **trt_fold.weights,
        "paths": [str(d.relative_to(out)) for d in tp_dirs], "validated_as": trt_book.spec.name, "verdict": v_trt["verdict"],
        "weights_per_gpu_bytes": per_gpu, **({"tp_advice": tp_note} if tp_note else {}),
        "fold": {k: trt_book.fit_info.get(k) for k in ("fold_strength_keys", "fold_strength_values", "headroom", "fold_pairs")}, "fold_guard": trt_guard, "remeasured": c_trt,
        "architecture": {"source": type(lm.model).__name__, "written": trtllm_architecture(lm.model.config)},
    }
    if algo == "NVFP4":
        artifacts["trtllm_ckpt"]["pre_blackwell_fallback"] = ("NVFP4 KV needs a Blackwell GPU (sm_100+); on Hopper/Ampere serve hf_ckpt/ (FP8 KV, validated above) "
                                                              "or re-export with export.native_kv=FP8")
    artifacts["hf_ckpt"] = _hf_artifact(ecfg, hf_book, v_hf, c_hf, hf_guard, hf_fold.weights)
    note_source_weights(lm, artifacts, ecfg.dtype)
    shutil.copy(ROOT / "export" / "build_engine.py", out / "build_engine.py")
    copy_network(out)
    build, why = engine_status(ecfg.build_engine)
    ckpt0 = f"export/trtllm_ckpt/tp{ecfg.tp_sizes[0]}"
    manifest = {
        "format_version": FORMAT_VERSION,
        "run": str(run.dir),
        "artifacts": artifacts,
        **text_decoder_note(lm),
        "checks": checks.rows,
        "engine_built": False,
        "engine_reason": why,
        "next_step_on_gpu_host": f"python export/build_engine.py --ckpt {ckpt0} --out engine   (tensorrt_llm=={TRTLLM_VERSION}; the native tier)",
        **({"next_step_custom_tier_on_gpu_host": custom_tier_steps(out / "plugin_bundle", artifacts["plugin_bundle"])} if "plugin_bundle" in artifacts else {}),
        "check_on_gpu_host": HF_SERVE_CHECK,
        "fallback_fp16_kv": f"python export/build_engine.py --ckpt {ckpt0} --out engine_fp16kv --kv-cache fp16"
        "   (the same folded weights with an unquantized KV cache: a rollback without re-exporting)",
        "not_verified_here": {
            "trtllm-build / trtllm-serve / vLLM acceptance": "TensorRT-LLM and vLLM cannot be installed on this machine",
            "TensorRT plugin wrapper": ("compiled in this run against the TensorRT headers in TENSORRT_INCLUDE_DIR (see checks); never run"
                                        if os.environ.get("TENSORRT_INCLUDE_DIR") else
                                        "not compiled in this run (TENSORRT_INCLUDE_DIR unset); compiled against TensorRT v10.13.3's headers at "
                                        "development time (plugins/README.md); never run (no TensorRT runtime or GPU here)"),
            "kernel speed": "needs a GPU (scripts/bench_decode_attention.py); predicted from the compiled code by scripts/predict_decode.py",
            "ONNX acceptance kit on TensorRT": "plugin_bundle/acceptance/<variant>/verify.py needs a TensorRT host with a GPU; only its CPU check ran here",
            "custom-tier TensorRT-LLM engine": ("build_engine.py --tier custom (network: trtllm_network.py) was not run: no TensorRT-LLM or GPU here; "
                                                "its graph ran on CPU with the reference plugins (see checks), its TensorRT names were checked "
                                                "against TensorRT v10.13.3's bindings and its TensorRT-LLM names by reading the source (export/TRTLLM_API_CHECK.md); "
                                                "where the export ran the network check, build_engine.py --tier custom --check ENGINE compares the built "
                                                "engine with the validated decoding on its tokens (plugin_bundle/network_check.safetensors) on a GPU host"),
        },
        "files": _files(out),
    }
    return manifest, build


def _files(out: Path) -> dict:
    """Every file the export wrote (checkpoints, kernels, launchers, audit, plugin sources, acceptance kit), hashed."""
    return {str(p.relative_to(out)): file_fingerprint(p) for p in sorted(out.rglob("*")) if p.is_file() and not p.is_symlink()}


def _baseline(run):
    """validate's kept baseline of the held-out windows, or (export without validate in this process) computed again."""
    if run.baseline is not None:
        return run.baseline
    lm, cfg = run.lm, run.cfg
    windows = token_windows(lm.tokenizer, load_texts(cfg.eval, "eval"), cfg.eval.n_windows, cfg.eval.seq_len, seed=cfg.eval.seed)
    return recheck.baseline(lm, windows, cfg.eval.batch_size)


def _refuse_failed(label: str, c: dict) -> None:
    if not c["passed"]:
        raise UserError(f"export: the written {label} re-measures KL {c['remeasured_kl']:.3e} but validate measured {c['validated_kl']:.3e} "
                        f"(tolerance {c['tolerance']:.1e}); nothing exported")


def _check_hf(run, out: Path, hf_book: ScaleBook, report: dict, checks: Checks, base, g: dict) -> tuple[dict, dict]:
    """Re-measure the written hf_ckpt through transformers (layer by layer for a streamed model) against validate's
    numbers for its format: (validated, comparison); a failed comparison exports nothing."""
    lm, ecfg = run.lm, run.cfg.export
    streamed = lm.streamer is not None
    v_hf = _validated(report, hf_book.spec.name)
    m_hf = recheck.remeasure_hf_streamed(out / "hf_ckpt", g, base, lm.device) if streamed \
        else recheck.remeasure_hf(out / "hf_ckpt", g, base)
    c_hf = recheck.compare(v_hf["quality"], m_hf, ecfg.recheck_rel_tol, ecfg.recheck_abs_tol)
    checks.add(f"hf_ckpt re-measured (transformers reads config.json + shards{', layer by layer' if streamed else ''}, FP8 KV from k_scale/v_scale) "
               f"matches validated {hf_book.spec.name}", c_hf["passed"], c_hf)
    _refuse_failed("hf_ckpt", c_hf)
    write_serve_check(out, base.windows, v_hf["quality"], hf_book.spec.name)
    return v_hf, c_hf


def write_serve_check(out: Path, windows: torch.Tensor, quality: dict, fmt: str) -> None:
    """export/check_hf_ckpt.py and what it reads (hf_ckpt_check/): the held-out windows validate measured and its numbers on
    them, so a GPU host serves hf_ckpt/ with vLLM on the same tokens and compares (the script's doc)."""
    from safetensors.torch import save_file

    d = out / "hf_ckpt_check"
    d.mkdir(parents=True, exist_ok=True)
    save_file({"ids": windows.to(torch.int32).contiguous()}, str(d / "windows.safetensors"))
    atomic_write_json(d / "expected.json", {"format": fmt, "windows": list(windows.shape), "ppl_baseline": quality["ppl_baseline"],
                                            "ppl_fp8_kv": quality["ppl_compressed"], "ppl_delta_rel": quality["ppl_delta_rel"],
                                            "semantics": "validate's perplexity over every token after the first of each window: float32 model, "
                                                         "KV unquantized (ppl_baseline) and with the checkpoint's FP8 KV cache simulated"})
    shutil.copy(ROOT / "export" / "check_hf_ckpt.py", out / "check_hf_ckpt.py")


def _hf_artifact(ecfg, hf_book: ScaleBook, v_hf: dict, c_hf: dict, guard: dict, weights: dict) -> dict:
    what = (f"Hugging Face checkpoint (sharded) with FP8 KV scales, the source's {weights['kept_formats']} weights kept, fold of {hf_book.spec.name}"
            if weights["fp8_weights_kept"] else
            f"Hugging Face checkpoint ({ecfg.dtype}, sharded) with FP8 KV scales, ModelOpt unified format, fold of {hf_book.spec.name}")
    return {
        "tier": "native", "what": what, **weights,
        "paths": ["hf_ckpt"], "validated_as": hf_book.spec.name, "verdict": v_hf["verdict"],
        "fold": {k: hf_book.fit_info.get(k) for k in ("fold_strength_keys", "fold_strength_values", "headroom", "fold_pairs", "key_norm", "fold_keys_off",
                                                       "fold_values_off")},
        "fold_guard": guard, "remeasured": c_hf,
    }


def _hf_only_manifest(run, out: Path, checks: Checks, report: dict, hf_book: ScaleBook, guard: dict, weights: dict) -> tuple[dict, bool]:
    """The export of a model the TensorRT-LLM checkpoint cannot carry (export_route; Gemma 3): the folded FP8 HF checkpoint,
    re-measured, and nothing else."""
    lm = run.lm
    v_hf, c_hf = _check_hf(run, out, hf_book, report, checks, _baseline(run), hf_book.geometry)
    manifest = {
        "format_version": FORMAT_VERSION,
        "run": str(run.dir),
        "artifacts": note_source_weights(lm, {"hf_ckpt": _hf_artifact(run.cfg.export, hf_book, v_hf, c_hf, guard, weights)}, run.cfg.export.dtype),
        **text_decoder_note(lm),
        "not_written": {"trtllm_ckpt": f"{export_route(lm.model)[1]}; serve hf_ckpt/, which TensorRT-LLM's PyTorch backend and vLLM run with "
                                       "the model's own code"},
        "checks": checks.rows,
        "engine_built": False,
        "engine_reason": "no TensorRT-LLM checkpoint for this model (hf_ckpt/ is served by TensorRT-LLM's PyTorch backend, which builds no engine)",
        "next_step_on_gpu_host": ("python export/check_hf_ckpt.py   (the stored k/v scales are not read by vLLM for this quantization method: "
                                  "artifacts.hf_ckpt.kv_scales_unread; the check measures what --kv-cache-dtype fp8 serves before you rely on it; "
                                  "vllm serve export/hf_ckpt --kv-cache-dtype auto serves the validated weights with an unquantized KV cache)")
                                 if weights.get("kv_scales_unread") else
                                 "trtllm-serve export/hf_ckpt --kv_cache_dtype fp8   (TensorRT-LLM's PyTorch backend; the quantization config carries the "
                                 "FP8 KV cache and its stored k_scale/v_scale; or: vllm serve export/hf_ckpt --kv-cache-dtype fp8; neither run here)",
        "check_on_gpu_host": HF_SERVE_CHECK,
        "fallback_fp16_kv": ("serve export/hf_ckpt with --kv-cache-dtype auto after removing the KV entries of its quantization config (kv_cache_quant_algo "
                             "in hf_quant_config.json, kv_cache_scheme in config.json), keeping the weight format: the same folded weights with an "
                             "unquantized KV cache") if weights["fp8_weights_kept"] else
                            ("serve export/hf_ckpt without hf_quant_config.json and config.json's quantization_config: the same folded weights "
                             "(the fold is exact in float32, then rounded to export.dtype) with an unquantized KV cache"),
        "not_verified_here": {
            "trtllm-serve / vLLM loading and serving": "neither installs on this machine; the checkpoint was re-measured through transformers (see checks)",
        },
        "files": _files(out),
    }
    return manifest, False


def _build(ckpt: Path, engine: Path) -> dict:
    p = subprocess.run([sys.executable, str(ROOT / "export" / "build_engine.py"), "--ckpt", str(ckpt), "--out", str(engine)], capture_output=True, text=True)
    return {"returncode": p.returncode, "log_tail": (p.stdout + p.stderr)[-2000:]}


def check_validated(run_dir: Path, book_paths: dict[str, Path]) -> None:
    """Export ships only what validate measured: the run directory's report and ScaleBooks must be there, and each book the
    very file report.json validated (its sha256 in validated_books): a fit between validate and export (stages=[fit] in the
    directory, then stages=[export]) shipped the new books under the old report."""
    report = run_dir / "report.json"
    if not report.is_file() or any(not Path(p).is_file() for p in book_paths.values()):
        raise UserError("stage export ships only what validate measured: run it with fit and validate (the default stages)")
    if not book_paths:
        return
    measured = json.loads(report.read_text()).get("validated_books") or {}
    for role, p in book_paths.items():
        rec = measured.get(role)
        if rec is None or rec.get("sha256") != file_fingerprint(p):
            why = (f"report.json validated no {role} ScaleBook" + (" (written by an older kvcompress, which did not record them)" if not measured else "")
                   if rec is None else f"it changed since validate measured it (refit or replaced; report.json validated {rec.get('kv')})")
            raise UserError(f"stage export ships only what validate measured: {Path(p).name}: {why}; run validate again (stages=[validate,export])")


def export_run(run, book_paths: dict[str, Path]) -> dict[str, Path]:
    """Pipeline glue: export into a temporary directory, rename to export/ when complete."""
    report_path = run.dir / "report.json"
    check_validated(run.dir, book_paths)
    report = json.loads(report_path.read_text())
    books = {role: run.scalebook(Path(p)) for role, p in book_paths.items()}
    final, tmp, old = run.dir / "export", run.dir / ".export.tmp", run.dir / ".export.old"
    shutil.rmtree(tmp, ignore_errors=True)
    if old.exists() and not final.exists():  # a process killed between the two renames below: its earlier export
        old.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    try:
        manifest, build = export(run, books, report, tmp)
        atomic_write_json(tmp / "manifest.json", manifest)  # last: a directory with a manifest is complete
        with uninterruptible():  # an earlier export moved aside, not deleted, until the new one is in place
            if final.exists():
                final.rename(old)
            tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        with uninterruptible():
            shutil.rmtree(tmp, ignore_errors=True)
            if old.exists() and not final.exists():  # the earlier export back in place
                old.rename(final)
        raise
    if build:
        manifest["engine_build"] = _build(final / "trtllm_ckpt" / f"tp{run.cfg.export.tp_sizes[0]}", final / "engine")
        manifest["engine_built"] = manifest["engine_build"]["returncode"] == 0
        atomic_write_json(final / "manifest.json", manifest)
    failed = [c["check"] for c in manifest["checks"] if c["status"] not in ("passed", "skipped")]
    skipped = [c["check"] for c in manifest["checks"] if c["status"] == "skipped"]
    log.info("export: wrote %s (%s); %d checks, %s%s; TensorRT engine %s: %s", final, ", ".join(manifest["artifacts"]), len(manifest["checks"]),
             f"FAILED: {failed}" if failed else "all that ran passed", f"; skipped (reason in the manifest): {skipped}" if skipped else "",
             "BUILT" if manifest["engine_built"] else "NOT BUILT", manifest["engine_reason"])
    report["export"] = manifest
    atomic_write_json(report_path, report)
    return {"export": final}
