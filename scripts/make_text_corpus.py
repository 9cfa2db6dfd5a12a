"""Regenerate kvcompress/data/text/{calib,heldout}.txt from CPython's language reference.

The text is the prose of the Python Language Reference and Library topics as shipped in
CPython's `pydoc_data.topics` (PSF License). Topics are assigned to the calibration or the
held-out split by position in sorted order (every third topic is held out), so the two never
share a passage. Run with the Python the files were made with (3.11) to reproduce them byte for byte.

    python scripts/make_text_corpus.py
"""
from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import pydoc_data.topics as topics

OUT = Path(__file__).resolve().parents[1] / "kvcompress" / "data" / "text"


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # no options: the files' place is fixed (OUT)
    names = sorted(topics.topics)
    calib = [topics.topics[n].strip() for i, n in enumerate(names) if i % 3 != 2]
    held = [topics.topics[n].strip() for i, n in enumerate(names) if i % 3 == 2]
    OUT.mkdir(parents=True, exist_ok=True)
    for name, parts in (("calib.txt", calib), ("heldout.txt", held)):
        text = "\n\n\n".join(parts) + "\n"
        (OUT / name).write_text(text, encoding="utf-8")
        print(f"{name}: {len(parts)} topics, {len(text)} chars, sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}")
    print(f"made with Python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
