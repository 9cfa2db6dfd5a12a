"""Content hashes for cache keys and provenance."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

FULL_HASH_LIMIT = 1 << 30  # files up to 1 GiB are hashed whole
EDGE_BYTES = 16 << 20  # larger files: size + first and last 16 MiB
FINGERPRINTED = ("*.json", "*.safetensors", "*.gguf", "*.model")  # a model directory's files that make its fingerprint


def file_fingerprint(path: str | Path) -> str:
    """sha256 of a file (whole up to 1 GiB; beyond that of its size and first/last 16 MiB)."""
    p = Path(path)
    h = hashlib.sha256()
    size = p.stat().st_size
    with p.open("rb") as f:
        if size <= FULL_HASH_LIMIT:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        else:
            h.update(str(size).encode())
            h.update(f.read(EDGE_BYTES))
            f.seek(size - EDGE_BYTES)
            h.update(f.read(EDGE_BYTES))
    return h.hexdigest()


def edge_hashed_stats(path: str | Path | None) -> list[list]:
    """[name, size, mtime_ns] of each file under `path` (a file, or a model directory's weight files) that
    file_fingerprint hashes by its edges only (over 1 GiB). A per-machine cache key adds them: a checkpoint rewritten in
    place whose changed bytes all sit between the edges (a fine-tune merged into some projections of a large shard) keeps
    its fingerprint, and its cached statistics or converted weights would be reused. Not part of the fingerprint itself,
    which must stay the same for a copy of the model on another machine (stats= and ScaleBooks are checked against it)."""
    if not path:
        return []
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for pat in FINGERPRINTED for f in p.glob(pat)) if p.is_dir() else []
    return [[f.name, st.st_size, st.st_mtime_ns] for f in files if (st := f.stat()).st_size > FULL_HASH_LIMIT]


def dir_fingerprint(path: str | Path, patterns=FINGERPRINTED) -> str:
    """Fingerprint of a model directory: its config/tokenizer/weight files, by name and content."""
    p = Path(path)
    h = hashlib.sha256()
    for pat in patterns:
        for f in sorted(p.glob(pat)):
            h.update(f.name.encode())
            h.update(file_fingerprint(f).encode())
    return h.hexdigest()


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def obj_hash(obj) -> str:
    """sha256 of a JSON-serialisable object (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()
