"""export: the TensorRT-LLM deployment of a run (DESIGN §5), and an honest account of it.

    export/trtllm_ckpt/tp{N}/   native tier: TensorRT-LLM 1.2.x checkpoint, INT8/FP8 KV, folded weights
    export/hf_ckpt/             native tier: folded HF checkpoint with FP8 KV scales (trtllm-serve, vLLM)
    export/plugin_bundle/       custom tier: ScaleBook + spec, AOT kernels + C launchers, plugin sources
    export/manifest.json        what was written, which tier, what was verified and what was not
"""
from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from kvcompress.artifacts import atomic_write_json
from kvcompress.errors import UserError
from kvcompress.fold import apply_fold
from kvcompress.kernels.aot import Variant
from kvcompress.reference import NATIVE_QMAX
from kvcompress.scalebook import ScaleBook
from kvcompress.spec import KVSpec
from kvcompress.stages.fit import fit
from kvcompress.stats import KVStats
from kvcompress.targets import launchers
from kvcompress.targets.hf_ckpt import write_hf_checkpoint
from kvcompress.targets.trtllm_ckpt import TRTLLM_VERSION, check_tp, write_checkpoint

log = logging.getLogger("kvcompress")
ROOT = Path(__file__).resolve().parents[2]
SUPPORTED_ARCH = ("LlamaForCausalLM",)


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


def native_book(stats: KVStats, cfg) -> ScaleBook:
    fmt = "native_int8" if cfg.native_kv == "INT8" else "native_fp8"
    spec = KVSpec(name=fmt, format=fmt, fold_keys=cfg.fold_keys, fold_values=cfg.fold_values, fold_strength=cfg.fold_strength, window=0, sink_tokens=0)
    return fit(stats, spec)


def plugin_bundle(book: ScaleBook, geom, out: Path, archs: list[str]) -> dict:
    """ScaleBook + spec, AOT kernels for each arch with C launchers, TensorRT plugin sources."""
    out.mkdir(parents=True, exist_ok=True)
    book.save(out / "scalebook.safetensors")
    atomic_write_json(out / "kv_spec.json", {"spec": book.spec.model_dump(), "geometry": book.geometry, "layout": "kvcompress.kernels.layout"})
    s = book.spec
    v = Variant(
        f"d{geom.head_dim}_g{geom.n_heads // geom.n_kv_heads}_{s.name}", geom.head_dim, geom.n_heads // geom.n_kv_heads,
        s.key.bits, s.value.bits, s.value_group(geom.head_dim), s.sink_tokens, s.window, s.outlier_channels,
    )
    env = {k: val for k, val in os.environ.items() if k != "TRITON_INTERPRET"}
    kernels = {}
    for arch in archs:
        kdir = out / "kernels" / arch
        cmd = [sys.executable, "-m", "kvcompress.kernels.aot", "--arch", arch, "--out", str(kdir), "--variant-json", json.dumps(v.__dict__)]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if p.returncode:
            raise RuntimeError(f"AOT compile for {arch} failed: {p.stderr.strip()[-600:]}")
        launchers.generate(kdir)
        kernels[arch] = json.loads((kdir / "kernels.json").read_text())["kernels"]
    shutil.copytree(ROOT / "plugins", out / "plugins", dirs_exist_ok=True)
    shutil.copy(ROOT / "export" / "build_engine.py", out / "build_engine.py")
    return {"variant": v.__dict__, "kernels": {a: [k["name"] for k in ks] for a, ks in kernels.items()}}


def export(lm, stats: KVStats, book: ScaleBook, cfg, out: Path) -> dict:
    geom = lm.geometry
    arch = type(lm.model).__name__
    if arch not in SUPPORTED_ARCH:
        raise UserError(f"export=trtllm supports {', '.join(SUPPORTED_ARCH)}; this model is {arch}")
    for tp in cfg.tp_sizes:
        check_tp(geom, tp)
    build, why = engine_status(cfg.build_engine)
    nbook = native_book(stats, cfg)
    folded = copy.deepcopy(lm.model)
    apply_fold(folded, nbook.tensors["fold_k"] if cfg.fold_keys else None, nbook.tensors["fold_v"] if cfg.fold_values else None)
    scales = nbook.tensors["native_scale"]  # [L] dequant scale of the folded K/V
    for tp in cfg.tp_sizes:
        write_checkpoint(folded, geom, out / "trtllm_ckpt" / f"tp{tp}", tp, cfg.dtype, cfg.native_kv, scales)
    amax = scales * NATIVE_QMAX[nbook.spec.format]
    write_hf_checkpoint(folded, lm.tokenizer, out / "hf_ckpt", amax)
    manifest = {
        "tiers": {
            "native": {
                "what": f"TensorRT-LLM {TRTLLM_VERSION} checkpoint(s), kv_cache_quant_algo={cfg.native_kv}, one scale per layer; "
                "per-channel key factors (tied across RoPE pairs) folded into W_q/W_k" + (", value factors into W_v/W_o" if cfg.fold_values else ""),
                "trtllm_ckpt": [f"trtllm_ckpt/tp{tp}" for tp in cfg.tp_sizes],
                "hf_ckpt": "hf_ckpt (FP8 KV scales, ModelOpt unified HF format)",
                "quality": f"validate with kv={nbook.spec.format} simulates this format exactly",
            },
        },
        "engine_built": False,
        "engine_reason": why,
        "next_step_on_gpu_host": f"python build_engine.py --ckpt {out / 'trtllm_ckpt' / f'tp{cfg.tp_sizes[0]}'} --out engine  (needs tensorrt_llm=={TRTLLM_VERSION})",
        "verified_here": {
            "checkpoint weight mapping": "pure-PyTorch reader reproduces the HF logits (tests/test_export.py)",
            "fold exactness": "folded model logits == original in fp32 (tests/test_export.py)",
            "AOT kernels": "compiled for " + ", ".join(cfg.archs) + " with no spills; C launchers compile against cuda.h",
        },
        "not_verified_here": {
            "trtllm-build / trtllm-serve acceptance": "TensorRT-LLM cannot be installed on this machine",
            "TensorRT plugin wrapper": "no TensorRT headers here; compiled only on a TensorRT host (plugins/CMakeLists.txt)",
            "kernel speed": "needs a GPU (scripts/bench_decode_attention.py)",
        },
    }
    if book.spec.format == "kvcompress" and not book.spec.is_baseline:
        manifest["tiers"]["custom"] = {"what": "full kvcompress format: ScaleBook + fused dequant-attention kernels", **plugin_bundle(book, geom, out / "plugin_bundle", cfg.archs)}
    if build:
        manifest["engine_build"] = _build(out / "trtllm_ckpt" / f"tp{cfg.tp_sizes[0]}", out / "engine")
        manifest["engine_built"] = manifest["engine_build"]["returncode"] == 0
    atomic_write_json(out / "manifest.json", manifest)
    return manifest


def _build(ckpt: Path, engine: Path) -> dict:
    p = subprocess.run([sys.executable, str(ROOT / "export" / "build_engine.py"), "--ckpt", str(ckpt), "--out", str(engine)], capture_output=True, text=True)
    return {"returncode": p.returncode, "log_tail": (p.stdout + p.stderr)[-2000:]}


def export_run(run, scalebook_path: Path | None, stats_path: Path | None) -> dict[str, Path]:
    """Pipeline glue for the export stage."""
    cfg = run.cfg.export
    if cfg.name == "none":
        raise UserError("stage export needs an export target: add export=trtllm")
    book_path = scalebook_path or run.dir / "scalebook.safetensors"
    stats_path = stats_path or run.dir / "kv_stats.safetensors"
    if not Path(book_path).is_file() or not Path(stats_path).is_file():
        raise UserError("stage export needs kv_stats and a scalebook: add profile and fit to stages")
    out = run.dir / "export"
    manifest = export(run.lm, KVStats.load(stats_path), run.scalebook(Path(book_path)), cfg, out)
    state = "BUILT" if manifest["engine_built"] else "NOT BUILT"
    log.info("export: wrote %s (native tier%s); TensorRT engine %s: %s", out, " + custom tier" if "custom" in manifest["tiers"] else "", state, manifest["engine_reason"])
    if not manifest["engine_built"]:
        log.info("export: on a GPU host with TensorRT-LLM: %s", manifest["next_step_on_gpu_host"])
    report = run.dir / "report.json"
    if report.is_file():
        data = json.loads(report.read_text())
        data["export"] = manifest
        atomic_write_json(report, data)
    return {"export": out}
