"""Variable tracking: a chain of assignments spread through the context (RULER-style)."""
from __future__ import annotations

import random

from kvcompress.eval.tasks import TASKS
from kvcompress.eval.tasks.base import Sample, assemble, random_digits


@TASKS.register("vartrack")
def vartrack(tokenizer, corpus_ids, length, depth, seed, window) -> Sample:
    rng = random.Random(f"vartrack-{length}-{depth}-{seed}")
    value = random_digits(rng, 5)
    names = [f"V{rng.randrange(100, 999)}" for _ in range(4)]
    facts = [f"VAR {names[0]} = {value}"] + [f"VAR {names[i]} = {names[i - 1]}" for i in range(1, len(names))]
    q = f"\nQuestion: what number does VAR {names[-1]} hold? Follow the assignments. Answer: VAR {names[-1]} ="
    return assemble(tokenizer, corpus_ids, length, depth, facts, q, f" {value}", rng, window, "vartrack", seed)
