"""Calibration / evaluation text: the built-in corpus or the user's own files."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kvcompress.errors import UserError
from kvcompress.hashing import text_hash

TEXT_DIR = Path(__file__).parent / "text"
SUFFIXES = (".txt", ".jsonl", "")  # "": a file without a suffix (LICENSE, README) is plain text, as .txt


@dataclass(frozen=True)
class TextSet:
    texts: list[str]
    sha256: str  # of the concatenated text actually used
    origin: str  # builtin:<split> or the file list
    group: str = "calib"  # the config group it came from (calib or eval), named in errors


def _read_file(path: Path, field: str, group: str) -> list[str]:
    if path.suffix not in SUFFIXES:
        raise UserError(f"{group}.paths entry {str(path)!r} has suffix {path.suffix!r}; allowed: .txt, .jsonl, or none (plain text)")
    if path.is_dir():
        raise UserError(f"{group}.paths entry {str(path)!r} is a directory; give its files (.txt, .jsonl or plain text)")
    if not path.is_file():
        raise UserError(f"{group}.paths entry {str(path)!r} does not exist")
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{group}.paths entry {str(path)!r} is not UTF-8 text (byte {e.start}: {e.reason}); allowed: UTF-8 text or JSON lines") from None
    except OSError as e:
        raise UserError(f"{group}.paths entry {str(path)!r} cannot be read ({e.strerror})") from None
    if path.suffix != ".jsonl":
        return [raw]
    out = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{path}:{n} is not valid JSON") from None
        if not isinstance(rec, dict) or not isinstance(rec.get(field), str):
            raise UserError(f"{path}:{n} has no string field {field!r} (set {group}.jsonl_field)")
        out.append(rec[field])
    return out


EVAL_IS_CALIB = "eval text is the calibration text; validation needs held-out text (eval.split=heldout or other eval.paths)"


def load_texts(cfg, group: str = "calib") -> TextSet:
    """Texts of a CalibConfig or EvalConfig (source=builtin: the shipped corpus split; files: <group>.paths);
    group names the config group in errors."""
    if cfg.source == "builtin":
        texts = [(TEXT_DIR / f"{cfg.split}.txt").read_text(encoding="utf-8")]
        origin = f"builtin:{cfg.split}"
    else:
        if not cfg.paths:
            raise UserError(f"{group}.paths is empty; give {group}.paths=[a.txt,b.jsonl]")
        texts = [t for p in cfg.paths for t in _read_file(Path(p), cfg.jsonl_field, group)]
        origin = ",".join(cfg.paths)
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise UserError(f"{group} text {origin!r} has no text")
    return TextSet(texts, text_hash("\x00".join(texts)), origin, group)


def overlap_note(n_tokens: int, n: int, seq_len: int, group: str) -> str | None:
    """When n windows of seq_len tokens cannot all be disjoint in a text of n_tokens (token_windows then overlaps them,
    evenly spread), what the numbers then count: some tokens more than once."""
    if n * seq_len <= n_tokens:
        return None
    return (f"{group}: {n} windows of {seq_len} tokens overlap (the text has {n_tokens} tokens, fewer than {n * seq_len}): some tokens "
            f"are counted more than once; give more text ({group}.paths) or fewer windows ({group}.n_windows)")


def text_ids(tokenizer, texts: TextSet) -> list[int]:
    """The token ids of the texts, concatenated (what token_windows cuts windows from and the tasks' haystacks come from)."""
    return [i for t in texts.texts for i in tokenizer.encode(t)]


def token_windows(tokenizer, texts: TextSet, n: int, seq_len: int, seed: int = 0, bos: int | None = None,
                  ids: list[int] | None = None) -> torch.Tensor:
    """n windows of seq_len tokens from the concatenated texts, evenly spread: LongTensor [n, seq_len].

    With `bos`, each window starts with that token followed by seq_len - 1 text tokens. `ids`: text_ids(tokenizer, texts)
    when the caller has them already.
    """
    ids = text_ids(tokenizer, texts) if ids is None else ids
    body = seq_len - (bos is not None)
    if len(ids) < body:
        raise UserError(f"{texts.group} text {texts.origin!r} has {len(ids)} tokens; windows of {seq_len} tokens need at least {body}")
    g = torch.Generator().manual_seed(seed)
    span = len(ids) - body
    starts = torch.linspace(0, span, n).long() if n > 1 else torch.zeros(1, dtype=torch.long)
    jitter = torch.randint(0, max(1, span // (4 * n) + 1), (n,), generator=g)
    starts = (starts + jitter).clamp(max=span)
    t = torch.tensor(ids, dtype=torch.long)
    out = torch.stack([t[s : s + body] for s in starts.tolist()])
    if bos is not None:
        out = torch.cat([torch.full((n, 1), bos, dtype=torch.long), out], dim=1)
    return out
