"""The rerunnable scripts: a bad preset or result name is a one-line error with the allowed names, a
non-zero exit and no traceback, before any model loads or any file is written."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

BAD = [
    (["scripts/make_results.py", "--only", "nope"], "invalid choice: 'nope' (choose from 'default', 'long8k_all'"),
    (["scripts/compare_peers.py", "--model", "nope"], "model preset 'nope' does not exist; allowed: gemma3_270m, llama3_8b"),
    (["scripts/compare_peers.py", "--eval", "nope"], "eval preset 'nope' does not exist; allowed: default,"),
    (["scripts/bench_profile.py", "--calib", "nope"], "calib preset 'nope' does not exist; allowed: default,"),
    (["scripts/bench_onepass_vs_decode.py", "--kv", "nope"], "kv preset 'nope' does not exist; allowed: auto, fp16,"),
]


@pytest.mark.parametrize("args,needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_script_bad_name_is_one_line(args, needle):
    before = {p: p.stat().st_mtime_ns for p in [ROOT / "README.md", *(ROOT / "docs" / "results").glob("*.json")]}
    p = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    errors = [line for line in p.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and needle in errors[0], p.stderr
    assert "Traceback" not in p.stderr and "Loading weights" not in p.stderr
    assert before == {p: p.stat().st_mtime_ns for p in before}
