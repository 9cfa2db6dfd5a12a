"""Rerun the measured commands of docs/results.md, store their numbers in docs/results/, render its tables.

    python scripts/make_results.py            # rerun every command (5 to 50 minutes each on 2 cores), then render
    python scripts/make_results.py --only long8k_auto   # one of them
    python scripts/make_results.py --render   # only re-render docs/results.md's tables from docs/results/*.json

Each docs/results/<name>.json holds the command, when and where it ran (versions, git sha, model
fingerprint, text hashes), and the numbers of its report.json (every validated format, the
export's re-measurements, stage times). The block of docs/results.md between the results markers is
rendered from these files only; tests/test_readme_results.py fails when the two disagree.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kvcompress.paths import default_cache_dir  # noqa: E402

RESULTS = ROOT / "docs" / "results"
DOC = ROOT / "docs" / "results.md"  # the page the tables are rendered into
BEGIN, END = "<!-- results:begin (rendered by scripts/make_results.py from docs/results/*.json; do not edit) -->", "<!-- results:end -->"

COMMANDS = {
    "default": "python -m kvcompress",
    # the 8K table in one command: the default (int8k_asym_rotv), the first default (int8k_int4v), the stock formats, KIVI-style int4,
    # the old int4 preset, the best <= 4.5-bit format (wf4) and the 8-bit-key candidate (rot8k_int4v), one baseline pass on the same
    # 4 x 8192 held-out tokens
    "long8k_all": "python -m kvcompress kv=int8k_asym_rotv eval=long export=none "
                  "eval.compare=[int8k_int4v,native_int8,native_fp8,native_nvfp4,kivi_int4,int4,wf4,rot8k_int4v]",
    # the kv=auto choice (tuned on calibration text at 1K) measured at 8K on the same held-out windows
    "long8k_auto": "python -m kvcompress kv=auto eval=long export=none",
    # the default's 8K tasks as the custom tier runs them (eval.tasks.prompt=auto: its engine feeds a prompt one token per step,
    # so every prompt token reads the compressed past: decode-equivalent prompts, a full forward pass per sample), the 8K
    # table's 4 x 8192 held-out tokens and 60 task samples; long8k_all runs every format's prompts context-phase
    "long8k_deployed": "python -m kvcompress kv=int8k_asym_rotv eval=long export=none eval.tasks.prompt=auto",
    # kv=rot4 (4.44 bits/element, Hadamard-rotated per-token int4) beside KIVI-style int4 at 8K
    "long8k_rot4": "python -m kvcompress kv=rot4 eval=long export=none eval.compare=[kivi_int4]",
    # kv=rot7k_int5v (one key bit moved to the values at rot8k_int4v's bytes) beside rot8k_int4v and int8k_int4v at 8K
    "long8k_rot7k": "python -m kvcompress kv=rot7k_int5v eval=long export=none eval.compare=[rot8k_int4v,int8k_int4v]",
    # kv=wf6 and kv=wf5 (water-filled token-grouped keys at a mean of 6 / 5 bits, 6- / 5-bit rotated values) beside int8k_int4v at 8K
    "long8k_wf": "python -m kvcompress kv=wf6 eval=long export=none eval.compare=[wf5,int8k_int4v]",
    # kv=wf3 (wf4's structure at a mean of 3 bits: 3-bit water-filled keys, 3-bit rotated values; 3.46 bits/element) beside
    # KIVI-style int4 at 8K, on the 8K table's 4 x 8192 held-out tokens (wf4 and native_nvfp4 there: the same windows)
    "long8k_wf3": "python -m kvcompress kv=wf3 eval=long export=none eval.compare=[kivi_int4]",
    # the second model family (Gemma 3 270M: head dim 256, QK-norm, sliding-window layers) at 8K: wf6 and wf5 beside the default
    # and the default with Hadamard-rotated values (int8k_rotv), the 8K table's 4 x 8192 held-out tokens
    "gemma8k_wf": "python -m kvcompress model=gemma3_270m kv=wf6 eval=long export=none eval.compare=[wf5,int8k_int4v,int8k_rotv]",
    # kv=int8k_budget on the second family at 8K (Gemma 3 270M: the tune prices its sliding-window layers as rolling
    # buffers at every context), beside int8k_asym_rotv and int8k_int4v on gemma8k_wf's 4 x 8192 held-out tokens, no tasks
    "gemma8k_budget": "python -m kvcompress model=gemma3_270m kv=int8k_budget eval=long export=none eval.tasks.names=[] "
                      "eval.compare=[int8k_asym_rotv,int8k_int4v]",
    # where int8k_int4v's error comes from at 8K (eval.attribute: each format again with only its keys, then only its values
    # compressed), beside it with Hadamard-rotated values (int8k_rotv), on the 8K table's 4 x 8192 held-out tokens (no tasks)
    "long8k_attr": "python -m kvcompress kv=int8k_int4v eval=long export=none eval.attribute=true eval.tasks.names=[] eval.compare=[int8k_rotv]",
    # kv=int8k_asym_rotv: int8k_rotv with static asymmetric int8 keys (each channel's range over every position up to
    # max_position, from the pre-RoPE angles: observers.base.arc_ranges; no clipping search) beside int8k_rotv, attributed
    # (keys only / values only), the 8K table's 4 x 8192 held-out tokens
    "long8k_asym": "python -m kvcompress kv=int8k_asym_rotv eval=long export=none eval.attribute=true eval.tasks.names=[] eval.compare=[int8k_rotv]",
    # the same keys with the q.k-score MSE clipping search (kv.key.clip=mse, the default clip): worse at 8K than the
    # symmetric keys (why int8k_asym_rotv uses minmax)
    "long8k_asymk_mse": "python -m kvcompress kv=int8k_rotv kv.key.symmetric=false kv.name=int8k_rotv_asymk eval=long export=none "
                        "eval.attribute=true eval.tasks.names=[] eval.compare=[int8k_rotv]",
    # kv=int8k_budget: int8k_asym_rotv's bytes spent layer by layer (kv.layers=budget: value groups and value bits chosen
    # per layer by the tune stage's sensitivity on calibration text) beside the uniform int8k_asym_rotv and int8k_int4v
    "long8k_budget": "python -m kvcompress kv=int8k_budget eval=long export=none eval.tasks.names=[] eval.compare=[int8k_asym_rotv,int8k_int4v]",
    # kv=int8k_budget on the license texts below (the per-layer choice is made on the calibration text, as always)
    "long8k_legal_budget": "python -m kvcompress kv=int8k_budget eval=long export=none eval.source=files "
                           "eval.paths=[" + ",".join(f"/usr/share/common-licenses/{n}" for n in ("GPL-3", "GPL-2", "LGPL-2", "LGPL-3", "GFDL", "Artistic", "BSD"))
                           + "] eval.n_windows=3 eval.tasks.names=[] eval.compare=[int8k_asym_rotv,int8k_int4v]",
    # another genre than the built-in Python documentation (calibration and held-out text alike): the license texts every
    # Debian system ships, 3 x 8192 tokens (no tasks: their prompts are the built-in ones), the 8K table's custom formats
    "long8k_legal": "python -m kvcompress kv=rot8k_int4v eval=long export=none eval.source=files "
                    "eval.paths=[" + ",".join(f"/usr/share/common-licenses/{n}" for n in ("GPL-3", "GPL-2", "LGPL-2", "LGPL-3", "GFDL", "Artistic", "BSD"))
                    + "] eval.n_windows=3 eval.tasks.names=[] eval.compare=[int8k_int4v,wf4,kivi_int4,rot7k_int5v,int8k_asym_rotv,wf5,wf6]",
}


# KL mean ratios the docs' text argues from, rendered (not typed) under their table: (format, against)
RATIOS = {
    "long8k_all": [("int8k_asym_rotv", "int8k_int4v"), ("wf4", "kivi_int4"), ("wf4", "native_nvfp4"), ("rot8k_int4v", "int8k_int4v")],
    "long8k_rot4": [("rot4", "kivi_int4")],
    "long8k_legal": [("wf4", "kivi_int4"), ("rot8k_int4v", "int8k_int4v"), ("rot7k_int5v", "int8k_int4v"), ("int8k_asym_rotv", "int8k_int4v"),
                     ("wf5", "int8k_int4v"), ("wf6", "int8k_int4v")],
    "long8k_rot7k": [("rot7k_int5v", "int8k_int4v"), ("rot7k_int5v", "rot8k_int4v")],
    "long8k_wf": [("wf6", "int8k_int4v"), ("wf5", "int8k_int4v")],
    "long8k_wf3": [("wf3", "kivi_int4")],
    "gemma8k_wf": [("wf6", "int8k_int4v"), ("wf5", "int8k_int4v"), ("int8k_rotv", "int8k_int4v")],
    "gemma8k_budget": [("int8k_budget", "int8k_asym_rotv"), ("int8k_budget", "int8k_int4v")],
    "long8k_attr": [("int8k_rotv", "int8k_int4v")],
    "long8k_asym": [("int8k_asym_rotv", "int8k_rotv")],
    "long8k_asymk_mse": [("int8k_rotv_asymk", "int8k_rotv")],
    "long8k_budget": [("int8k_budget", "int8k_asym_rotv"), ("int8k_budget", "int8k_int4v")],
    "long8k_legal_budget": [("int8k_budget", "int8k_asym_rotv"), ("int8k_budget", "int8k_int4v")],
}


PROMPT_HEADER = {"context": "context-phase", "decode": "decode-equivalent prompt"}


def _fmt_drop(t: dict | None, key: str) -> str:
    g = (t or {}).get(key)
    if not g:
        return "not run"
    d = g["drop"]
    return f"{g['fp16']:.2f} -> {g['compressed']:.2f} (n={g['n']}, drop {d['drop']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}])"


def summarise(report: dict, command: str, run_dir: Path) -> dict:
    """What docs/results.md shows, from a report.json (plus provenance)."""
    formats = [{"name": report["kv"]["name"], "tier": "custom" if report["kv"]["format"] == "kvcompress" else "native", "role": "primary",
                "quality": report["quality"], "memory": report["memory"], "tasks": report.get("tasks"), "verdict": report["verdict"],
                "verdict_basis": report.get("verdict_basis", []), "attribution": report.get("attribution")}]
    formats += [{k: f.get(k) for k in ("name", "tier", "role", "quality", "memory", "tasks", "verdict", "verdict_basis", "attribution")} for f in report.get("fallbacks", [])]
    for f in formats:
        f["quality"] = {k: f["quality"].get(k) for k in ("tokens", "ppl_baseline", "ppl_compressed", "ppl_delta_rel", "kl_mean", "kl_p99", "top1_agree", "key_clip_rate", "value_clip_rate", "semantics", "by_position")}
        f["memory"] = {k: f["memory"][k] for k in ("context", "bytes_per_token_fp16", "bytes_per_token_compressed", "compression_ratio", "bits_per_element")}
        if f["tasks"]:
            f["tasks"] = {k: f["tasks"].get(k, "context") if k == "prompt" else f["tasks"][k] for k in ("semantics", "prompt", "retrieval", "exact_copy", "greedy_check")}
    export = report.get("export") or {}
    return {
        "command": command,
        "ran": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "run_dir": str(run_dir),
        "model": {k: report["model"].get(k) for k in ("name", "architecture", "file", "path", "sha256", "dtype", "baseline")},
        "eval": {k: report["eval"].get(k) for k in ("origin", "sha256", "n_windows", "seq_len")},
        "provenance": {k: report["provenance"].get(k) for k in ("versions", "python", "git_sha", "git_changes", "machine")},
        "formats": formats,
        "self_check": report.get("self_check"),
        "export": {name: {"validated_as": a["validated_as"], "remeasured": {k: a["remeasured"][k] for k in ("validated_kl", "remeasured_kl", "tolerance", "passed")}}
                   for name, a in export.get("artifacts", {}).items() if "remeasured" in a},
        "export_checks": [{"check": c["check"], "status": c["status"]} for c in export.get("checks", [])],
        "stage_times_s": report.get("stage_times_s", {}),
    }


def run(name: str, command: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvc_results_") as tmp:
        run_dir = Path(tmp) / name
        argv = shlex.split(command) + [f"hydra.run.dir={run_dir}"]
        print(f"[make_results] {' '.join(argv)}", flush=True)
        # a fresh kvcompress cache (profiling is always part of the measured run) that shares only
        # the machine's dequantized float weights (they are an input, not part of the run)
        cache = Path(tmp) / "cache"
        cache.mkdir()
        weights = default_cache_dir() / "models"
        if weights.is_dir():
            (cache / "models").symlink_to(weights.resolve(), target_is_directory=True)
        p = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, env={**os.environ, "KVCOMPRESS_CACHE": str(cache)})
        if p.returncode:
            raise SystemExit(f"make_results: `{command}` exited {p.returncode}")
        return summarise(json.loads((run_dir / "report.json").read_text()), command, run_dir)


def _is_results_path(path: str) -> bool:
    """docs/results/* and docs/results.md: what a rerun writes; changes there do not change what a run computes."""
    return path == "docs/results.md" or path.startswith("docs/results/")


def check_checkout(sha: str | None, changes: list[str] | tuple[str, ...]) -> None:
    """Refuse to measure on a checkout with uncommitted changes outside the results files: a results file names the
    commit it ran at, and that commit must be the code that ran. Earlier results written into the same checkout are
    allowed (the run records them in git_changes) so that several commands can run one after another."""
    other = [c for c in changes if not _is_results_path(c)]
    if sha and other:
        shown = ", ".join(other[:5]) + (f" and {len(other) - 5} more" if len(other) > 5 else "")
        raise SystemExit(f"make_results: the checkout has uncommitted changes outside docs/results ({shown}); "
                         "a results file records the commit it ran at: commit them, or rerun from a clean clone")


def _git(r: dict) -> str:
    """'git <sha12>' and what uncommitted changes the run's checkout had: none, only results files of earlier runs, or
    unknown ones (files made before git_changes was recorded, or with code edits)."""
    sha = str(r["provenance"]["git_sha"])
    if not sha.endswith("-dirty"):
        return f"git {sha[:12]}"
    changes = r["provenance"].get("git_changes")
    if changes and all(_is_results_path(c) for c in changes):
        return f"git {sha[:12]} (uncommitted: only earlier results files)"
    return f"git {sha[:12]} with uncommitted changes"


def _on(r: dict) -> str:
    """' on <CPU> (<torch CPU capability>)': the machine the results file records."""
    m = r["provenance"]["machine"]
    return f" on {m['cpu']} ({m['torch_cpu_capability']})"


def _ran_as(r: dict) -> str:
    """'; ran as `...`' when a file's run left kv= to the default preset of its time (ran_as: that command, and the
    preset it resolved to, which its formats name); the command above is that run's resolved config written out."""
    a = r.get("ran_as")
    return f"; ran as `{a['command']}` when {a['default_kv']} was the default" if a else ""


def render(results: dict[str, dict]) -> str:
    """The block of docs/results.md: one table per results file."""
    out = [BEGIN]
    for name, r in sorted(results.items()):
        t = r["stage_times_s"]
        out += ["", f"`{r['command']}` ({r['model']['architecture']} {r['model']['name']}, baseline: {r['model']['baseline']}; "
                f"{r['eval']['n_windows']} x {r['eval']['seq_len']} held-out tokens; ran {r['ran'][:10]}{_on(r)}, {_git(r)}; "
                f"file `docs/results/{name}.json`{_ran_as(r)}):", ""]
        modes = {f["name"]: f["tasks"].get("prompt", "context") for f in r["formats"] if f["tasks"]}  # files made before eval.tasks.prompt: context
        kinds = set(modes.values())
        sem = PROMPT_HEADER[next(iter(kinds))] if len(kinds) == 1 else "prompt as deployed, below" if kinds else "context-phase"
        out += [f"| format (tier, exported as) | verdict | bits/element | ppl delta | KL mean / p99 | top-1 | K / V clip rate | retrieval ({sem}) | exact copy ({sem}) |",
                "|---|---|---|---|---|---|---|---|---|"]
        for f in r["formats"]:
            q, m = f["quality"], f["memory"]
            role = {"primary": "kv format", "trtllm": "trtllm_ckpt", "hf": "hf_ckpt"}.get(f["role"], "compared")
            out.append(f"| {f['name']} ({f['tier']}, {role}) | {f['verdict'].upper()} | {m['bits_per_element']:.2f} | {100 * q['ppl_delta_rel']:+.3f}% | "
                       f"{q['kl_mean']:.2e} / {q['kl_p99']:.2e} | {100 * q['top1_agree']:.2f}% | {q['key_clip_rate']:.1e} / {q['value_clip_rate']:.1e} | "
                       f"{_fmt_drop(f['tasks'], 'retrieval')} | {_fmt_drop(f['tasks'], 'exact_copy')} |")
        if len(kinds) > 1:
            out += ["", "Task prompts (eval.tasks.prompt): " + "; ".join(f"{n} {PROMPT_HEADER[m]}" for n, m in modes.items()) + "."]
        if any(len(f["quality"].get("by_position") or []) > 1 for f in r["formats"]):
            b0 = r["formats"][0]["quality"]["by_position"]
            out += ["", "KL mean by position of the predicted token (" + " / ".join(f"{b['start'] // 1024}K-{b['end'] // 1024}K" for b in b0) + "), key clip rate in the last bucket: "
                    + "; ".join(f"{f['name']} " + " / ".join(f"{b['kl_mean']:.1e}" for b in f["quality"]["by_position"])
                                + (f" (clip {f['quality']['by_position'][-1]['key_clip_rate']:.1e})" if f["quality"]["by_position"][-1].get("key_clip_rate") is not None else "")
                                for f in r["formats"]) + "."]
        split = [f for f in r["formats"] if len(((f["tasks"] or {}).get("retrieval") or {}).get("by_length") or []) > 1]
        if split:  # eval.tasks.lengths (files made before by_length have none)
            def by_len(g: dict | None, key: str) -> str:
                return " / ".join(f"{b[key]:.2f}" for b in g["by_length"]) if g and g.get("by_length") else "not run"

            ls = [b["length"] for b in split[0]["tasks"]["retrieval"]["by_length"]]
            out += ["", f"Task exact match by sample length ({' / '.join(f'{n} tokens' for n in ls)}), retrieval | copy: fp16 "
                    f"{by_len(split[0]['tasks']['retrieval'], 'fp16')} | {by_len(split[0]['tasks'].get('exact_copy'), 'fp16')}; "
                    + "; ".join(f"{f['name']} {by_len(f['tasks']['retrieval'], 'compressed')} | {by_len(f['tasks'].get('exact_copy'), 'compressed')}"
                                for f in split) + "."]
        attributed = [f for f in r["formats"] if f.get("attribution")]
        if attributed:  # eval.attribute
            out += ["", "KL mean with only the keys / only the values compressed (eval.attribute): " + "; ".join(
                f"{f['name']} {f['attribution']['keys_only']['kl_mean']:.2e} / {f['attribution']['values_only']['kl_mean']:.2e}" for f in attributed) + "."]
        kl = {f["name"]: f["quality"]["kl_mean"] for f in r["formats"]}
        pairs = [(a, b) for a, b in RATIOS.get(name, []) if a in kl and b in kl]
        if pairs:
            out += ["", "KL mean ratios: " + "; ".join(f"{a} / {b} {kl[a] / kl[b]:.2g}x" for a, b in pairs) + "."]
        if r["export"]:
            out += ["", "Exported checkpoints read back and re-measured: " + "; ".join(
                f"{n} (from {e['validated_as']}) KL {e['remeasured']['remeasured_kl']:.2e} vs validated {e['remeasured']['validated_kl']:.2e} "
                f"({'within' if e['remeasured']['passed'] else 'OUTSIDE'} tolerance {e['remeasured']['tolerance']:.1e})" for n, e in r["export"].items()) + "."]
        if t:
            prof = "profiling included" if t.get("profile", 0) >= 1 else "kv_stats reused from the machine's cache"
            out += ["", "Stage times: " + ", ".join(f"{k} {v:.0f} s" for k, v in t.items()) + f", total {sum(t.values()):.0f} s (2 CPU cores; float weights already cached; {prof})."]
    out += ["", END]
    return "\n".join(out)


def load_results() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))}


def write_doc(results: dict[str, dict]) -> None:
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"make_results: {DOC.relative_to(ROOT)} has no results markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(head + render(results) + tail)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--render", action="store_true", help="only re-render docs/results.md from docs/results/*.json")
    ap.add_argument("--only", default=None, choices=list(COMMANDS), help="rerun only this one")
    a = ap.parse_args()
    if not a.render:
        from kvcompress.provenance import git_state

        check_checkout(*git_state())
        RESULTS.mkdir(parents=True, exist_ok=True)
        for name, cmd in COMMANDS.items():
            if a.only and name != a.only:
                continue
            out, tmp = RESULTS / f"{name}.json", RESULTS / f".{name}.json.tmp"
            tmp.write_text(json.dumps(run(name, cmd), indent=1) + "\n")
            tmp.replace(out)  # a run that fails or is interrupted leaves the previous result whole
    write_doc(load_results())
    print(f"[make_results] rendered {DOC} from {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
