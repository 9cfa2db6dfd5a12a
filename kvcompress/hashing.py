"""Content hashes for cache keys and provenance."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

MEMO_MIN = 1 << 30  # a file this large keeps its sha256 in the machine's cache (hashing it again reads it all)
LEGACY_EDGE_BYTES = 16 << 20  # fingerprints before whole-file hashing: size + first and last 16 MiB of a file over 1 GiB
FINGERPRINTED = ("*.json", "*.safetensors", "*.gguf", "*.model")  # a model directory's files that make its fingerprint
_HEX64 = re.compile(r"[0-9a-f]{64}")
_MEMO_ROOT: ContextVar[Path | None] = ContextVar("kvcompress_hash_memo_root", default=None)  # None: paths.default_cache_dir()


@contextmanager
def memo_under(cache_dir: str | Path):
    """Remember large files' hashes under `cache_dir`/hashes while inside (a run's cache_dir=, pipeline.run); outside, under
    the default cache directory ($KVCOMPRESS_CACHE, else ~/.cache/kvcompress)."""
    token = _MEMO_ROOT.set(Path(cache_dir))
    try:
        yield
    finally:
        _MEMO_ROOT.reset(token)


def _sha256(p: Path, size: int) -> str:
    h = hashlib.sha256()
    bar = None
    if size > MEMO_MIN:
        from tqdm.auto import tqdm

        bar = tqdm(total=size, unit="B", unit_scale=True, desc=f"sha256 {p.name}", leave=False)
    with p.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
            if bar is not None:
                bar.update(len(chunk))
    if bar is not None:
        bar.close()
    return h.hexdigest()


def _memo_path(p: Path, st: os.stat_result) -> Path:
    """Where the sha256 of a large file is remembered: keyed by its path, inode and size and its modification and change
    times (any write moves the change time, which no tool can set back), so a file rewritten in place is hashed again."""
    from kvcompress.paths import default_cache_dir

    key = obj_hash([str(p.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns])
    return (_MEMO_ROOT.get() or default_cache_dir()) / "hashes" / key[:32]


def file_fingerprint(path: str | Path) -> str:
    """sha256 of a file's bytes, all of them. A file over 1 GiB (a weight shard) is read once per machine: its hash is
    remembered under <cache>/hashes until the file changes (_memo_path; <cache>: memo_under's, else the default)."""
    p = Path(path)
    st = p.stat()
    if st.st_size <= MEMO_MIN:
        return _sha256(p, st.st_size)
    memo = _memo_path(p, st)
    try:
        known = memo.read_text().strip()
        if _HEX64.fullmatch(known):
            return known
    except OSError:
        pass
    digest = _sha256(p, st.st_size)
    if _memo_path(p, p.stat()) != memo:  # written to while it was read: the hash is of no one version, not remembered
        return digest
    try:  # a cache directory that cannot be written costs a re-read next time, nothing else
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        tmp.write_text(digest)
        tmp.replace(memo)
    except OSError:
        pass
    return digest


def dir_fingerprint(path: str | Path, patterns=FINGERPRINTED, file_hash=file_fingerprint) -> str:
    """Fingerprint of a model directory: its config/tokenizer/weight files, by name and content."""
    p = Path(path)
    h = hashlib.sha256()
    for pat in patterns:
        for f in sorted(p.glob(pat)):
            h.update(f.name.encode())
            h.update(file_hash(f).encode())
    return h.hexdigest()


def legacy_file_fingerprint(path: str | Path) -> str:
    """The fingerprint kvcompress gave a file before it hashed files whole (statistics and ScaleBooks made then carry it):
    the same for files up to 1 GiB; beyond, the sha256 of its size and first and last 16 MiB."""
    p = Path(path)
    size = p.stat().st_size
    if size <= MEMO_MIN:
        return file_fingerprint(p)
    h = hashlib.sha256()
    with p.open("rb") as f:
        h.update(str(size).encode())
        h.update(f.read(LEGACY_EDGE_BYTES))
        f.seek(size - LEGACY_EDGE_BYTES)
        h.update(f.read(LEGACY_EDGE_BYTES))
    return h.hexdigest()


def legacy_dir_fingerprint(path: str | Path) -> str:
    return dir_fingerprint(path, file_hash=legacy_file_fingerprint)


def has_large_files(path: str | Path) -> bool:
    """Whether a file, or a model directory's fingerprinted files, has one over 1 GiB (whose legacy fingerprint differs)."""
    p = Path(path)
    files = [p] if p.is_file() else [f for pat in FINGERPRINTED for f in p.glob(pat)] if p.is_dir() else []
    return any(f.stat().st_size > MEMO_MIN for f in files)


def path_fingerprint(path: str | Path) -> str:
    """Fingerprint of a model's files: a directory's (dir_fingerprint) or one file's (a GGUF; file_fingerprint)."""
    p = Path(path)
    return dir_fingerprint(p) if p.is_dir() else file_fingerprint(p)


def legacy_path_fingerprint(path: str | Path) -> str | None:
    """path_fingerprint as kvcompress computed it before it hashed files whole, when that differs (a file over 1 GiB); else None."""
    p = Path(path)
    if not has_large_files(p):
        return None
    return legacy_dir_fingerprint(p) if p.is_dir() else legacy_file_fingerprint(p)


def fingerprint_match(theirs: str | None, mine: str, legacy=None) -> str | None:
    """How a recorded model fingerprint (`theirs`) matches a model's: "whole" (equal to `mine`), "legacy" (equal to the old
    edge hash of the same files; `legacy` is a callable returning it or None, called only when needed), or None."""
    if theirs == mine:
        return "whole"
    if theirs and legacy is not None and theirs == legacy():
        return "legacy"
    return None


def warn_legacy(what: str, name: str) -> None:
    """The one warning for `what` (statistics, a ScaleBook) accepted for model `name` by its legacy fingerprint only."""
    logging.getLogger("kvcompress").warning(
        "%s was profiled by an older kvcompress, which fingerprinted weight files over 1 GiB by their size and first and last "
        "16 MiB; it matches model %s by that hash only (a change between a file's edges would not show): profile again to tie "
        "it to the whole files", what, name)


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def obj_hash(obj) -> str:
    """sha256 of a JSON-serialisable object (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()
