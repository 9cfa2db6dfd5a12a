"""Shared pieces: samples, haystacks of real text, placing facts at a depth outside the window."""
from __future__ import annotations

import random
from dataclasses import dataclass

from kvcompress.errors import UserError

FACT_GAP = 16  # tokens between the facts' end and the fp16 window


@dataclass(frozen=True)
class Sample:
    task: str
    length: int
    depth: float
    seed: int
    prompt: list[int]
    answer: list[int]
    needle_pos: int  # token index where the first fact starts


def haystack(tokenizer, corpus_ids: list[int], n: int, rng: random.Random) -> list[int]:
    """n tokens of real held-out text from a random offset (wrapping)."""
    start = rng.randrange(len(corpus_ids))
    return [corpus_ids[(start + i) % len(corpus_ids)] for i in range(n)]


def assemble(tokenizer, corpus_ids, length, depth, facts: list[str], question: str, answer: str, rng, window: int, task: str, seed: int) -> Sample:
    """Haystack with facts inserted at `depth` (fraction of the haystack), then the question: `length` tokens fed to the
    model with the answer but its last token (which is only predicted), so no answer token is scored at a position
    past a context of `length` (eval=long's 8192 on an 8192-token model).

    The facts end at least `window` + FACT_GAP tokens before the last prompt token, so the last query reads
    them from the compressed store, never from the fp16 window; a length too short for that is refused.
    """
    fact_ids = [tokenizer.encode(" " + f + " ") for f in facts]
    q_ids = tokenizer.encode(question)
    a_ids = tokenizer.encode(answer)
    body = length - len(q_ids) - sum(map(len, fact_ids)) - (len(a_ids) - 1)
    latest = body - window - FACT_GAP - sum(map(len, fact_ids))
    if latest < 0:  # the facts would sit in the fp16 window: the sample would not test the compressed store
        raise UserError(f"eval.tasks.lengths contains {length}: a {task} sample needs at least {length - latest} tokens (prompt and answer) so its facts "
                        f"end {window} + {FACT_GAP} tokens before the question, outside the fp16 window")
    hay = haystack(tokenizer, corpus_ids, body, rng)
    pos = max(0, min(int(depth * body), latest))
    # spread several facts over [pos, latest]
    cuts = sorted({pos + int(i * max(0, latest - pos) / max(1, len(fact_ids))) for i in range(len(fact_ids))})
    while len(cuts) < len(fact_ids):
        cuts.append(cuts[-1])
    prompt, last = [], 0
    for cut, f in zip(cuts, fact_ids):
        prompt += hay[last:cut] + f
        last = cut
    prompt += hay[last:] + q_ids
    return Sample(task, length, depth, seed, prompt, a_ids, cuts[0])


def random_digits(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(n))
