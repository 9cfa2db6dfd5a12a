"""validate: a fitted ScaleBook against the fp16 cache, same model, same held-out tokens.

The compressed side runs the one-pass decode-equivalent attention (kvcompress.eval.attention):
every position reads older tokens exactly as the compressed cache would hand them back.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from kvcompress import reference as ref
from kvcompress.artifacts import atomic_write_json
from kvcompress.data import load_texts, token_windows
from kvcompress.errors import UserError
from kvcompress.eval.attention import LayerErrors, compressed_attention
from kvcompress.eval.gates import evaluate_gates
from kvcompress.eval.retrieval import run_tasks
from kvcompress.stages.report import write_report_files
from kvcompress.eval.metrics import QualityAccumulator
from kvcompress.models.base import Geometry
from kvcompress.planner import KNOWN, plan_pair
from kvcompress.provenance import base_provenance
from kvcompress.report_schema import Memory, Quality, Report
from kvcompress.scalebook import ScaleBook
from kvcompress.spec import KVSpec

log = logging.getLogger("kvcompress")
REPORT_FILE = "report.json"
BASELINE = KVSpec(name="fp16", key={"bits": 16}, value={"bits": 16}, window=0, sink_tokens=0)


@torch.no_grad()
def evaluate_quality(model, book: ScaleBook, windows: torch.Tensor, batch_size: int, progress: bool = True) -> tuple[dict, LayerErrors]:
    """Baseline vs compressed (one-pass) logits over token windows [N, T] -> quality metrics."""
    acc = QualityAccumulator()
    errors = LayerErrors(book.geometry["n_layers"])
    device = next(model.parameters()).device
    for lo in tqdm(range(0, windows.shape[0], batch_size), desc="validate", unit="batch", disable=not progress):
        ids = windows[lo : lo + batch_size].to(device)
        base = model(input_ids=ids, use_cache=False).logits
        with compressed_attention(model, book, errors):
            comp = model(input_ids=ids, use_cache=False).logits
        acc.update(base.cpu(), comp.cpu(), ids.cpu())
    return acc.result(), errors


def memory_summary(spec: KVSpec, geom: Geometry, context: int) -> Memory:
    """Bytes per token of the fp16 and the compressed cache at `context` (reference accounting)."""
    fp16 = sum(ref.spec_cache_nbytes(BASELINE, geom, context).values()) / context
    b = ref.spec_cache_nbytes(spec, geom, context)
    static = b.pop("static", 0)
    per_tok = {k: v / context for k, v in b.items()}
    comp = sum(per_tok.values())
    elems = 2 * geom.n_layers * geom.n_kv_heads * geom.head_dim
    return Memory(
        context=context,
        bytes_per_token_fp16=fp16,
        bytes_per_token_compressed=comp,
        compression_ratio=fp16 / comp,
        breakdown_per_token=per_tok,
        static_bytes=static,
        bits_per_element=comp * 8 / elems,
    )


def validate(lm, book: ScaleBook, eval_cfg, calib_sha: str | None = None, progress: bool = True) -> Report:
    t0 = time.time()
    texts = load_texts(eval_cfg)
    if calib_sha is not None and texts.sha256 == calib_sha:
        raise UserError("eval text is the calibration text; validation needs held-out text (eval.split=heldout or other eval.paths)")
    windows = token_windows(lm.tokenizer, texts, eval_cfg.n_windows, eval_cfg.seq_len, seed=eval_cfg.seed)
    quality, errors = evaluate_quality(lm.model, book, windows, eval_cfg.batch_size, progress)
    tasks = None
    if eval_cfg.tasks.names:
        corpus = [i for t in texts.texts for i in lm.tokenizer.encode(t)]
        tasks = run_tasks(lm, book, corpus, eval_cfg.tasks, progress)
    gates, verdict = evaluate_gates(eval_cfg.gates, quality, tasks)
    geom = lm.geometry
    n_params = sum(p.numel() for p in lm.model.parameters())
    planner = {lm.identity.get("name", "model"): plan_pair(BASELINE, book.spec, geom, n_params, eval_cfg.planner)}
    for name, (g, n) in KNOWN.items():
        planner[name] = plan_pair(BASELINE, book.spec, g, n, eval_cfg.planner)
    return Report(
        model={**lm.identity, "geometry": geom.to_dict(), "n_params": n_params},
        kv=book.spec.model_dump(),
        eval={
            "origin": texts.origin,
            "sha256": texts.sha256,
            "n_windows": int(windows.shape[0]),
            "seq_len": int(windows.shape[1]),
            "path": "one-pass decode-equivalent attention (kvcompress.eval.attention)",
        },
        quality=Quality(**quality, key_clip_rate=errors.clip_rate(), attn_rel_error_per_layer=errors.rel_attn_error()),
        memory=memory_summary(book.spec, geom, eval_cfg.context_for_bytes),
        planner=planner,
        scalebook={"fit": book.fit_info, "k_clip_per_layer": book.tensors["k_clip"].mean(-1).tolist()},
        provenance={**base_provenance(), "scalebook": book.provenance},
        verified={
            "quality": "measured here, on the one-pass path whose equality with token-by-token decoding through "
            "CompressedCache is a CPU test (tests/test_eval_equivalence.py)",
            "memory": "reference byte accounting; equals CompressedCache.nbytes() of the real packed tensors (tests/test_cache.py)",
            "kernels": "not exercised by this report",
            "tensorrt_engine": "not built",
        },
        tasks=tasks,
        gates=gates,
        verdict=verdict,
        notes=[] if eval_cfg.gates else ["no gates configured (eval.gates): the verdict is pass by default"],
        runtime_s=time.time() - t0,
    )


def print_summary(report: Report) -> None:
    q, m = report.quality, report.memory
    lines = [
        f"verdict: {report.verdict.upper()}" + "".join(f"  [{g.name} {'ok' if g.passed else 'FAIL'}: {g.value if g.value is None else f'{g.value:.4g}'} <= {g.threshold}]" for g in report.gates),
        f"validate  kv={report.kv['name']}  tokens={q.tokens}",
        f"  ppl      fp16 {q.ppl_baseline:.4f}  compressed {q.ppl_compressed:.4f}  delta {q.ppl_delta:+.4f} ({100 * q.ppl_delta_rel:+.3f}%)",
        f"  KL mean  {q.kl_mean:.3e}  p99 {q.kl_p99:.3e}   top-1 agree {100 * q.top1_agree:.2f}%   key clip rate {q.key_clip_rate:.2e}",
        f"  memory   {m.bytes_per_token_fp16:.0f} -> {m.bytes_per_token_compressed:.1f} B/token at {m.context} tokens ({m.compression_ratio:.2f}x, {m.bits_per_element:.2f} bits/elem)",
    ]
    if report.tasks:
        t = report.tasks
        lines.append(f"  tasks    retrieval fp16 {t['retrieval_fp16']} compressed {t['retrieval_compressed']}   exact copy fp16 {t['exact_fp16']} compressed {t['exact_compressed']}")
    for line in lines:
        log.info(line)


def validate_run(run, scalebook_path: Path | None) -> dict[str, Path]:
    """Pipeline glue: load the ScaleBook of this run, validate, write report.json."""
    path = scalebook_path or run.dir / "scalebook.safetensors"
    if not Path(path).is_file():
        raise UserError("stage validate needs a scalebook: add fit to stages")
    book = run.scalebook(Path(path))
    calib_sha = book.provenance.get("stats", {}).get("calib", {}).get("sha256")
    report = validate(run.lm, book, run.cfg.eval, calib_sha, run.progress)
    out = run.dir / REPORT_FILE
    atomic_write_json(out, report.model_dump(mode="json"))
    print_summary(report)
    log.info("validate: wrote %s", out)
    stats = run.dir / "kv_stats.safetensors"
    paths = write_report_files(report, run.dir, stats if stats.is_file() else None)
    log.info("report: wrote %s", ", ".join(str(p) for p in paths))
    if report.verdict == "fail" and run.cfg.eval.fail_on_gate:
        failed = [g.name for g in report.gates if not g.passed]
        raise UserError(f"validate: gates failed: {', '.join(failed)} (eval.fail_on_gate=true); see {out}")
    return {"report": out}
