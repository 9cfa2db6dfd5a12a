"""The code passes the project's linter (ruff, configured in pyproject.toml): unused and undefined names,
syntax errors, ambiguous names and bugbear's likely bugs (e.g. a closure binding a loop variable late)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
                        "kvcompress", "scripts", "tests", "export", "plugins"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_catches_an_unused_import(tmp_path):
    # the check can fail: the same configuration flags a planted defect
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\n\ndef f():\n    return [lambda: i for i in range(3)]\n")
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"),
                        "--output-format", "concise", str(bad)], capture_output=True, text=True)
    assert r.returncode == 1 and "F401" in r.stdout and "B023" in r.stdout, r.stdout + r.stderr
