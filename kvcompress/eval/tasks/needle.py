"""Passkey retrieval and RULER-style multi-key needles with distractors."""
from __future__ import annotations

import random

from kvcompress.eval.tasks import TASKS
from kvcompress.eval.tasks.base import Sample, assemble, random_digits

WORDS = ["amber", "falcon", "harbor", "quartz", "meadow", "cobalt", "lantern", "orchid", "summit", "velvet", "ember", "glacier"]


@TASKS.register("passkey")
def passkey(tokenizer, corpus_ids, length, depth, seed, window) -> Sample:
    rng = random.Random(f"passkey-{length}-{depth}-{seed}")
    key = random_digits(rng, 6)
    fact = f"The pass key is {key}. Remember it. {key} is the pass key."
    return assemble(tokenizer, corpus_ids, length, depth, [fact], "\nWhat is the pass key? The pass key is", f" {key}", rng, window, "passkey", seed)


@TASKS.register("multikey")
def multikey(tokenizer, corpus_ids, length, depth, seed, window) -> Sample:
    rng = random.Random(f"multikey-{length}-{depth}-{seed}")
    names = rng.sample(WORDS, 4)
    values = [random_digits(rng, 6) for _ in names]
    facts = [f"The special magic number for {n} is: {v}." for n, v in zip(names, values)]
    rng.shuffle(facts)
    target = rng.randrange(len(names))
    q = f"\nWhat is the special magic number for {names[target]}? The special magic number for {names[target]} is:"
    return assemble(tokenizer, corpus_ids, length, depth, facts, q, f" {values[target]}", rng, window, "multikey", seed)
