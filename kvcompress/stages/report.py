"""report: report.md and a self-contained report.html (inline SVG, no scripts, opens offline).

Rendered from report.json (+ kv_stats for the key-channel heatmap). Verdict first, then the
quality table, plots, memory, and the config and provenance.
"""
from __future__ import annotations

import html
import json
import math
from pathlib import Path

from kvcompress.artifacts import atomic_write_bytes
from kvcompress.report_schema import Report


SOURCE_NOTES = ("source_nvfp4_weights", "source_int_weights")  # a native checkpoint's notes on how it holds the source's weights


def export_notes(export: dict) -> list[tuple[str, str, bool]]:
    """The export's lines of report.md and report.html, as (head, text, loud): each artifact, how its weights were written
    (and the source's quantized weights: kept or dequantized, with the caveat where its server quantizes activations), FP8 KV
    scales its server would not read or that the fold absorbed, sides not folded, what was not written, the text decoder
    alone, and what each GPU must hold. Loud lines say that a server would run something validate did not measure."""
    arts = export["artifacts"].items()
    out = [(f"{k} ({v['tier']} tier, from validated {v['validated_as']}, verdict {v['verdict'].upper()})", v["what"], False) for k, v in arts]
    out += [(f"{k} weights", v["weights"], False) for k, v in arts if v.get("fp8_weights_kept") or v.get("fp8_dequantized_why")]
    out += [(f"{k} source weights", v[n], False) for k, v in arts for n in SOURCE_NOTES if v.get(n)]
    out += [(f"{k} activations", v["served_otherwise"], True) for k, v in arts if v.get("served_otherwise")]
    out += [(f"{k} FP8 KV scales", v["kv_scales_unread"], True) for k, v in arts if v.get("kv_scales_unread")]
    out += [(f"{k} FP8 KV scales", v["kv_scale_absorbed"], False) for k, v in arts if v.get("kv_scale_absorbed")]
    out += [(k, f"{side} not folded ({why})", False) for k, v in arts for side in ("keys", "values") if (why := (v.get("fold") or {}).get(f"fold_{side}_off"))]
    out += [(k, f"not written ({why})", False) for k, why in export.get("not_written", {}).items()]
    out += [("text decoder only", export["text_decoder_only"], False)] if export.get("text_decoder_only") else []
    return out + [(head, text, False) for head, _, text in (line.partition(": ") for line in gpu_memory_lines(export))]


def gpu_memory_lines(export: dict) -> list[str]:
    """What each GPU must hold, from the export's manifest: the TensorRT-LLM checkpoint's weights per GPU at each tp size
    (with the advice when the largest exceeds export.gpu_memory_gb) and the custom-tier engine's memory on each of its GPUs."""
    from kvcompress.targets.trtllm_network import memory_line, size

    arts, out = export.get("artifacts", {}), []
    trt = arts.get("trtllm_ckpt") or {}
    if trt.get("weights_per_gpu_bytes"):
        out.append("trtllm_ckpt weights per GPU: " + ", ".join(f"{k} {size(v)}" for k, v in trt["weights_per_gpu_bytes"].items())
                   + (f" ({trt['tp_advice']})" if trt.get("tp_advice") else ""))
    mem = ((arts.get("plugin_bundle") or {}).get("network") or {}).get("engine_memory")
    if mem:
        out.append(f"custom-tier engine: {memory_line(mem)}" + ("" if mem["fits"] else f", more than export.gpu_memory_gb={mem['gpu_memory_gb']:g}"))
    return out


def _fmt(v, digits=4) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def _ci(c) -> str:
    return "" if not c else f" [{c[0]:.2f}, {c[1]:.2f}]"


def _role_label(f) -> str:
    if f.role.startswith("compare:"):
        return f"Compared (eval.compare, not shipped) {f.tier} tier {f.name}"
    return f"Native fallback {f.name} ({f.role}_ckpt)"


def _k(n: int) -> str:
    return f"{n // 1024}K" if n and n % 1024 == 0 else str(n)


def _results(r: Report):
    from kvcompress.stages.validate import report_primary

    return [report_primary(r), *r.fallbacks]


PROMPT_LABEL = {"context": "prefilled exactly (context phase)", "decode": "one token per step over the compressed cache (decode-equivalent)"}


def tasks_semantics(r: Report) -> str:
    """The task semantics line: the answer is always decoded over the compressed cache; the prompt runs as each
    format's deployment runs it (eval.tasks.prompt), listed per format when they differ."""
    fr = [f for f in _results(r) if f.tasks]
    if not fr:
        return "not run"
    sem = {f.tasks.get("semantics") for f in fr}
    if len(sem) == 1:
        return sem.pop()
    return ("the answer is decoded over the compressed cache; the prompt as each format's deployment runs it (row 'task prompt'): "
            + "; ".join(f"{f.name} {PROMPT_LABEL.get(f.tasks.get('prompt', 'context'), '?')}" for f in fr))


def quality_rows(r: Report) -> tuple[list[str], list[tuple[str, ...]]]:
    """Header and rows of the side-by-side table: baseline, then every validated format."""
    fr = _results(r)
    head = ["metric", r.model.get("baseline", "unquantized cache")] + [f"{f.tier} tier: {f.name} ({f.role})" for f in fr]
    q0 = fr[0].quality
    rows = [
        ("verdict (gates it rests on)", "", *[f"{f.verdict.upper()} ({', '.join(f.verdict_basis) or 'no gates'})" for f in fr]),
        ("perplexity", _fmt(q0.ppl_baseline), *[_fmt(f.quality.ppl_compressed) for f in fr]),
        ("perplexity delta (relative)", "", *[f"{100 * f.quality.ppl_delta_rel:+.3f}%" for f in fr]),
        ("KL mean / p99 (nats)", "", *[f"{f.quality.kl_mean:.3e} / {f.quality.kl_p99:.3e}" for f in fr]),
        ("top-1 agreement", "", *[f"{100 * f.quality.top1_agree:.2f}%" for f in fr]),
        ("key / value clipping (saturation) rate", "", *[f"{f.quality.key_clip_rate:.2e} / {f.quality.value_clip_rate:.2e}" for f in fr]),
        ("bits per element (all metadata)", "16", *[f"{f.memory.bits_per_element:.2f}" for f in fr]),
    ]
    if any(f.attribution for f in fr):  # eval.attribute: each side of the cache compressed alone
        for side, label in (("keys_only", "only the keys compressed"), ("values_only", "only the values compressed")):
            rows.append((f"{label}: KL mean, ppl delta, top-1", "",
                         *["n/a" if f.attribution is None else
                           f"KL {getattr(f.attribution, side).kl_mean:.2e}, ppl {100 * getattr(f.attribution, side).ppl_delta_rel:+.3f}%, "
                           f"top-1 {100 * getattr(f.attribution, side).top1_agree:.2f}%" for f in fr]))
    for i, b in enumerate(q0.by_position):  # the same buckets for every format (same windows)
        cells = []
        for f in fr:
            x = f.quality.by_position[i] if i < len(f.quality.by_position) else None
            cells.append("n/a" if x is None else f"KL {x.kl_mean:.2e}, ppl {100 * x.ppl_delta_rel:+.3f}%, K clip "
                         + ("n/a" if x.key_clip_rate is None else f"{x.key_clip_rate:.1e}"))
        rows.append((f"positions {_k(b.start)}-{_k(b.end)} (n={b.tokens}): KL, ppl delta, key clip", f"ppl {_fmt(b.ppl_baseline)}", *cells))
    if fr[0].tasks:
        for key, label in (("retrieval", "retrieval exact"), ("exact_copy", "exact copy")):
            g0 = fr[0].tasks.get(key)
            if not g0:
                continue
            rows.append((f"{label} (n={g0['n']}, 95% CI)", f"{g0['fp16']:.2f}{_ci(g0['fp16_ci'])}",
                         *[f"{f.tasks[key]['compressed']:.2f}{_ci(f.tasks[key]['compressed_ci'])}; drop {f.tasks[key]['drop']['drop']:+.3f} "
                           f"[{f.tasks[key]['drop']['ci_low']:+.3f}, {f.tasks[key]['drop']['ci_high']:+.3f}]" for f in fr]))
            split = g0.get("by_length") or []  # eval.tasks.lengths
            for i, b in enumerate(split if len(split) > 1 else []):
                rows.append((f"  {label} at {b['length']} tokens (n={b['n']})", f"{b['fp16']:.2f}",
                             *[f"{f.tasks[key]['by_length'][i]['compressed']:.2f}" for f in fr]))
        for name, t0 in fr[0].tasks["tasks"].items():
            rows.append((f"  {name} exact (n={t0['n']})", f"{t0['exact_fp16']:.2f}{_ci(t0['exact_fp16_ci'])}",
                         *[f"{f.tasks['tasks'][name]['exact_compressed']:.2f}{_ci(f.tasks['tasks'][name]['exact_compressed_ci'])}" for f in fr]))
        rows.append(("task prompt", "exact", *[PROMPT_LABEL.get(f.tasks.get("prompt", "context"), "?") for f in fr]))
        rows.append(("greedy through CompressedCache agrees with scoring", "",
                     *[(f"{f.tasks['greedy_check']['agree']}/{f.tasks['greedy_check']['checked']}" if f.tasks.get("greedy_check") else "n/a (native cache simulated, or a streamed run)") for f in fr]))
    return head, rows


def gate_rows(r: Report) -> list[tuple[str, ...]]:
    out = []
    for f in _results(r):
        for g in f.gates:
            ci = "" if g.ci_low is None else f" [{g.ci_low:+.3f}, {g.ci_high:+.3f}] (n={g.n}, paired)"
            out.append((f.name, g.name, str(g.threshold), f"{_fmt(g.value)}{ci}", g.status))
    return out


def render_md(r: Report) -> str:
    m = r.memory
    title = f"{r.model.get('architecture')} ({r.model.get('name')}: {r.model.get('path') or r.model.get('file') or r.model.get('source')})"
    out = [f"# kvcompress report: {title} / {r.kv['name']}", "", f"**Verdict ({r.kv['name']}): {r.verdict.upper()}**", ""]
    for f in r.fallbacks:
        out.append(f"**{_role_label(f)}: {f.verdict.upper()}**  ")
    out += ["", "| format | gate | threshold | value | status |", "|---|---|---|---|---|"]
    out += [f"| {' | '.join(row)} |" for row in gate_rows(r)]
    out += [f"- {n}" for n in r.notes]
    head, rows = quality_rows(r)
    out += ["", "## Quality: every validated format on the same held-out tokens", "",
            f"Perplexity, KL and top-1: {r.quality.semantics}. Tasks: {tasks_semantics(r)}.", "",
            "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    out += ["", "## Memory", "", f"- bytes per token at {m.context} tokens: fp16 cache {m.bytes_per_token_fp16:.0f}, compressed {m.bytes_per_token_compressed:.1f} ({m.compression_ratio:.2f}x, {m.bits_per_element:.2f} bits/element)"]
    out += [f"- {k}: {v:.2f} B/token" for k, v in m.breakdown_per_token.model_dump().items() if v]
    for name, p in r.planner.items():
        for row in p["rows"]:
            out.append(f"- {name} on one {p['gpu']} at {row['context']} tokens: {row['fp16']['max_concurrent_seqs']} -> {row['compressed']['max_concurrent_seqs']} sequences (x{_fmt(row['capacity_multiplier'], 3)})")
    out += tune_md(r.tune)
    out += ["", "## What was verified", ""] + [f"- **{k}**: {v}" for k, v in r.verified.items()]
    if r.export:
        out += ["", "## Export", "", f"- TensorRT engine built: **{r.export['engine_built']}** ({r.export['engine_reason']})",
                *([f"- custom tier ({r.kv['name']}) on a GPU host: `{r.export['next_step_custom_tier_on_gpu_host']}`"]
                  if r.export.get("next_step_custom_tier_on_gpu_host") else []),
                f"- next step on a GPU host: `{r.export['next_step_on_gpu_host']}`", f"- operator fallback: `{r.export['fallback_fp16_kv']}`"]
        out += [f"- serve-path check on a GPU host: `{r.export['check_on_gpu_host']}`"] if r.export.get("check_on_gpu_host") else []
        out += [f"- **{head}**: {text}" if loud else f"- {head}: {text}" for head, text, loud in export_notes(r.export)]
        out += ["", "| check that ran in this export | status |", "|---|---|"] + [f"| {c['check']} | {c['status']} |" for c in r.export["checks"]]
    if r.stage_times_s:
        out += ["", "## Stage times", "", ", ".join(f"{k} {v:.0f} s" for k, v in r.stage_times_s.items()) + f" (total {sum(r.stage_times_s.values()):.0f} s)"]
    out += ["", "## Config and provenance", "", "```json", json.dumps({"kv": r.kv, "eval": r.eval, "model": r.model, "provenance": r.provenance}, indent=1, default=str)[:6000], "```", ""]
    return "\n".join(out)


# ---------------------------------------------------------------- SVG plots
def _svg(w: int, h: int, body: str, title: str) -> str:
    return f'<figure><figcaption>{html.escape(title)}</figcaption><svg width="{w}" height="{h}" viewBox="0 0 {w} {h}">{body}</svg></figure>'


def heatmap(values: list[list[float]], title: str, width: int = 1000) -> str:
    """rows x cols matrix -> SVG heatmap, colour by value / row max (outlier channels stand out)."""
    if not values:
        return ""
    cw = max(1.0, width / len(values[0]))
    ch = max(4, 240 // len(values))
    body = []
    for i, row in enumerate(values):
        mx = max(row) or 1.0
        for j, v in enumerate(row):
            c = int(255 * (1 - min(1.0, v / mx)))
            body.append(f'<rect x="{j * cw:.1f}" y="{i * ch}" width="{cw:.1f}" height="{ch}" fill="rgb(255,{c},{c})"/>')
    return _svg(int(len(values[0]) * cw), len(values) * ch, "".join(body), title)


def bars(labels: list[str], series: dict[str, list[float]], title: str, xlabel: str, ylabel: str, w: int = 640, h: int = 200) -> str:
    """Grouped bars with a labelled y axis (0 and max ticks) and x axis; legend above the plot area."""
    colors = ["#4878a8", "#d9822b", "#6a9955", "#a05195"]
    n = len(labels)
    vmax = max((v for s in series.values() for v in s if v is not None), default=1.0) or 1.0
    top, left, bottom = 14 + 12 * len(series), 60, 34
    h = h + top
    bw = (w - left - 10) / max(1, n) / (len(series) + 0.5)
    body = [f'<line x1="{left}" y1="{h - bottom}" x2="{w}" y2="{h - bottom}" stroke="#888"/>', f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="#888"/>',
            f'<text x="{left - 4}" y="{top + 8}" font-size="9" text-anchor="end">{_fmt(vmax, 3)}</text>', f'<text x="{left - 4}" y="{h - bottom}" font-size="9" text-anchor="end">0</text>',
            f'<text x="10" y="{(top + h - bottom) / 2:.0f}" font-size="10" transform="rotate(-90 10 {(top + h - bottom) / 2:.0f})" text-anchor="middle">{html.escape(ylabel)}</text>',
            f'<text x="{(left + w) / 2:.0f}" y="{h - 2}" font-size="10" text-anchor="middle">{html.escape(xlabel)}</text>']
    for k, (name, vals) in enumerate(series.items()):
        for i, v in enumerate(vals):
            if v is None:
                continue
            bh = (h - bottom - top) * v / vmax
            x = left + i * bw * (len(series) + 0.5) + k * bw
            body.append(f'<rect x="{x:.1f}" y="{h - bottom - bh:.1f}" width="{bw:.1f}" height="{bh:.1f}" fill="{colors[k % 4]}"><title>{html.escape(labels[i])} {name}: {_fmt(v)}</title></rect>')
        body.append(f'<text x="{left + 4}" y="{12 + 12 * k}" font-size="10" fill="{colors[k % 4]}">&#9632; {html.escape(name)}</text>')
    step = max(1, n // 12)
    for i in range(0, n, step):
        body.append(f'<text x="{left + i * bw * (len(series) + 0.5):.1f}" y="{h - bottom + 12}" font-size="9">{html.escape(labels[i])}</text>')
    return _svg(w, h, "".join(body), title)


def _tune_rows(t: dict, top: int = 12) -> list[tuple[str, ...]]:
    pts = sorted(t["points"], key=lambda p: p["bytes_per_token"])
    passing = [p for p in pts if p.get("passes")]
    keep = {p["name"] for p in passing[:top // 2]} | {p["name"] for p in pts if p["kind"] == "uniform" or p.get("chosen")}
    keep |= {p["name"] for p in pts[: top - len(keep)]} if len(keep) < top else set()
    rows = []
    for p in pts:
        if p["name"] not in keep:
            continue
        m, pr = p.get("measured", {}), p.get("predicted")
        mix = ", ".join(f"{n}x {f}" for f, n in sorted(((f, p["layers"].count(f)) for f in set(p["layers"])), key=lambda x: -x[1]))
        rows.append((("(chosen) " if p.get("chosen") else "") + p["name"], p["kind"], f"{p['bytes_per_token']:.1f}", f"{p['bits_per_element']:.2f}",
                     "n/a" if pr is None else f"{pr['kl_mean']:.2e}", f"{m.get('kl_mean', float('nan')):.2e}", f"{100 * m.get('ppl_delta_rel', float('nan')):+.3f}%",
                     "PASS" if p.get("passes") else "fail", f"w{p['window']} s{p['sink_tokens']}: {mix}"))
    return rows


TUNE_HEAD = ("candidate", "kind", "bytes/token", "bits/element", "predicted KL", "measured KL", "ppl delta", "gates x margin", "window, sinks: layer formats")


def tune_md(t: dict | None) -> list[str]:
    if not t:
        return []
    c = t["chosen"]
    out = ["", f"## Tuning (kv.layers={t.get('mode', 'auto')})", "", *([t["objective"], ""] if t.get("objective") else []),
           f"Chosen: **{c['name']}**, {c['bytes_per_token']:.1f} bytes/token at {t['context']} tokens ({c['vs_int8k_int4v']:.3f} x int8k_int4v), "
           f"window {c['window']}, sinks {c['sink_tokens']}; on the held-out windows: **{t.get('held_out_verdict', 'not validated').upper()}** (the verdict above).",
           f"Searched on {t['tuning_text']['n_windows']} x {t['tuning_text']['seq_len']} tokens of {t['tuning_text']['origin']} (not the held-out text) "
           f"against {', '.join(f'{k} <= {v:.3g}' for k, v in t['limits'].items()) or 'no gate'} (gates x margin {t['margin']}); "
           f"not searched against (validate measures them): {', '.join(t['gates_not_tuned']) or 'none'}. Native fallback: {t['native_fallback']}.",
           "", "Per-layer formats: " + " ".join(f"{i}:{f}" for i, f in enumerate(c["layers"])), "",
           "| " + " | ".join(TUNE_HEAD) + " |", "|" + "---|" * len(TUNE_HEAD)]
    out += ["| " + " | ".join(row) + " |" for row in _tune_rows(t)]
    out += ["", f"Tune times: {', '.join(f'{k} {v:.0f} s' for k, v in t['times_s'].items())}."]
    return out


def pareto(points: list[dict], limit: float | None, gate: float | None, title: str, w: int = 640, h: int = 300) -> str:
    """Bytes per token (x) vs measured KL (y, log scale); the gate line(s); the chosen point ringed."""
    pts = [p for p in points if p.get("measured")]
    if not pts:
        return ""
    xs = [p["bytes_per_token"] for p in pts]
    ys = [max(p["measured"]["kl_mean"], 1e-9) for p in pts]
    lines = [v for v in (limit, gate) if v]
    lo, hi = math.log10(min(ys + lines)) - 0.2, math.log10(max(ys + lines)) + 0.2
    x0, x1 = min(xs) * 0.95, max(xs) * 1.05
    left, right, top, bottom = 64, 34, 10, 36

    def X(v):
        return left + (w - left - right) * (v - x0) / max(x1 - x0, 1e-9)

    def Y(v):
        return top + (h - top - bottom) * (hi - math.log10(max(v, 1e-12))) / max(hi - lo, 1e-9)

    color = {"uniform": "#4878a8", "searched": "#d9822b", "window/sinks": "#6a9955"}
    body = [f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" stroke="#888"/>', f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="#888"/>',
            f'<text x="{(left + w) / 2:.0f}" y="{h - 4}" font-size="10" text-anchor="middle">cache bytes per token (all layers, window and sinks amortised)</text>',
            f'<text x="12" y="{h / 2:.0f}" font-size="10" transform="rotate(-90 12 {h / 2:.0f})" text-anchor="middle">KL mean (nats, log scale)</text>']
    for e in range(math.ceil(lo), math.floor(hi) + 1):
        body.append(f'<text x="{left - 4}" y="{Y(10 ** e) + 3:.1f}" font-size="9" text-anchor="end">1e{e}</text>')
    for v in (x0, (x0 + x1) / 2, x1):
        body.append(f'<text x="{X(v):.1f}" y="{h - bottom + 12}" font-size="9" text-anchor="middle">{v:.0f}</text>')
    for v, name, dash in ((limit, "tuning limit (gate x margin)", "4,3"), (gate, "release gate", "")):
        if v:
            body.append(f'<line x1="{left}" y1="{Y(v):.1f}" x2="{w - right}" y2="{Y(v):.1f}" stroke="#cf222e" stroke-dasharray="{dash}"/>'
                        f'<text x="{w - right - 4}" y="{Y(v) - 3:.1f}" font-size="9" fill="#cf222e" text-anchor="end">{name} {v:.2g}</text>')
    for p, x, y in zip(pts, xs, ys):
        c = color.get(p["kind"], "#888")
        tip = html.escape(f"{p['name']}: {x:.1f} B/token, KL {y:.2e}, {'passes' if p.get('passes') else 'fails'}")
        body.append(f'<circle cx="{X(x):.1f}" cy="{Y(y):.1f}" r="4" fill="{c}" fill-opacity="{0.9 if p.get("passes") else 0.35}"><title>{tip}</title></circle>')
        if p.get("chosen"):
            body.append(f'<circle cx="{X(x):.1f}" cy="{Y(y):.1f}" r="8" fill="none" stroke="#000" stroke-width="2"/>'
                        f'<text x="{X(x) + 10:.1f}" y="{Y(y) - 6:.1f}" font-size="10">chosen</text>')
        if p["kind"] == "uniform":
            body.append(f'<text x="{X(x) + 6:.1f}" y="{Y(y) + 12:.1f}" font-size="9">{html.escape(p["name"].removeprefix("uniform:"))}</text>')
    for k, (kind, c) in enumerate(color.items()):
        body.append(f'<text x="{left + 8 + 130 * k}" y="{top + 10}" font-size="10" fill="{c}">&#9679; {kind}</text>')
    return _svg(w, h, "".join(body), title)


def format_map(t: dict, w: int = 1000) -> str:
    """The chosen per-layer formats (one row) over the per-layer sensitivities (a row per menu
    format, colour by log KL when only that layer is compressed)."""
    sens, chosen = t["sensitivity"], t["chosen"]["layers"]
    L = len(chosen)
    palette = ["#eeeeee", "#4878a8", "#d9822b", "#6a9955", "#a05195", "#c9b037", "#888888"]
    fmts = t["menu"]
    col = {f: palette[i % len(palette)] for i, f in enumerate(fmts)}
    cw, ch, left = max(6.0, (w - 110) / L), 16, 110
    body = [f'<text x="{left - 4}" y="{ch - 4}" font-size="9" text-anchor="end">chosen</text>']
    for i, f in enumerate(chosen):
        body.append(f'<rect x="{left + i * cw:.1f}" y="0" width="{cw - 1:.1f}" height="{ch}" fill="{col.get(f, "#000")}"><title>layer {i}: {html.escape(f)}</title></rect>')
    vals = [v["kl_mean"] for rows in sens.values() for v in rows if v["kl_mean"] > 0]
    lo, hi = (math.log10(min(vals)), math.log10(max(vals))) if vals else (0.0, 1.0)
    for r, (f, rows) in enumerate(sens.items(), start=1):
        y = r * (ch + 2) + 6
        body.append(f'<text x="{left - 4}" y="{y + ch - 4}" font-size="9" text-anchor="end">{html.escape(f)} KL</text>')
        for i, v in enumerate(rows):
            a = 0.0 if v["kl_mean"] <= 0 else (math.log10(v["kl_mean"]) - lo) / max(hi - lo, 1e-9)
            c = int(255 * (1 - a))
            body.append(f'<rect x="{left + i * cw:.1f}" y="{y}" width="{cw - 1:.1f}" height="{ch}" fill="rgb(255,{c},{c})"><title>layer {i}, only it in {html.escape(f)}: KL {v["kl_mean"]:.2e}</title></rect>')
    y = (len(sens) + 1) * (ch + 2) + 22
    for k, f in enumerate(fmts):
        body.append(f'<rect x="{left + 90 * k}" y="{y - 9}" width="10" height="10" fill="{col[f]}"/><text x="{left + 90 * k + 13}" y="{y}" font-size="10">{html.escape(f)}</text>')
    body.append(f'<text x="{left}" y="{y + 16}" font-size="9">layers 0..{L - 1} left to right; red: higher KL when only that layer is compressed (log scale {10 ** lo:.1e} .. {10 ** hi:.1e})</text>')
    return _svg(w, y + 22, "".join(body), "per-layer format map (top row) and per-layer sensitivity of each menu format")


def tune_html(t: dict | None) -> str:
    if not t:
        return ""
    c = t["chosen"]
    gate = t["limits"].get("kl_mean")
    parts = [f"<h2>Tuning (kv.layers={html.escape(t.get('mode', 'auto'))})</h2>" + (f"<p>{html.escape(t['objective'])}</p>" if t.get("objective") else "") + f"<p>Chosen <b>{html.escape(str(c['name']))}</b>: {c['bytes_per_token']:.1f} bytes/token at {t['context']} tokens "
             f"({c['vs_int8k_int4v']:.3f} x int8k_int4v), window {c['window']}, sinks {c['sink_tokens']}. On the held-out windows: "
             f"<b>{html.escape(t.get('held_out_verdict', 'not validated').upper())}</b>. Searched on {t['tuning_text']['n_windows']} x {t['tuning_text']['seq_len']} "
             f"tokens of {html.escape(t['tuning_text']['origin'])}; limits {html.escape(', '.join(f'{k} <= {v:.3g}' for k, v in t['limits'].items()))}; "
             f"native fallback: {html.escape(t['native_fallback'])}.</p>"]
    parts.append(pareto(t["points"], gate, gate / t["margin"] if gate else None, "Pareto: bytes per token vs KL on the tuning windows (each candidate a point; the chosen one ringed)"))
    parts.append(format_map(t))
    parts.append("<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in TUNE_HEAD) + "</tr>")
    parts += ["<tr>" + "".join(f"<td>{html.escape(x)}</td>" for x in row) + "</tr>" for row in _tune_rows(t)]
    parts.append("</table>")
    return "".join(parts)


def render_html(r: Report, key_absmax: list[list[float]] | None) -> str:
    q, m = r.quality, r.memory
    verdict_color = {"pass": "#1a7f37", "inconclusive": "#9a6700"}.get(r.verdict, "#cf222e")
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>kvcompress report</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}figure{margin:1em 0}figcaption{font-weight:bold}"
        f"#verdict{{font-size:2em;color:{verdict_color}}}</style></head><body>",
        f"<h1>kvcompress report: {html.escape(str(r.model.get('architecture')))} ({html.escape(str(r.model.get('name')))}: "
        f"{html.escape(str(r.model.get('path') or r.model.get('file') or r.model.get('source')))}) / {html.escape(r.kv['name'])}</h1>",
        f"<p id='verdict'>Verdict: {r.verdict.upper()}</p>",
    ]
    parts += [f"<p><b>{html.escape(_role_label(f))}: {f.verdict.upper()}</b></p>" for f in r.fallbacks]
    parts.append("<table><tr><th>format</th><th>gate</th><th>threshold</th><th>value</th><th>status</th></tr>")
    parts += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in gate_rows(r)]
    parts.append("</table>")
    parts += [f"<p>{html.escape(n)}</p>" for n in r.notes]
    head, rows = quality_rows(r)
    parts.append(f"<h2>Quality</h2><p>Perplexity, KL, top-1: {html.escape(r.quality.semantics)}. Tasks: {html.escape(tasks_semantics(r))}.</p>")
    parts.append("<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>")
    parts += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows]
    parts.append("</table><h2>Plots</h2>")
    if key_absmax:
        parts.append(heatmap(key_absmax, "post-RoPE key channel absmax per layer (rows) x kv-head*channel (columns), relative to the layer max"))
    fr = _results(r)
    parts.append(bars([str(i) for i in range(len(q.attn_rel_error_per_layer))], {f.name: f.quality.attn_rel_error_per_layer for f in fr},
                      "per-layer relative error of the attention output", "layer", "||o_hat - o|| / ||o||"))
    parts.append(bars([str(b.start) for b in q.kl_by_position], {f.name: [b.kl_mean for b in f.quality.kl_by_position] for f in fr},
                      "KL(unquantized || compressed) against context position", "first token position of the bin", "KL (nats)"))
    if r.tasks and r.tasks["grid"]:
        g = r.tasks["grid"]
        parts.append(bars([f"{x['length']}@{x['depth']}" for x in g], {"unquantized": [x["fp16"] for x in g], r.kv["name"]: [x["compressed"] for x in g]},
                          "retrieval accuracy over length @ depth", "context length (tokens) @ needle depth", "exact-match accuracy"))
    bd = {k: v for k, v in m.breakdown_per_token.model_dump().items() if v}
    parts.append(bars(list(bd), {"bytes/token": list(bd.values())}, f"compressed bytes per token at {m.context} tokens: {m.bytes_per_token_compressed:.1f} vs {m.bytes_per_token_fp16:.0f} fp16 ({m.compression_ratio:.2f}x)",
                      "part of the cache", "bytes per token"))
    caps = [(f"{n}@{row['context']}", row["capacity_multiplier"]) for n, p in r.planner.items() for row in p["rows"]]
    parts.append(bars([c[0] for c in caps], {"capacity multiplier": [c[1] for c in caps]}, "concurrent sequences, compressed / unquantized, one GPU",
                      "model @ context (tokens)", "capacity multiplier (x)"))
    parts.append(tune_html(r.tune))
    parts.append("<h2>What was verified</h2><ul>" + "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(str(v))}</li>" for k, v in r.verified.items()) + "</ul>")
    if r.export:
        parts.append(f"<h2>Export</h2><p>TensorRT engine built: <b>{r.export['engine_built']}</b> ({html.escape(r.export['engine_reason'])})</p>")
        parts.append("<ul>" + "".join(f"<li><b>{html.escape(head)}</b>: {html.escape(text)}</li>" if loud else f"<li>{html.escape(head)}: {html.escape(text)}</li>"
                                      for head, text, loud in export_notes(r.export)) + "</ul>")
        parts.append("<table><tr><th>check that ran in this export</th><th>status</th></tr>" + "".join(f"<tr><td>{html.escape(c['check'])}</td><td>{c['status']}</td></tr>" for c in r.export["checks"]) + "</table>")
    if r.stage_times_s:
        parts.append("<h2>Stage times</h2><p>" + html.escape(", ".join(f"{k} {v:.0f} s" for k, v in r.stage_times_s.items())) + "</p>")
    parts.append("<h2>Config and provenance</h2><pre>" + html.escape(json.dumps({"kv": r.kv, "eval": r.eval, "model": r.model, "provenance": r.provenance}, indent=1, default=str)) + "</pre>")
    parts.append("</body></html>")
    return "".join(parts)


def write_report_files(r: Report, run_dir: Path, stats_path: Path | None) -> list[Path]:
    key_absmax = None
    if stats_path is not None:
        from kvcompress.stats import KVStats

        k = KVStats.load(stats_path)["k_absmax"]  # [L, H, D]
        key_absmax = k.flatten(1).tolist()
    md, page = run_dir / "report.md", run_dir / "report.html"
    atomic_write_bytes(md, render_md(r).encode())
    atomic_write_bytes(page, render_html(r, key_absmax).encode())
    return [md, page]
