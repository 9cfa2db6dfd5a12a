"""kv=auto against the default format, side by side in one run, on the same machine.

    python scripts/bench_tune.py                  # embedded model, default config (export on)
    python scripts/bench_tune.py --export none    # without the export stage
    python scripts/bench_tune.py --model gemma3_270m --export none   # the second model family
    python scripts/bench_tune.py --render         # re-render docs/tuning.md's blocks from docs/bench/tune*.json

Warms the machine's caches first (float weights, kv_stats: `stages=[profile]`), then runs
`python -m kvcompress` (the default preset, conf/config.yaml's kv: int8k_asym_rotv today; the results name it
under "baseline") and `python -m kvcompress kv=auto` one after the other in subprocesses with the same cache, and
prints: wall time of each and their ratio (issue #12's goal: at most 3x), bytes per token at the tuning context
(the model's serving context) and their ratio (goal: at most 0.85), and each run's held-out verdict. Writes
docs/bench/tune.json (the embedded model) or docs/bench/tune_<model>.json, and that model's block of docs/tuning.md.
Results written before the baseline was named compared with int8k_int4v (then the default).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "tuning.md"  # the page its blocks are rendered into
sys.path.insert(0, str(ROOT))
DEFAULT_MODEL = "smollm2_135m"


def result_path(model: str) -> Path:
    return ROOT / "docs" / "bench" / ("tune.json" if model == DEFAULT_MODEL else f"tune_{model}.json")


def markers(model: str) -> tuple[str, str]:
    rel = result_path(model).relative_to(ROOT)
    tag = "tune-bench" if model == DEFAULT_MODEL else f"tune-bench:{model}"
    return f"<!-- {tag}:begin (rendered by scripts/bench_tune.py --render from {rel}) -->", f"<!-- {tag}:end -->"


def layer_map(layers: list[str], sliding: list[int]) -> str:
    """One line per distinct format: which layers (sliding-window layers marked with *)."""
    out = []
    for f in sorted(set(layers)):
        idx = [f"{i}{'*' if sliding and sliding[i] else ''}" for i, x in enumerate(layers) if x == f]
        out.append(f"{f}: layers {' '.join(idx)}")
    return "; ".join(out)


def default_kv() -> str:
    """The default kv preset (conf/config.yaml's defaults list): the format `python -m kvcompress` runs."""
    from kvcompress.paths import default_presets

    return default_presets()["kv"]


def render(r: dict) -> str:
    """The block of docs/tuning.md, from a results file of this benchmark."""
    base = r.get("baseline", "int8k_int4v")
    p, q = r["runs"][base], r["runs"]["auto"]
    BEGIN, END = markers(r["model"])

    def times(x):
        return ", ".join(f"{k} {v:.0f} s" for k, v in x["stage_times_s"].items() if v >= 1)

    def drops(x):
        return ", ".join(f"{g['name']} {g['value']:+.3f}" for g in x["gates"] if g["name"].endswith("_drop"))

    k4 = sum(f.startswith("k4") for f in q["layers"])
    lines = [BEGIN, "", f"Model {r['model']}; ran {r['ran'][:10]}, git {str(r['git_sha'])[:12]}{' with uncommitted changes' if str(r['git_sha']).endswith('-dirty') else ''}, 2 CPU cores, export={r['export']} (`{result_path(r['model']).relative_to(ROOT)}`):", "",
             f"| run | wall time | bytes/token at {q['context']} tokens | held-out verdict (default eval) | KL mean | ppl delta |", "|---|---|---|---|---|---|"]
    for name, x in ((f"kv={base}", p), ("kv=auto", q)):
        ratio = f" (**{x['bytes_per_token'] / p['bytes_per_token']:.3f}x**)" if x is q else ""
        lines.append(f"| `{name}` | {x['seconds']:.0f} s ({times(x)}) | {x['bytes_per_token']:.0f}{ratio} | {x['verdict'].upper()} ({drops(x)}) | "
                     f"{x['kl_mean']:.2e} | {100 * x['ppl_delta_rel']:+.3f}% |")
    k8, hp = sum(f.startswith("k8") for f in q["layers"]), sum(f == "fp16" for f in q["layers"])
    lines += ["", f"Time ratio **{r['time_ratio']:.2f}x**. The choice: {k4} of {len(q['layers'])} layers int4 keys, "
              f"{k8} int8 keys{f', {hp} fp16' if hp else ''}, window {q['window']}, {q['sink_tokens']} sinks. Per layer"
              f"{' (* = sliding-window layer)' if any(r.get('sliding_windows') or ()) else ''}: {layer_map(q['layers'], r.get('sliding_windows') or [])}."]
    return "\n".join(lines + ["", END])


def write_doc(r: dict) -> None:
    BEGIN, END = markers(r["model"])
    head, rest = DOC.read_text().split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(head + render(r) + tail)


def run(args: list[str], env: dict, run_dir: Path) -> float:
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "kvcompress", *args, f"hydra.run.dir={run_dir}"], env=env, cwd=ROOT,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode:
        sys.exit(f"bench_tune: {' '.join(args)} failed:\n{p.stdout[-3000:]}")
    return time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from kvcompress.paths import preset_names

    ap.add_argument("--model", default="smollm2_135m", choices=preset_names("model"), help="a model preset (conf/model)")
    ap.add_argument("--export", default="trtllm", choices=["trtllm", "none"])
    ap.add_argument("--no-write", action="store_true", help="print only; do not write docs/bench/tune.json")
    ap.add_argument("--render", action="store_true", help="only render docs/bench/tune*.json into docs/tuning.md (no run)")
    a = ap.parse_args()
    if a.render:
        for f in sorted((ROOT / "docs" / "bench").glob("tune*.json")):
            write_doc(json.loads(f.read_text()))
        return
    from kvcompress.models.base import Geometry
    from kvcompress.provenance import base_provenance
    from kvcompress.stages.validate import memory_summary
    from kvcompress.scalebook import ScaleBook

    env = dict(os.environ)
    common = [f"model={a.model}", f"export={a.export}"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        run([*common, "export=none", "stages=[profile]"], env, tmp / "warm")
        out, sliding = {}, []
        base = default_kv()
        for kv in (base, "auto"):
            d = tmp / kv
            secs = run([*common, *([] if kv == base else [f"kv={kv}"])], env, d)  # the default: no kv= at all
            rep = json.loads((d / "report.json").read_text())
            book = ScaleBook.load(d / "scalebook.safetensors")
            g = Geometry(**rep["model"]["geometry"])
            sliding = list(g.sliding_windows)
            tune = json.loads((d / "tune.json").read_text()) if (d / "tune.json").is_file() else None
            ctx = tune["context"] if tune else g.max_position
            bpt = memory_summary(book.spec, g, ctx).bytes_per_token_compressed
            out[kv] = {"seconds": secs, "stage_times_s": rep.get("stage_times_s"), "verdict": rep["verdict"], "bytes_per_token": bpt, "context": ctx,
                       "kl_mean": rep["quality"]["kl_mean"], "ppl_delta_rel": rep["quality"]["ppl_delta_rel"],
                       "gates": [{"name": x["name"], "status": x["status"], "value": x["value"]} for x in rep["gates"]],
                       **({"layers": tune["chosen"]["layers"], "window": tune["chosen"]["window"], "sink_tokens": tune["chosen"]["sink_tokens"],
                           "tune_times_s": tune["times_s"]} if tune else {})}
    res = {"model": a.model, "export": a.export, "ran": time.strftime("%Y-%m-%dT%H:%M:%S"), "git_sha": base_provenance().get("git_sha"),
           "sliding_windows": sliding, "baseline": base,
           "time_ratio": out["auto"]["seconds"] / out[base]["seconds"],
           "bytes_ratio": out["auto"]["bytes_per_token"] / out[base]["bytes_per_token"], "runs": out}
    p, q = out[base], out["auto"]
    print(f"kv={base} (the default): {p['seconds']:.0f} s, {p['bytes_per_token']:.1f} B/token at {p['context']}, held-out verdict {p['verdict'].upper()}")
    print(f"kv=auto: {q['seconds']:.0f} s, {q['bytes_per_token']:.1f} B/token at {q['context']}, held-out verdict {q['verdict'].upper()}")
    print(f"time ratio auto / {base}: {res['time_ratio']:.2f}x (goal <= 3); bytes ratio: {res['bytes_ratio']:.3f} (goal <= 0.85)")
    if not a.no_write:
        result = result_path(a.model)
        result.parent.mkdir(parents=True, exist_ok=True)
        result.write_text(json.dumps(res, indent=1))
        write_doc(res)
        print(f"wrote {result} and its block of {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
