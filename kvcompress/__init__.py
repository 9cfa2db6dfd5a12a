"""kvcompress: calibrate, validate and export compressed KV caches for LLM serving.

    from kvcompress import ScaleBook, CompressedCache
    book = ScaleBook.load("runs/<model>/<kv>/<time>/scalebook.safetensors")
    out = model.generate(ids, cache=CompressedCache(book), max_new_tokens=64)
"""
from kvcompress.cache import CompressedCache
from kvcompress.scalebook import ScaleBook
from kvcompress.spec import KeySpec, KVSpec, ValueSpec
from kvcompress.stats import KVStats

__all__ = ["CompressedCache", "ScaleBook", "KVSpec", "KeySpec", "ValueSpec", "KVStats"]
