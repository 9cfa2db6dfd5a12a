"""The rerunnable scripts: a bad preset or result name is a one-line error with the allowed names, a
non-zero exit and no traceback, before any model loads or any file is written."""
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli_batch

ROOT = Path(__file__).resolve().parents[1]

BAD = [
    (["scripts/make_results.py", "--only", "nope"], "invalid choice: 'nope' (choose from 'default', 'long8k_all'"),
    (["scripts/compare_peers.py", "--model", "nope"], "model preset 'nope' does not exist; allowed: gemma3_270m, llama3_8b"),
    (["scripts/compare_peers.py", "--eval", "nope"], "eval preset 'nope' does not exist; allowed: default,"),
    (["scripts/bench_profile.py", "--calib", "nope"], "calib preset 'nope' does not exist; allowed: default,"),
    (["scripts/bench_onepass_vs_decode.py", "--kv", "nope"], "kv preset 'nope' does not exist; allowed: auto, fp16,"),
    (["scripts/compare_peers.py", "--pair-context", "-1"], "--pair-context -1: allowed: 0 (no extra row) or a context > 0"),
    (["scripts/pair_fold_anatomy.py", "--eval", "nope"], "eval preset 'nope' does not exist; allowed: default,"),
    (["scripts/pair_fold_anatomy.py", "--pair-context", "0"], "--pair-context 0: allowed: a context > 0"),
    (["scripts/bench_decode_attention.py", "--reps", "0"], "--reps 0: allowed: an integer >= 1"),
    (["scripts/compare_peers.py", "--windows", "0"], "argument --windows: '0' is not an integer >= 1"),  # counts and lengths: _common.positive
    (["scripts/compare_peers.py", "--passkey-len", "-4"], "argument --passkey-len: '-4' is not an integer >= 1"),
    (["scripts/bench_onepass_vs_decode.py", "--seq-len", "x"], "argument --seq-len: 'x' is not an integer >= 1"),
    (["scripts/check_cache_eval.py", "--windows", "0"], "argument --windows: '0' is not an integer >= 1"),
    (["scripts/bench_profile.py", "--repeats", "0"], "argument --repeats: '0' is not an integer >= 1"),
    (["scripts/bench_streaming.py", "--gb", "0"], "argument --gb: '0' is not a number > 0"),
    (["scripts/bench_tune.py", "--model", "nope"], "argument --model: invalid choice: 'nope' (choose from 'gemma3_270m'"),  # ran the CLI first
    (["scripts/make_text_corpus.py", "--out", "x"], "unrecognized arguments: --out x"),  # ignored: rewrote the shipped texts
    # bad input met while a script runs (a UserError) is one line, exit 2 (_common.run); a preset with a Hydra defaults list
    # (llama3_8b's calib=long) was a pydantic traceback, a model path that does not exist a UserError traceback
    (["scripts/compare_peers.py", "--model", "llama3_8b"], "model.path is required for model=llama3_8b"),
    (["scripts/bench_profile.py", "--model", "llama70b", "--model-path", "/nonexistent/model"],
     "model.path='/nonexistent/model' does not exist or is not a directory"),
    (["scripts/check_cache_eval.py", "/nonexistent/run"], "'/nonexistent/run' is not a validated run directory (missing report.json"),  # was exit 1
]


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory):
    """Every BAD case as `python SCRIPT ARGS` would run it, all for one interpreter start (conftest.run_cli_batch), with the
    modification times of README.md, docs/*.md and the results from before them."""
    before = {p: p.stat().st_mtime_ns for p in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "docs" / "results").glob("*.json")]}
    return run_cli_batch([(args, None) for args, _ in BAD], tmp_path_factory.mktemp("batch"), script="first"), before


def test_the_batched_script_runs_are_the_script_runs(bad_runs):
    """run_cli_batch gives what `python SCRIPT ARGS` gives for the first case: the same exit code, stdout and stderr."""
    real = subprocess.run([sys.executable, *BAD[0][0]], cwd=ROOT, capture_output=True, text=True, timeout=120)
    p = bad_runs[0][0]
    assert (real.returncode, real.stdout, real.stderr) == (p.returncode, p.stdout, p.stderr)


@pytest.mark.parametrize("i", range(len(BAD)), ids=[" ".join(a) for a, _ in BAD])
def test_script_bad_name_is_one_line(bad_runs, i):
    needle = BAD[i][1]
    runs, before = bad_runs
    p = runs[i]
    assert p.returncode == 2, p.stderr
    errors = [line for line in p.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and needle in errors[0], p.stderr
    assert "Traceback" not in p.stderr and "Loading weights" not in p.stderr
    assert before == {p: p.stat().st_mtime_ns for p in before}


def test_pair_fold_anatomy_runs_on_the_tiny_model():
    """scripts/pair_fold_anatomy.py: the energy table covers every pair once, and every checkpoint is scored."""
    p = subprocess.run([sys.executable, "scripts/pair_fold_anatomy.py", "--model", "tiny_llama", "--calib", "smoke", "--eval", "smoke",
                        "--pair-context", "4096"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    energy = [line.split() for line in lines[2:6]]
    assert [e[0] for e in energy] == ["0-3", "4-7", "8-11", "12-15"]
    assert abs(sum(float(e[1]) for e in energy) - 1) < 0.01 and all(0 <= float(e[2]) <= 1 for e in energy)
    rows = [line for line in lines if line.endswith("x") and "%" in line]
    assert len(rows) == 7 and rows[0].startswith("default (pair_context=0)") and rows[0].endswith(" 1.00x")
    assert any(r.startswith("pair_context=4096") for r in rows) and any(r.startswith("default, pairs 12-15 as 4096") for r in rows)


def test_make_text_corpus_regenerates_the_committed_text_byte_for_byte(tmp_path, monkeypatch):
    """scripts/make_text_corpus.py (README: it regenerates both splits) writes exactly the committed files."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import make_text_corpus
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    monkeypatch.setattr(make_text_corpus, "OUT", tmp_path)
    make_text_corpus.main()
    for name in ("calib.txt", "heldout.txt"):
        assert (tmp_path / name).read_bytes() == (ROOT / "kvcompress" / "data" / "text" / name).read_bytes(), name


def test_check_cache_eval_reloads_the_runs_own_model(tmp_path):
    """scripts/check_cache_eval.py on a run of a model given by model.path (not a preset): it reloads that model from
    the run's resolved config and decodes through the real CompressedCache beside report.json. A directory that is not
    a validated run is one line and a non-zero exit."""
    from conftest import run_cli
    from test_export import _hf_dir

    run = tmp_path / "run"
    p = run_cli("model=llama3_8b", f"model.path={_hf_dir(tmp_path, 'llama')}", "model.name=hf_dir", "model.device=cpu", "model.dtype=float32",
                "calib=smoke", "eval=smoke", "export=none", "kv.window=8", "kv.sink_tokens=2", f"hydra.run.dir={run}",
                cache_dir=tmp_path / "cache", timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    p = subprocess.run([sys.executable, "scripts/check_cache_eval.py", str(run), "--windows", "1", "--seq-len", "40"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env={**__import__("os").environ, "KVCOMPRESS_CACHE": str(tmp_path / "cache")})
    assert p.returncode == 0, p.stderr[-3000:]
    kl = next(line for line in p.stdout.splitlines() if line.startswith("KL mean"))
    assert float(kl.split()[-1]) > 0 and "tokens: report" in p.stdout
    p = subprocess.run([sys.executable, "scripts/check_cache_eval.py", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "is not a validated run directory" in p.stderr and "Traceback" not in p.stderr
