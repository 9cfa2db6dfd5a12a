"""Clipping observers: KVStats (+ raw sample) -> a clipping ratio per layer x kv-head.

Statistics are collected by `profile`; observers only turn them into ranges. Each observer is
one file registered under the name `kv.key.clip` takes.
"""
from kvcompress.registry import Registry

OBSERVERS: Registry = Registry("kv.key.clip")

from kvcompress.observers import minmax, mse, percentile  # noqa: E402,F401

__all__ = ["OBSERVERS"]
