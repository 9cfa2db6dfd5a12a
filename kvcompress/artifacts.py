"""Versioned artifacts: safetensors tensors + a JSON header (in the safetensors metadata).

Written atomically (temp name in the same directory, then rename). Never pickles.
"""
from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvcompress.errors import ArtifactError

HEADER_KEY = "kvcompress"


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n").encode())


@contextmanager
def uninterruptible():
    """Ignore further Ctrl-C while cleaning up after an interrupt (a second one must not leave half a temp dir)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def save_artifact(path: str | Path, tensors: dict[str, torch.Tensor], header: dict) -> None:
    """Write tensors + header atomically. header must hold `kind` and `format_version`."""
    _atomic_safetensors(path, tensors, {HEADER_KEY: json.dumps(header, default=str)})


def load_artifact(path: str | Path, kind: str, versions: tuple[int, ...]) -> tuple[dict[str, torch.Tensor], dict]:
    """Read an artifact; refuse a different kind or an unknown format_version with a clear error."""
    path = Path(path)
    if path.is_dir():
        raise ArtifactError(f"{kind} artifact {str(path)!r} is a directory; give the .safetensors file in it")
    if not path.is_file():
        raise ArtifactError(f"{kind} artifact {str(path)!r} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises several types for a corrupt file
        raise ArtifactError(f"{str(path)!r} is not a readable safetensors file ({type(e).__name__})") from None
    if HEADER_KEY not in meta:
        raise ArtifactError(f"{str(path)!r} has no kvcompress header; it was not written by kvcompress")
    try:
        header = json.loads(meta[HEADER_KEY])
    except json.JSONDecodeError:
        header = None
    if not isinstance(header, dict):
        raise ArtifactError(f"{str(path)!r} has a kvcompress header that is not a JSON object; the file is damaged")
    if header.get("kind") != kind:
        raise ArtifactError(f"{str(path)!r} is a {header.get('kind')!r} artifact, expected {kind!r}")
    if header.get("format_version") not in versions:
        raise ArtifactError(
            f"{str(path)!r} has format_version={header.get('format_version')!r}; this kvcompress reads {', '.join(map(str, versions))}"
        )
    return tensors, header


def save_plain_safetensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """A plain safetensors file for other tools (no kvcompress header), written atomically."""
    _atomic_safetensors(path, tensors, {"format": "pt", **(metadata or {})})


def _atomic_safetensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        # clone: tensors that share storage (e.g. one `ones` reused) cannot be saved as views
        save_file({k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
