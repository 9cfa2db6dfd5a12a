"""validate: every format the run ships, against the unquantized cache, same model, same held-out tokens.

The formats are the kv format of the run (primary) and the native fallbacks that export writes
(see RunConfig.validated_specs); all are measured on the same windows against one baseline
forward. Perplexity and KL use the one-pass decode-equivalent attention (kvcompress.eval.attention);
the tasks run each format's prompts as its deployment does (kvcompress.eval.retrieval: the custom tier's engine feeds
them one token per step, decode-equivalent; TensorRT-LLM's native tier prefills them exactly, context-phase). Before
measuring, the run checks that its evaluation path with nothing compressed reproduces the
model's own forward.
"""
from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from kvcompress import reference as ref
from kvcompress.artifacts import atomic_write_json
from kvcompress.data import EVAL_IS_CALIB, load_texts, overlap_note, text_ids, token_windows
from kvcompress.errors import UserError
from kvcompress.eval.attention import ATTRIBUTION_SIDES, DECODE_EQUIVALENT, LayerErrors, check_supported, eval_call
from kvcompress.eval.gates import evaluate_gates
from kvcompress.eval.metrics import (Baseline, QualityAccumulator, blocks, by_vocabulary, kl_mean, position_block, position_bucket, score_hidden,
                                     vocab_stats)
from kvcompress.eval.retrieval import run_tasks
from kvcompress.hashing import file_fingerprint
from kvcompress.models.base import Geometry
from kvcompress.models.streaming import run_calls_hidden
from kvcompress.stages.profile import rope_pairs_of, rotary_dim
from kvcompress.planner import KNOWN, plan_pair
from kvcompress.provenance import base_provenance
from kvcompress.report_schema import ErrorAttribution, FormatResult, Memory, Quality, Report, SideQuality
from kvcompress.scalebook import ScaleBook
from kvcompress.spec import KVSpec
from kvcompress.stages.report import write_report_files

log = logging.getLogger("kvcompress")
REPORT_FILE = "report.json"
BASELINE = KVSpec(name="fp16", key={"bits": 16}, value={"bits": 16}, window=0, sink_tokens=0)
SELF_CHECK_MAX_KL = 1e-6  # float32: the eval path and the model's SDPA differ only in summation order
HEAD_CHECK_TOKENS = 256  # positions on which the evaluation's output head is compared with the model's own forward


def baseline_label(model) -> str:
    """What the reference cache really is: the model's K/V unquantized, in its own dtype."""
    return f"unquantized cache ({str(next(model.parameters()).dtype).removeprefix('torch.')})"


def _kl_by_blocks(h_base: torch.Tensor, h_other: torch.Tensor, to_logits, vocab: int) -> float:
    """kl_mean of the logits of two final hidden states [B, T, hidden], formed a block of positions at a time; with a
    streamed head that would be read again for each (metrics.by_vocabulary), a vocabulary range at a time instead
    (metrics.vocab_stats: two reads)."""
    B, T = h_base.shape[:2]
    if by_vocabulary([to_logits, to_logits], -(-T // position_block(B, vocab))):
        _, other = vocab_stats([(h_base, to_logits), (h_other, to_logits)], torch.zeros(B, T, dtype=torch.long), vocab)
        return float(other["kl"].double().mean())
    total = 0.0
    for lo, hi in blocks(T, position_block(B, vocab)):
        total += kl_mean(to_logits(h_base[:, lo:hi]), to_logits(h_other[:, lo:hi])) * (hi - lo)
    return total / T


@torch.no_grad()
def self_check(lm, ids: torch.Tensor, name: str) -> dict:
    """The evaluation path with nothing compressed must reproduce the model's own forward: the decoder with the
    evaluation attention against the decoder with the model's own attention, every position's logits formed by
    the evaluation's head a block of positions at a time (run_calls_hidden), and, in memory, that head against the
    model's own forward on the first HEAD_CHECK_TOKENS positions (the head works position by position)."""
    got = {}

    def head(pi: int, i: int, h: torch.Tensor, to_logits) -> None:
        got[pi] = h if pi == 0 else _kl_by_blocks(got.pop(0), h, to_logits, lm.geometry.vocab_size)

    run_calls_hidden(lm, [ids], [(None, {}), eval_call(None, exact=True)], head)
    kl = got[1]
    if lm.streamer is None:
        short = ids[:, :HEAD_CHECK_TOKENS].to(lm.device)
        own = lm.model(input_ids=short, use_cache=False).logits
        run_calls_hidden(lm, [short], [(None, {})], lambda pi, i, h, to_logits: got.__setitem__("head", kl_mean(own, to_logits(h))))
        kl = max(kl, got["head"])
    out = {"kl_mean": kl, "max_kl": SELF_CHECK_MAX_KL, "tokens": int(ids.numel()), "passed": kl < SELF_CHECK_MAX_KL}
    if not out["passed"]:
        raise UserError(
            f"validate: on model {name} the evaluation path with nothing compressed differs from the model's own forward "
            f"(KL {kl:.2e} > {SELF_CHECK_MAX_KL:.0e}); likely cause: an attention feature kvcompress does not simulate "
            "(custom masks, soft-capping, alibi, non-standard attention) or an output head it does not reproduce (final_logits)"
            + ("" if lm.dtype == torch.float32 else f"; or, in {str(lm.dtype).removeprefix('torch.')}, the model's own attention rounds where the "
               "evaluation's float32 attention does not (GPT-OSS's eager softmax): try model.dtype=float32 (a streamed model holds one layer "
               "at a time)")
        )
    return out


def attributed(books: dict[str, ScaleBook]) -> list[tuple[str, str]]:
    """(format, side) of the error-attribution passes (eval.attribute): each compressed format with only its
    keys, then only its values compressed (an fp16 format has nothing to attribute)."""
    return [(n, side) for n, b in books.items() if not b.spec.is_baseline for side in ATTRIBUTION_SIDES]


@torch.no_grad()
def evaluate_quality(lm, books: dict[str, ScaleBook], windows: torch.Tensor, batch_size: int, progress: bool = True, keep: bool = False,
                     attribution: dict | None = None):
    """Baseline vs each book (one-pass) over token windows [N, T]; in memory batch by batch, or
    streamed layer by layer (every pass of every batch through one layer at a time: same numbers).
    attribution: a dict to fill with {(name, side): quality dict}, each book with only its keys and with only
    its values compressed (eval.attribute: two more passes per book); None: not measured.

    Returns ({name: (quality dict, LayerErrors)}, the kept metrics.Baseline or None).
    """
    names = list(books)
    sides = attributed(books) if attribution is not None else []
    acc = {n: QualityAccumulator() for n in [*names, *sides]}
    errors = {n: LayerErrors(b.geometry["n_layers"]) for n, b in books.items()}
    V = lm.geometry.vocab_size
    batches = [windows[lo : lo + batch_size] for lo in range(0, windows.shape[0], batch_size)]
    calls = [(None, {})] + [eval_call(books[n], errors[n]) for n in names] + [eval_call(books[n], only=side) for n, side in sides]
    scored = [*names, *sides]
    hidden: dict[int, list] = {}
    kept = Baseline(windows, [], None, V, lm.streamer.head_phase if lm.streamer is not None else nullcontext) if keep else None

    def head(pi: int, i: int, h: torch.Tensor, to_logits) -> None:
        # every call's final hidden states of batch i (small), then scored a block of positions at a time: no [B, T, V]
        # tensor is ever whole (a 262K vocabulary at 8K context is 8.6 GB per window)
        hidden.setdefault(i, []).append(h)
        if pi < len(calls) - 1:
            return
        hs = hidden.pop(i)
        if scored:  # (export's baseline alone: nothing to score)
            score_hidden(hs[0], to_logits, [(acc[n], hc, to_logits) for n, hc in zip(scored, hs[1:])], batches[i], V)
        if kept is not None:
            kept.hidden.append(hs[0].cpu())
            if kept.head is None:  # a streamed head moves its input itself and can be scored a vocabulary range at a time
                kept.head = to_logits if callable(getattr(to_logits, "rows", None)) else lambda x, f=to_logits, d=hs[0].device: f(x.to(d))

    run_calls_hidden(lm, batches, calls, head, progress)
    if attribution is not None:
        attribution.update({k: acc[k].result() for k in sides})
    return {n: (acc[n].result(), errors[n]) for n in names}, kept


def memory_summary(spec: KVSpec, geom: Geometry, context: int) -> Memory:
    """Bytes per token of the fp16 and the compressed cache at `context` (reference accounting)."""
    fp16 = sum(ref.spec_cache_nbytes(BASELINE, geom, context).values()) / context
    b = ref.spec_cache_nbytes(spec, geom, context)
    static = b.pop("static", 0)
    per_tok = {k: v / context for k, v in b.items()}
    comp = sum(per_tok.values())
    elems = fp16 / ref.HP_BYTES  # K and V elements the cache holds per token (sliding layers: their window)
    return Memory(
        context=context,
        bytes_per_token_fp16=fp16,
        bytes_per_token_compressed=comp,
        compression_ratio=fp16 / comp,
        breakdown_per_token=per_tok,
        static_bytes=static,
        bits_per_element=comp * 8 / elems,
    )


def attribution_of(name: str, attribution: dict | None) -> ErrorAttribution | None:
    """The ErrorAttribution of one format from evaluate_quality's attribution passes (None: not measured)."""
    if not attribution or (name, ATTRIBUTION_SIDES[0]) not in attribution:
        return None
    pick = lambda q: SideQuality(**{k: q[k] for k in SideQuality.model_fields})  # noqa: E731
    return ErrorAttribution(**{f"{side}_only": pick(attribution[(name, side)]) for side in ATTRIBUTION_SIDES})


def format_result(name: str, role: str, book: ScaleBook, quality: dict, errors: LayerErrors, tasks, eval_cfg, geom,
                  attribution: ErrorAttribution | None = None) -> FormatResult:
    clip = errors.clip_rate_by_bucket()
    quality = {**quality, "by_position": [{**b, "key_clip_rate": clip.get(i)} for i, b in
                                          ((position_bucket(torch.tensor(b["start"])).item(), b) for b in quality.get("by_position", []))]}
    q = Quality(semantics=DECODE_EQUIVALENT, **quality, key_clip_rate=errors.clip_rate(), value_clip_rate=errors.value_clip_rate(),
                attn_rel_error_per_layer=errors.rel_attn_error())
    gates, verdict, basis = evaluate_gates(eval_cfg.gates, quality, tasks)
    return FormatResult(name=name, tier=book.spec.tier, role=role, kv=book.spec.model_dump(), quality=q,
                        memory=memory_summary(book.spec, geom, eval_cfg.context_for_bytes), tasks=tasks, gates=gates,
                        verdict=verdict, verdict_basis=basis, fit=book.fit_info, attribution=attribution)


def few_compressed_positions(spec, seq_len: int) -> str | None:
    """A note when fewer than half of a window's scored positions read a compressed entry (the first sinks + window attend
    to fp16 K/V only; RunConfig refuses windows where none does): the format's numbers then mostly measure the fp16 part."""
    reach = spec.fp16_positions
    n = max(seq_len - 1 - reach, 0)  # position p predicts token p + 1 and reads a compressed entry from p = reach on
    if spec.is_baseline or spec.is_native or 2 * n >= seq_len - 1:
        return None
    return (f"{spec.name}: {n} of the {seq_len - 1} scored positions of each window read a compressed entry (the first "
            f"{reach} attend to its {spec.sink_tokens} sinks and {spec.window}-token window in fp16): raise eval.seq_len for a verdict on the compressed store")


def validate(lm, books: dict[str, ScaleBook], eval_cfg, calib_sha: str | None = None, progress: bool = True, keep_baseline: bool = False):
    """books: {role: ScaleBook}, role "primary" first. Returns (Report, the kept metrics.Baseline or None)."""
    t0 = time.time()
    name = lm.identity.get("name", "model")
    check_supported(lm.model, name)
    texts = load_texts(eval_cfg, "eval")
    if calib_sha is not None and texts.sha256 == calib_sha:
        raise UserError(EVAL_IS_CALIB)
    corpus = text_ids(lm.tokenizer, texts)  # tokens of held-out text the windows (and the tasks' haystacks) are cut from
    windows = token_windows(lm.tokenizer, texts, eval_cfg.n_windows, eval_cfg.seq_len, seed=eval_cfg.seed, ids=corpus)
    check = self_check(lm, windows[:1], name)
    by_name = {b.spec.name: b for b in books.values()}
    attribution = {} if eval_cfg.attribute else None
    measured, kept = evaluate_quality(lm, by_name, windows, eval_cfg.batch_size, progress, keep_baseline, attribution)
    tasks = {}
    notes = [] if eval_cfg.gates else ["no gates configured (eval.gates): the verdict is pass by default"]
    pairs, rot, D = rope_pairs_of(lm.model, lm.geometry), rotary_dim(lm.model, lm.geometry), lm.geometry.head_dim
    if not ref.is_half_split(pairs):  # partial or interleaved rotary: the pair logic follows the model's own pairs (profile.rope_pairs_of)
        step = int(pairs[1, 0] - pairs[0, 0])
        layout = ("(2i, 2i + 1), interleaved" if step == 1 else f"(i, i + {step})") + (f", over {rot} of {D} channels" if rot < D else "")
        notes.append(f"RoPE pairs of this model are {layout}: key scales are tied over them"
                     + (", the pass-through channels in pairs of their own" if rot < D else "") + "; native formats choose no pair rotation (kv.fold_pairs)")
        log.info(notes[-1])
    knorm = next((b.fit_info.get("key_norm") for b in books.values() if b.spec.is_native and b.fit_info.get("key_norm")), None)
    if knorm:  # Qwen3, Gemma 3: where the native key fold lives (profile.key_norm)
        notes.append(f"native formats: key_norm={knorm}")
    n_text = len(corpus)
    if (overlap := overlap_note(n_text, int(windows.shape[0]), int(windows.shape[1]), "eval")):
        notes.append(overlap)
        log.warning("validate: %s", overlap)
    for b in books.values():
        if (few := few_compressed_positions(b.spec, int(windows.shape[1]))):
            notes.append(few)
            log.warning("validate: %s", few)
    if eval_cfg.tasks.names and lm.streamer is not None and eval_cfg.tasks.greedy:
        notes.append("greedy cross-check not run: the model is streamed layer by layer (generation decodes token by token); tasks are scored through the same executor")
    if eval_cfg.tasks.names:
        window = max(b.spec.window for b in books.values())  # facts before every format's fp16 window
        tasks = run_tasks(lm, by_name, corpus, eval_cfg.tasks, window, progress)
    geom = lm.geometry
    results = {role: format_result(b.spec.name, role, b, *measured[b.spec.name], tasks.get(b.spec.name), eval_cfg, geom,
                                   attribution_of(b.spec.name, attribution)) for role, b in books.items()}
    primary = results.pop("primary")
    n_params = sum(p.numel() for p in lm.model.parameters())
    planner = {name: plan_pair(BASELINE, books["primary"].spec, geom, n_params, eval_cfg.planner)}
    if books["primary"].spec.is_mixed:  # per-layer formats were tuned for this model's layers only
        notes.append("planner: other models (llama3.1-8b/70b) left out: the per-layer formats were tuned for this model's layers")
    else:
        for known, (g, n) in KNOWN.items():
            planner[known] = plan_pair(BASELINE, books["primary"].spec, g, n, eval_cfg.planner)
    pbook = books["primary"]
    unmeasured = [g.name for g in primary.gates if g.status == "not measured"]
    if unmeasured:
        notes.append(f"gates not measured (not part of the verdict): {', '.join(unmeasured)}")
    report = Report(
        model={**lm.identity, "architecture": geom.architecture, "geometry": geom.to_dict(), "n_params": n_params,
               "dtype": str(next(lm.model.parameters()).dtype).removeprefix("torch."), "baseline": baseline_label(lm.model)},
        kv=pbook.spec.model_dump(),
        eval={
            "origin": texts.origin,
            "sha256": texts.sha256,
            "n_windows": int(windows.shape[0]),
            "seq_len": int(windows.shape[1]),
            "text_tokens": n_text,
            "path": "one-pass decode-equivalent attention (kvcompress.eval.attention)",
            "semantics": {"perplexity_kl_top1": DECODE_EQUIVALENT, "tasks": tasks and {name: t["semantics"] for name, t in tasks.items()}},
        },
        quality=primary.quality,
        memory=primary.memory,
        planner=planner,
        scalebook={"fit": pbook.fit_info, "k_clip_per_layer": pbook.tensors["k_clip"].mean(-1).tolist()},
        provenance={**base_provenance(), "scalebook": pbook.provenance},
        verified={
            "self_check": f"evaluation path with nothing compressed vs the model's own forward: KL {check['kl_mean']:.2e} on {check['tokens']} tokens (must be < {SELF_CHECK_MAX_KL:.0e})",
            "quality": "measured here, on the one-pass decode-equivalent path whose equality with token-by-token decoding "
            "through CompressedCache is a CPU test (tests/test_eval_equivalence.py)",
            "tasks": "measured here, each format's prompts run as its deployment runs them (custom tier: one token per step, "
            "decode-equivalent; native tier: exact context phase); greedy generation through the real CompressedCache, the prompt fed "
            "the same way, cross-checks a sample per task (decode-equivalent prompts: the shortest needle and copy samples)"
            if tasks else "not run (eval.tasks.names is empty)",
            "memory": "reference byte accounting; equals CompressedCache.nbytes() of the real packed tensors (tests/test_cache.py)",
            "native formats": "simulated exactly as TensorRT-LLM quantizes (one scale per layer, K and V); the exported checkpoint is re-measured by export",
            "kernels": "not exercised by this report",
            "tensorrt_engine": "not built here",
        },
        tasks=primary.tasks,
        gates=primary.gates,
        verdict=primary.verdict,
        verdict_basis=primary.verdict_basis,
        fallbacks=list(results.values()),
        attribution=primary.attribution,
        self_check=check,
        notes=notes,
        runtime_s=time.time() - t0,
    )
    return report, kept


def print_summary(report: Report) -> None:
    for fr in [report_primary(report), *report.fallbacks]:
        q, m = fr.quality, fr.memory
        gates = "".join(f"  [{g.name} {g.status}: {'n/a' if g.value is None else f'{g.value:.4g}'} <= {g.threshold}]" for g in fr.gates)
        log.info(f"{fr.tier} tier {fr.name} ({fr.role}): verdict {fr.verdict.upper()}{gates}")
        log.info(f"  ppl {q.ppl_baseline:.4f} -> {q.ppl_compressed:.4f} ({100 * q.ppl_delta_rel:+.3f}%)  KL mean {q.kl_mean:.3e}  top-1 {100 * q.top1_agree:.2f}%  "
                 f"clip K {q.key_clip_rate:.1e} V {q.value_clip_rate:.1e}  {m.bits_per_element:.2f} bits/elem at {m.context} tokens ({m.compression_ratio:.2f}x)")
        if fr.attribution is not None:
            a = fr.attribution
            log.info(f"  error attribution: KL with only the keys compressed {a.keys_only.kl_mean:.3e}, only the values {a.values_only.kl_mean:.3e}")


def report_primary(report: Report) -> FormatResult:
    """The primary format's result (its fields live at the top level of the report)."""
    return FormatResult(name=report.kv["name"], tier=KVSpec.model_validate(report.kv).tier, role="primary", kv=report.kv, quality=report.quality,
                        memory=report.memory, tasks=report.tasks, gates=report.gates, verdict=report.verdict, verdict_basis=report.verdict_basis,
                        attribution=report.attribution)


def validate_run(run, books: dict[str, Path]) -> dict[str, Path]:
    """Pipeline glue: load this run's ScaleBooks, validate all, write report.json + report files."""
    for p in books.values():
        if not Path(p).is_file():
            raise UserError("stage validate needs the run's scalebooks: add fit to stages")
    hashes = {role: file_fingerprint(p) for role, p in books.items()}  # what export checks it ships (stages.export.check_validated)
    loaded = {role: run.scalebook(Path(p)) for role, p in books.items()}
    calib_sha = loaded["primary"].profiled("calib").get("sha256")
    report, kept = validate(run.lm, loaded, run.cfg.eval, calib_sha, run.progress, keep_baseline="export" in run.cfg.stages)
    report.validated_books = {role: {"file": Path(p).name, "sha256": hashes[role], "kv": loaded[role].spec.name} for role, p in books.items()}
    tune_file = run.dir / "tune.json"
    if loaded["primary"].spec.is_mixed and tune_file.is_file():
        import json

        report.tune = json.loads(tune_file.read_text())
        report.tune["held_out_verdict"] = report.verdict
    run.baseline = kept
    out = run.dir / REPORT_FILE
    atomic_write_json(out, report.model_dump(mode="json"))
    print_summary(report)
    log.info("validate: wrote %s", out)
    stats = run.dir / "kv_stats.safetensors"
    paths = write_report_files(report, run.dir, stats if stats.is_file() else None)
    log.info("report: wrote %s", ", ".join(str(p) for p in paths))
    if report.verdict != "pass" and run.cfg.eval.fail_on_gate:
        bad = [g.name for g in report.gates if g.status in ("fail", "inconclusive")]
        raise UserError(f"validate: gates failed or inconclusive: {', '.join(bad)} (eval.fail_on_gate=true; nothing exported); see {out}")
    return {"report": out}
