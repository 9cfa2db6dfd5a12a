"""Exact reproduction of identifiers, numbers and JSON that appeared far back in the context."""
from __future__ import annotations

import json
import random
import uuid

from kvcompress.eval.tasks import TASKS
from kvcompress.eval.tasks.base import Sample, assemble, random_digits


@TASKS.register("copy_uuid")
def copy_uuid(tokenizer, corpus_ids, length, depth, seed, window) -> Sample:
    rng = random.Random(f"copy_uuid-{length}-{depth}-{seed}")
    ident = str(uuid.UUID(int=rng.getrandbits(128)))
    fact = f"Record id: {ident}."
    return assemble(tokenizer, corpus_ids, length, depth, [fact], "\nRepeat the record id exactly. Record id:", f" {ident}", rng, window, "copy_uuid", seed)


@TASKS.register("copy_json")
def copy_json(tokenizer, corpus_ids, length, depth, seed, window) -> Sample:
    rng = random.Random(f"copy_json-{length}-{depth}-{seed}")
    rec = {"id": int(random_digits(rng, 5)), "sku": f"X{random_digits(rng, 4)}-{rng.choice('ABCDEF')}", "price": float(f"{rng.randrange(1, 999)}.{random_digits(rng, 2)}")}
    text = json.dumps(rec)
    fact = f"Config line: {text}"
    return assemble(tokenizer, corpus_ids, length, depth, [fact], "\nCopy the config line exactly. Config line:", f" {text}", rng, window, "copy_json", seed)
