"""report: report.md and a self-contained report.html (inline SVG, no scripts, opens offline).

Rendered from report.json (+ kv_stats for the key-channel heatmap). Verdict first, then the
quality table, plots, memory, and the config and provenance.
"""
from __future__ import annotations

import html
import json
from pathlib import Path

from kvcompress.artifacts import atomic_write_bytes
from kvcompress.report_schema import Report


def _fmt(v, digits=4) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def quality_rows(r: Report) -> list[tuple[str, str, str]]:
    q = r.quality
    rows = [
        ("perplexity", _fmt(q.ppl_baseline), _fmt(q.ppl_compressed)),
        ("perplexity delta (relative)", "", f"{100 * q.ppl_delta_rel:+.3f}%"),
        ("KL mean / p99 (nats)", "", f"{q.kl_mean:.3e} / {q.kl_p99:.3e}"),
        ("top-1 agreement", "", f"{100 * q.top1_agree:.2f}%"),
        ("key clipping rate", "", f"{q.key_clip_rate:.2e}"),
    ]
    if r.tasks:
        t = r.tasks
        rows += [("retrieval exact (teacher-forced)", _fmt(t["retrieval_fp16"]), _fmt(t["retrieval_compressed"])), ("exact copy (teacher-forced)", _fmt(t["exact_fp16"]), _fmt(t["exact_compressed"]))]
        for name, s in t["tasks"].items():
            rows.append((f"  {name}: exact tf / greedy", f"{_fmt(s['tf_exact_fp16'])} / {_fmt(s['greedy_exact_fp16'])}", f"{_fmt(s['tf_exact_compressed'])} / {_fmt(s['greedy_exact_compressed'])} (seed spread {_fmt(s['seed_spread_compressed'], 2)})"))
    return rows


def render_md(r: Report) -> str:
    m = r.memory
    out = [f"# kvcompress report: {r.model.get('name')} / {r.kv['name']}", "", f"**Verdict: {r.verdict.upper()}**", ""]
    if r.gates:
        out += ["| gate | threshold | value | passed |", "|---|---|---|---|"]
        out += [f"| {g.name} | {g.threshold} | {_fmt(g.value)} | {'yes' if g.passed else 'NO'} |" for g in r.gates]
    out += [f"- {n}" for n in r.notes]
    out += ["", "## Quality (fp16 cache vs compressed cache, same model, same held-out tokens)", "", "| metric | fp16 | compressed |", "|---|---|---|"]
    out += [f"| {a} | {b} | {c} |" for a, b, c in quality_rows(r)]
    out += ["", "## Memory", "", f"- bytes per token at {m.context} tokens: fp16 {m.bytes_per_token_fp16:.0f}, compressed {m.bytes_per_token_compressed:.1f} ({m.compression_ratio:.2f}x, {m.bits_per_element:.2f} bits/element)"]
    out += [f"- {k}: {v:.2f} B/token" for k, v in m.breakdown_per_token.model_dump().items() if v]
    for name, p in r.planner.items():
        for row in p["rows"]:
            out.append(f"- {name} on one {p['gpu']} at {row['context']} tokens: {row['fp16']['max_concurrent_seqs']} -> {row['compressed']['max_concurrent_seqs']} sequences (x{_fmt(row['capacity_multiplier'], 3)})")
    out += ["", "## What was verified", ""] + [f"- **{k}**: {v}" for k, v in r.verified.items()]
    if r.export:
        out += ["", "## Export", "", f"- TensorRT engine built: **{r.export['engine_built']}** ({r.export['engine_reason']})"]
        out += [f"- tier {k}: {v.get('what')}" for k, v in r.export["tiers"].items()]
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


def bars(labels: list[str], series: dict[str, list[float]], title: str, w: int = 640, h: int = 180) -> str:
    colors = ["#4878a8", "#d9822b", "#6a9955"]
    n = len(labels)
    vmax = max((v for s in series.values() for v in s if v is not None), default=1.0) or 1.0
    bw = (w - 40) / max(1, n) / (len(series) + 0.5)
    body = [f'<line x1="30" y1="{h - 20}" x2="{w}" y2="{h - 20}" stroke="#888"/>', f'<text x="0" y="12" font-size="10">{_fmt(vmax, 3)}</text>']
    for k, (name, vals) in enumerate(series.items()):
        for i, v in enumerate(vals):
            if v is None:
                continue
            bh = (h - 30) * v / vmax
            x = 30 + i * bw * (len(series) + 0.5) + k * bw
            body.append(f'<rect x="{x:.1f}" y="{h - 20 - bh:.1f}" width="{bw:.1f}" height="{bh:.1f}" fill="{colors[k % 3]}"><title>{html.escape(labels[i])} {name}: {_fmt(v)}</title></rect>')
        body.append(f'<text x="{w - 160}" y="{14 + 12 * k}" font-size="10" fill="{colors[k % 3]}">{html.escape(name)}</text>')
    step = max(1, n // 12)
    for i in range(0, n, step):
        body.append(f'<text x="{30 + i * bw * (len(series) + 0.5):.1f}" y="{h - 6}" font-size="9">{html.escape(labels[i])}</text>')
    return _svg(w, h, "".join(body), title)


def render_html(r: Report, key_absmax: list[list[float]] | None) -> str:
    q, m = r.quality, r.memory
    verdict_color = "#1a7f37" if r.verdict == "pass" else "#cf222e"
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>kvcompress report</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}figure{margin:1em 0}figcaption{font-weight:bold}"
        f"#verdict{{font-size:2em;color:{verdict_color}}}</style></head><body>",
        f"<h1>kvcompress report: {html.escape(str(r.model.get('name')))} / {html.escape(r.kv['name'])}</h1>",
        f"<p id='verdict'>Verdict: {r.verdict.upper()}</p>",
    ]
    if r.gates:
        parts.append("<table><tr><th>gate</th><th>threshold</th><th>value</th><th>passed</th></tr>")
        parts += [f"<tr><td>{g.name}</td><td>{g.threshold}</td><td>{_fmt(g.value)}</td><td>{'yes' if g.passed else 'NO'}</td></tr>" for g in r.gates]
        parts.append("</table>")
    parts += [f"<p>{html.escape(n)}</p>" for n in r.notes]
    parts.append("<h2>Quality</h2><table><tr><th>metric</th><th>fp16</th><th>compressed</th></tr>")
    parts += [f"<tr><td>{html.escape(a)}</td><td>{html.escape(b)}</td><td>{html.escape(c)}</td></tr>" for a, b, c in quality_rows(r)]
    parts.append("</table><h2>Plots</h2>")
    if key_absmax:
        parts.append(heatmap(key_absmax, "post-RoPE key channel absmax per layer (rows) x kv-head*channel (columns), relative to the layer max"))
    parts.append(bars([str(i) for i in range(len(q.attn_rel_error_per_layer))], {"relative attention-output error": q.attn_rel_error_per_layer}, "per-layer error"))
    parts.append(bars([str(b.start) for b in q.kl_by_position], {"KL": [b.kl_mean for b in q.kl_by_position]}, "KL(fp16 || compressed) against context position"))
    if r.tasks and r.tasks["grid"]:
        g = r.tasks["grid"]
        parts.append(bars([f"{x['length']}@{x['depth']}" for x in g], {"fp16": [x["fp16"] for x in g], "compressed": [x["compressed"] for x in g]}, "retrieval accuracy over length @ depth"))
    bd = {k: v for k, v in m.breakdown_per_token.model_dump().items() if v}
    parts.append(bars(list(bd), {"bytes/token": list(bd.values())}, f"compressed bytes per token at {m.context} tokens: {m.bytes_per_token_compressed:.1f} vs fp16 {m.bytes_per_token_fp16:.0f} ({m.compression_ratio:.2f}x)"))
    caps = [(f"{n}@{row['context']}", row["capacity_multiplier"]) for n, p in r.planner.items() for row in p["rows"]]
    parts.append(bars([c[0] for c in caps], {"capacity multiplier": [c[1] for c in caps]}, "concurrent sequences, compressed / fp16, one GPU"))
    parts.append("<h2>What was verified</h2><ul>" + "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(str(v))}</li>" for k, v in r.verified.items()) + "</ul>")
    if r.export:
        parts.append(f"<h2>Export</h2><p>TensorRT engine built: <b>{r.export['engine_built']}</b> ({html.escape(r.export['engine_reason'])})</p>")
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
