"""Provenance recorded in every artifact and run directory."""
from __future__ import annotations

import importlib.metadata as md
import os
import platform
import functools
import subprocess
from datetime import datetime, timezone
from pathlib import Path

PACKAGES = ("kvcompress", "torch", "transformers", "safetensors", "gguf", "hydra-core", "pydantic", "triton")


def package_versions() -> dict[str, str | None]:
    out = {}
    for p in PACKAGES:
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            out[p] = None
    return out


@functools.lru_cache(maxsize=4)
def git_state(root: Path | None = None) -> tuple[str | None, tuple[str, ...]]:
    """(commit, tracked paths with local changes) of the kvcompress checkout (or of `root`); (None, ()) outside a git
    checkout. Read once per process, so a run records the code it started with even if the checkout moves while it runs."""
    root = root or Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if sha.returncode:
            return None, ()
        changed = subprocess.run(["git", "diff", "--name-only", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        return sha.stdout.strip(), tuple(sorted(line for line in changed.stdout.splitlines() if line.strip()))
    except (OSError, subprocess.TimeoutExpired):
        return None, ()


@functools.lru_cache(maxsize=1)
def git_sha() -> str | None:
    """The commit of the kvcompress checkout (with '-dirty' when tracked files have local changes), if any."""
    sha, changes = git_state()
    return sha and sha + ("-dirty" if changes else "")


def git_changes(limit: int = 50) -> list[str]:
    """The tracked paths whose local changes '-dirty' stands for (the first `limit`, then a count of the rest), so a
    reader can tell code edits from, say, a results file an earlier run wrote into the same checkout."""
    changes = list(git_state()[1])
    return changes[:limit] + ([f"... and {len(changes) - limit} more"] if len(changes) > limit else [])


@functools.lru_cache(maxsize=1)
def machine() -> dict:
    """The CPU a run computed on: float32 GEMMs round differently across CPUs (PyTorch picks kernels by
    the instruction set), which moves rounding ties of the quantized K/V and so the metrics' last digits."""
    import torch

    name = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"arch": platform.machine(), "cpu": name or platform.processor() or None, "cores": os.cpu_count(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}


def base_provenance() -> dict:
    return {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": package_versions(),
        "python": platform.python_version(),
        "git_sha": git_sha(),
        "git_changes": git_changes(),
        "machine": machine(),
    }
