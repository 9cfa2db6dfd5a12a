"""Tokenizers behind one tiny protocol: encode(str) -> ids, decode(ids) -> str."""
from __future__ import annotations


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 0..255) plus BOS=256; used by the tiny in-code models."""

    vocab_size = 257
    bos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A transformers tokenizer, without special tokens added on encode."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)
