"""Generated long-context tasks (no downloads): one registry, one file per task family.

A task builder returns a `Sample`: prompt tokens (haystack of real held-out text with the facts
placed at a depth) and the answer tokens. Facts are always placed before the fp16 window of the
last query, so they are read from the compressed store.
"""
from kvcompress.registry import Registry

TASKS: Registry = Registry("eval.tasks.names")

from kvcompress.eval.tasks import copy_ids, needle, vartrack  # noqa: E402,F401

__all__ = ["TASKS"]
