"""Tasks, gates, verdict, and the HTML report opened in headless Chromium."""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import run_cli, tiny_lm
from kvcompress.config import Gate
from kvcompress.data import load_texts
from kvcompress.config import EvalConfig
from kvcompress.eval.gates import evaluate_gates
from kvcompress.eval.tasks import TASKS

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.parametrize("name", ["passkey", "multikey", "vartrack", "copy_uuid", "copy_json"])
@pytest.mark.parametrize("depth", [0.1, 0.9])
def test_facts_are_placed_outside_the_window(name, depth):
    lm = tiny_lm()
    corpus = lm.tokenizer.encode(load_texts(EvalConfig(name="t")).texts[0][:20000])
    s = TASKS.get(name)(lm.tokenizer, corpus, 1500, depth, 0, 128)
    assert abs(len(s.prompt) - 1500) < 60 and s.answer
    # the first fact starts before the last query's fp16 window (and the answer text occurs in the prompt for retrieval)
    assert len(s.prompt) - s.needle_pos > 128 + 16
    if name != "vartrack":
        assert lm.tokenizer.decode(s.answer).strip() in lm.tokenizer.decode(s.prompt)
    again = TASKS.get(name)(lm.tokenizer, corpus, 1500, depth, 0, 128)
    assert again.prompt == s.prompt  # deterministic per (length, depth, seed)


def _tasks(base, comp, n_ret=None):
    from kvcompress.eval.intervals import paired_drop

    return {"retrieval": {"n": len(base), "drop": paired_drop(base, comp)}, "exact_copy": None}


def test_gates_pass_fail_inconclusive_and_not_measured():
    quality = {"ppl_delta_rel": 0.02, "kl_mean": 0.001, "kl_p99": 0.01, "top1_agree": 0.99}
    kl, drop, copy = Gate(name="kl_mean", max=0.01), Gate(name="retrieval_drop", max=0.1), Gate(name="exact_match_drop", max=0.1)
    # 60 paired samples, compressed wrong on 30 that fp16 got right: a clear failure
    res, verdict, basis = evaluate_gates([kl, drop], quality, _tasks([True] * 60, [True] * 30 + [False] * 30))
    assert [g.status for g in res] == ["pass", "fail"] and verdict == "fail" and abs(res[1].value - 0.5) < 1e-12
    assert res[1].ci_low > 0.1 and res[1].n == 60
    # 60 samples, no discordant pair: the upper end of the interval is below 0.1 -> pass
    res, verdict, _ = evaluate_gates([drop], quality, _tasks([True] * 30 + [False] * 30, [True] * 30 + [False] * 30))
    assert res[0].status == "pass" and res[0].ci_high < 0.1 and verdict == "pass"
    # 8 samples, one discordant: the interval straddles 0.1 -> inconclusive, never pass
    res, verdict, _ = evaluate_gates([drop], quality, _tasks([True] * 8, [True] * 7 + [False]))
    assert res[0].status == "inconclusive" and res[0].ci_low < 0.1 < res[0].ci_high and verdict == "inconclusive"
    # compressed better than fp16 on a sample: the drop is negative, not a reason to fail
    res, _, _ = evaluate_gates([drop], quality, _tasks([False] + [True] * 59, [True] * 60))
    assert res[0].value < 0 and res[0].status == "pass"
    # tasks not run: "not measured", and the verdict rests on the measured gates only
    res, verdict, basis = evaluate_gates([kl, copy], quality, None)
    assert res[1].status == "not measured" and res[1].value is None and verdict == "pass" and basis == ["kl_mean"]
    assert evaluate_gates([], quality, None)[1] == "pass"


def test_skipping_tasks_does_not_turn_the_verdict_into_fail(tmp_path):
    run = tmp_path / "r"
    p = run_cli("model=tiny_llama", "calib=smoke", "eval=smoke", "export=none", "eval.tasks.names=[]",
                "+eval.gates=[{name: kl_mean, max: 1.0}, {name: retrieval_drop, max: 0.1}]", f"hydra.run.dir={run}", cache_dir=tmp_path / "c")
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads((run / "report.json").read_text())
    assert r["verdict"] == "pass" and r["verdict_basis"] == ["kl_mean"]
    assert [g["status"] for g in r["gates"]] == ["pass", "not measured"]
    assert any("not measured" in n for n in r["notes"])
    # the memory line compares with the fp16 cache a server would hold (2 bytes per element), not the baseline's compute dtype
    m, g = r["memory"], r["model"]["geometry"]
    md = (run / "report.md").read_text()
    fp16 = 2 * 2 * g["n_layers"] * g["n_kv_heads"] * g["head_dim"]
    assert m["bytes_per_token_fp16"] == fp16 and f"tokens: fp16 cache {fp16}, compressed" in md, (m, g)


def test_fail_on_gate_exits_nonzero_and_report_says_fail(tmp_path):
    run = tmp_path / "r"
    p = run_cli("model=tiny_llama", "calib=smoke", "eval=smoke", "kv.window=0", "+eval.gates=[{name: kl_mean, max: 0.0}]",
                "eval.fail_on_gate=true", "eval.tasks.lengths=[300,400]", f"hydra.run.dir={run}", cache_dir=tmp_path / "c")
    assert p.returncode == 2 and "gates failed or inconclusive: kl_mean" in p.stderr
    r = json.loads((run / "report.json").read_text())
    assert r["verdict"] == "fail" and r["gates"][0]["status"] == "fail"
    md = (run / "report.md").read_text()
    assert md.count("Verdict (int8k_asym_rotv): FAIL") == 1
    # task accuracy per eval.tasks.lengths, under the pooled rows
    by_len = r["tasks"]["retrieval"]["by_length"]
    assert [b["length"] for b in by_len] == [300, 400] and sum(b["n"] for b in by_len) == r["tasks"]["retrieval"]["n"]
    assert f"|   retrieval exact at 300 tokens (n={by_len[0]['n']}) | {by_len[0]['fp16']:.2f} | {by_len[0]['compressed']:.2f} |" in md, md
    assert "exact copy at 400 tokens" in md
    assert not (run / "export").exists()  # a failed release is not exported


def test_html_report_loads_in_headless_chromium(tmp_path):
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing in CI: .ci/run must install Debian's chromium")
        pytest.skip("chromium not installed (Debian package chromium; .ci/run installs it)")
    run = tmp_path / "r"
    p = run_cli("model=tiny_llama", "calib=smoke", "eval=smoke", "export.archs=[sm_90]", f"hydra.run.dir={run}", cache_dir=tmp_path / "c")
    assert p.returncode == 0, p.stderr[-2000:]
    page = run / "report.html"
    html_text = page.read_text()
    head = html_text.split("<pre>")[0]  # before the provenance dump
    assert "<script" not in head and "http" not in head and "src=" not in head  # self-contained, opens offline
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "Verdict: PASS" in dom.stdout and "<svg" in dom.stdout and "Quality" in dom.stdout
    assert "native tier: native_int8" in dom.stdout and "check that ran in this export" in dom.stdout and "Stage times" in dom.stdout
    shot = subprocess.run([CHROMIUM, *flags, f"--screenshot={tmp_path / 'shot.png'}", "--window-size=1200,1600", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert shot.returncode == 0 and (tmp_path / "shot.png").stat().st_size > 10_000


def test_sweep_and_summary(tmp_path):
    """Hydra multirun over kv configs, then the summary names the most aggressive passing config."""
    sweep = tmp_path / "sweep"
    p = run_cli("-m", "model=tiny_llama", "calib=smoke", "eval=smoke", "export=none", "kv=int8,int4", "+eval.gates=[{name: kl_mean, max: 1.0}]",
                f"hydra.sweep.dir={sweep}", cache_dir=tmp_path / "c", timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert len(list(sweep.rglob("report.json"))) == 2
    from kvcompress.summary import best, collect

    rows = collect(sweep, "tiny_llama")
    assert {r["kv"] for r in rows} == {"int8", "int4"}
    assert best(rows)["kv"] == "int4"  # fewer bytes, and the (loose) gate passes
    assert all(r["kv_overrides"] == "" for r in rows)  # kv=int8 is the preset, not a kv.* setting
    # jobs of one preset (a sweep of kv.window) share their kv name: the row names the kv.* overrides from Hydra's record
    int4 = next(r for r in rows if r["kv"] == "int4")
    record = Path(int4["run"]) / ".hydra" / "overrides.yaml"
    record.write_text(record.read_text() + "- kv.window=64\n- +kv.key.rotate=hadamard\n")
    assert next(r for r in collect(sweep, "tiny_llama") if r["kv"] == "int4")["kv_overrides"] == "kv.window=64 +kv.key.rotate=hadamard"
    out = subprocess.run([__import__("sys").executable, "-m", "kvcompress.summary", str(sweep)], capture_output=True, text=True)
    assert out.returncode == 0 and "most aggressive config passing every gate: int4 kv.window=64 +kv.key.rotate=hadamard (" in out.stdout, out.stdout
    assert f"{int4['run']}  (kv.window=64 +kv.key.rotate=hadamard)" in out.stdout
    # a report.json that is not JSON, or JSON of another shape, is skipped and named (it was a traceback); the table stays
    (sweep / "broken").mkdir()
    (sweep / "broken" / "report.json").write_text("{not json")
    (sweep / "other").mkdir()
    (sweep / "other" / "report.json").write_text('{"model": {"name": "tiny_llama"}}')
    out = subprocess.run([__import__("sys").executable, "-m", "kvcompress.summary", str(sweep)], capture_output=True, text=True)
    assert out.returncode == 0 and "most aggressive config passing every gate: int4" in out.stdout and "Traceback" not in out.stderr, out.stderr
    skipped = out.stderr.strip().splitlines()
    assert len(skipped) == 2 and all(line.startswith("kvcompress: skipped ") and "not a kvcompress report" in line for line in skipped), skipped


def test_a_run_records_the_commit_it_started_with():
    """git_sha is read once per process: a checkout that moves during a long run does not relabel its results."""
    from kvcompress import provenance

    provenance.git_sha.cache_clear()
    first = provenance.git_sha()
    assert provenance.git_sha() == first and provenance.git_sha.cache_info().hits >= 1


def test_provenance_names_the_uncommitted_changes_behind_dirty(tmp_path):
    """git_state lists the tracked files with local changes (staged or not; untracked files are not the code's state)."""
    import subprocess

    from kvcompress import provenance

    def git(*a):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.md").write_text("b\n")
    git("add", ".")
    git("commit", "-q", "-m", "c")
    sha, changes = provenance.git_state(tmp_path)
    assert len(sha) == 40 and changes == ()
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "b.md").write_text("c\n")
    git("add", "b.md")
    (tmp_path / "new.txt").write_text("untracked")
    provenance.git_state.cache_clear()
    assert provenance.git_state(tmp_path) == (sha, ("a.py", "b.md"))
    provenance.git_state.cache_clear()
    assert provenance.git_state(tmp_path / "not_a_repo_child") == (None, ())  # not a directory git can enter
    provenance.git_state.cache_clear()
