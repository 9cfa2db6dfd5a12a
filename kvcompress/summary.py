"""Tabulate every run of a model and name the most aggressive config that passes every gate.

    python -m kvcompress -m kv=int8,int8k_int4v,int4         # a sweep (Hydra multirun)
    python -m kvcompress.summary runs/ [--model smollm2_135m]

"Most aggressive" = fewest compressed bytes per token among runs whose verdict is pass (runs with
no gates configured are listed but never chosen: nothing was checked).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def collect(root: Path, model: str | None, skipped: list[str] | None = None) -> list[dict]:
    """One row per report.json under root (of `model` if given). A report.json that is not JSON or not a kvcompress report
    (fields missing) is left out, its path and why appended to `skipped`."""
    rows = []
    for p in sorted(root.rglob("report.json")):
        try:
            r = json.loads(p.read_text(encoding="utf-8"))
            if model and r["model"].get("name") != model:
                continue
            q, m, t = r["quality"], r["memory"], r.get("tasks") or {}
            drop = (t.get("retrieval") or {}).get("drop", {}).get("drop")
            rows.append({
                "run": str(p.parent), "model": r["model"].get("name"), "kv": r["kv"]["name"], "bits": m["bits_per_element"],
                "bytes": m["bytes_per_token_compressed"], "ratio": m["compression_ratio"], "ppl_rel": q["ppl_delta_rel"],
                "kl": q["kl_mean"], "top1": q["top1_agree"], "retrieval_drop": drop, "gates": len(r.get("gates", [])), "verdict": r.get("verdict", "pass"),
                "kv_overrides": kv_overrides(p.parent),
            })
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # not JSON (ValueError), or JSON of another shape
            if skipped is not None:
                skipped.append(f"{p}: not a kvcompress report ({type(e).__name__}: {e})")
    return rows


def kv_overrides(run: Path) -> str:
    """The kv.* overrides a run was given (Hydra's .hydra/overrides.yaml), e.g. "kv.window=64": what tells apart the jobs of
    a sweep over one preset's settings, whose kv names are the same. "" when none (or no record)."""
    import yaml

    try:
        given = yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):  # a run directory without Hydra's record, or an unreadable one: nothing to show
        return ""
    return " ".join(str(o) for o in given if str(o).lstrip("+~").startswith("kv.")) if isinstance(given, list) else ""


def best(rows: list[dict]) -> dict | None:
    ok = [r for r in rows if r["verdict"] == "pass" and r["gates"] > 0]
    return min(ok, key=lambda r: r["bytes"]) if ok else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path, nargs="?", default=Path("runs"))
    ap.add_argument("--model", default=None)
    a = ap.parse_args(argv)
    if not a.root.is_dir():
        print(f"kvcompress: error: {str(a.root)!r} is not a directory of runs", file=sys.stderr)
        return 2
    skipped: list[str] = []
    rows = collect(a.root, a.model, skipped)
    for why in skipped:
        print(f"kvcompress: skipped {why}", file=sys.stderr)
    if not rows:
        print(f"kvcompress: error: no {'readable ' if skipped else ''}report.json under {str(a.root)!r}" + (f" for model {a.model}" if a.model else ""), file=sys.stderr)
        return 2
    print(f"{'model':<14} {'kv':<14} {'bits/el':>7} {'ratio':>6} {'ppl delta':>10} {'KL mean':>9} {'top-1':>7} {'retr drop':>9} {'gates':>5} verdict  run  (kv overrides)")
    for r in sorted(rows, key=lambda r: (r["model"], -r["bytes"])):
        drop = "n/a" if r["retrieval_drop"] is None else f"{r['retrieval_drop']:+.3f}"
        print(f"{r['model']:<14} {r['kv']:<14} {r['bits']:7.2f} {r['ratio']:6.2f} {100 * r['ppl_rel']:+9.3f}% {r['kl']:9.2e} {100 * r['top1']:6.2f}% {drop:>9} {r['gates']:>5} {r['verdict']:<8} {r['run']}" + (f"  ({r['kv_overrides']})" if r["kv_overrides"] else ""))
    b = best(rows)
    print(f"most aggressive config passing every gate: {b['kv']}{' ' + b['kv_overrides'] if b['kv_overrides'] else ''} ({b['bits']:.2f} bits/element, {b['run']})"
          if b else "no run passes a non-empty set of gates")
    return 0


if __name__ == "__main__":
    sys.exit(main())
