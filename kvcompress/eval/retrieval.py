"""Generated long-context tasks, fp16 vs each validated format, in the serving engines' semantics.

Context-phase semantics (as TensorRT-LLM and every serving engine run a request): the prompt is
prefilled in one chunk that attends exactly within itself, its K/V are stored in the compressed
cache, and the answer is decoded token by token over that cache. The first answer token comes
from the prefill (exact by construction); every later answer token reads the compressed prompt.

Teacher-forced scoring (answer log-probability; exact match = the argmax is the answer at every
answer position, which is exactly when greedy decoding reproduces the answer) shares one fp16
forward per sample across all formats: the prompt K/V are captured once and stored into each
format's cache. A few samples are also generated greedily through the real `CompressedCache`
from the raw prompt, as an independent check that the teacher-forced scores are what a
deployment would produce.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from kvcompress.eval.attention import CONTEXT_PHASE
from kvcompress.eval.intervals import paired_drop, wilson
from kvcompress.eval.native_cache import cache_for
from kvcompress.eval.tasks import TASKS

NEEDLE_TASKS = ("passkey", "multikey", "vartrack")
COPY_TASKS = ("copy_uuid", "copy_json")
GREEDY_CHECKS_PER_TASK = 1


def _score(logits: torch.Tensor, answer: torch.Tensor) -> tuple[float, bool]:
    """logits [A, V] predicting answer [A] -> (log-probability, every argmax right)."""
    lp = torch.log_softmax(logits.float(), -1)
    return float(lp.gather(-1, answer[:, None]).sum()), bool((lp.argmax(-1) == answer).all())


@torch.no_grad()
def score_sample(model, prompt: list[int], answer: list[int], books: dict) -> dict[str, tuple[float, bool]]:
    """{"fp16": (logprob, exact), name: (...) for each book} for one sample, context-phase.

    Every side runs the same path: one prefill of the prompt (computed once, exact), then the
    answer decoded token by token (teacher-forced) over its own cache; the unquantized side's
    cache is a plain DynamicCache holding the same prompt K/V.
    """
    dev = next(model.parameters()).device
    P = len(prompt)
    ans = torch.tensor(answer, device=dev)
    cap = DynamicCache(config=model.config)
    first = model(input_ids=torch.tensor([prompt], device=dev), cache=cap, use_cache=True).logits[0, -1:]  # predicts answer[0]
    prompt_kv = [(layer.keys, layer.values) for layer in cap.layers]  # [1, H, P, D] each; later updates make new tensors

    def decode(cache) -> tuple[float, bool]:
        logits = [first]  # the first answer token comes from the exact prefill
        for t in range(len(answer) - 1):
            logits.append(model(input_ids=ans[t : t + 1].view(1, 1), cache=cache, use_cache=True).logits[0, -1:])
        return _score(torch.cat(logits), ans)

    out = {"fp16": decode(cap)}
    for name, book in books.items():
        cache = cache_for(book)
        for layer, (k, v) in zip(cache.layers, prompt_kv):
            layer.update(k[..., :P, :], v[..., :P, :])  # the prefill chunk, stored in this format
        out[name] = decode(cache)
    return out


@torch.no_grad()
def _greedy(model, prompt: list[int], n: int, cache) -> list[int]:
    dev = next(model.parameters()).device
    out = model.generate(torch.tensor([prompt], device=dev), cache=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def run_tasks(lm, books: dict, corpus_ids: list[int], cfg, window: int, progress: bool = True) -> dict[str, dict]:
    """cfg: TasksConfig; books: {name: ScaleBook}. Returns {name: task summary} (fp16 inside each)."""
    samples = [
        TASKS.get(name)(lm.tokenizer, corpus_ids, length, depth, seed, window)
        for name in cfg.names
        for length in cfg.lengths
        for depth in cfg.depths
        for seed in range(cfg.seeds)
    ]
    rows = []
    checked = defaultdict(int)
    greedy = {name: [0, 0] for name, b in books.items() if not b.spec.is_native}  # [agree, checked]
    for s in tqdm(samples, desc="tasks", unit="sample", disable=not progress):
        sc = score_sample(lm.model, s.prompt, s.answer, books)
        rows.append({"task": s.task, "length": s.length, "depth": s.depth, "seed": s.seed, **{f"{k}": v for k, v in sc.items()}})
        if cfg.greedy and checked[s.task] < GREEDY_CHECKS_PER_TASK:
            checked[s.task] += 1
            for name in greedy:
                gen = _greedy(lm.model, s.prompt, len(s.answer), cache_for(books[name]))
                greedy[name][0] += int((gen == s.answer) == sc[name][1])
                greedy[name][1] += 1
    return {name: summarise(rows, name, greedy.get(name)) for name in books}


def _group(rows, name, tasks) -> dict:
    sel = [r for r in rows if r["task"] in tasks]
    if not sel:
        return None
    base = [r["fp16"][1] for r in sel]
    comp = [r[name][1] for r in sel]
    return {"n": len(sel), "fp16": sum(base) / len(sel), "compressed": sum(comp) / len(sel),
            "fp16_ci": wilson(sum(base), len(sel)), "compressed_ci": wilson(sum(comp), len(sel)), "drop": paired_drop(base, comp)}


def summarise(rows: list[dict], name: str, greedy: list[int] | None) -> dict:
    by_task = defaultdict(list)
    for r in rows:
        by_task[r["task"]].append(r)
    tasks = {}
    for t, rs in by_task.items():
        kb, kc = sum(r["fp16"][1] for r in rs), sum(r[name][1] for r in rs)
        tasks[t] = {
            "n": len(rs),
            "exact_fp16": kb / len(rs), "exact_fp16_ci": wilson(kb, len(rs)),
            "exact_compressed": kc / len(rs), "exact_compressed_ci": wilson(kc, len(rs)),
            "logprob_fp16": sum(r["fp16"][0] for r in rs) / len(rs),
            "logprob_compressed": sum(r[name][0] for r in rs) / len(rs),
        }
    grid = defaultdict(list)
    for r in rows:
        if r["task"] in NEEDLE_TASKS:
            grid[(r["length"], r["depth"])].append(r)
    return {
        "semantics": CONTEXT_PHASE,
        "tasks": tasks,
        "retrieval": _group(rows, name, NEEDLE_TASKS),
        "exact_copy": _group(rows, name, COPY_TASKS),
        "greedy_check": None if greedy is None else {"agree": greedy[0], "checked": greedy[1],
                                                      "what": "greedy generation through the real CompressedCache vs teacher-forced exact match"},
        "grid": [
            {"length": L, "depth": d, "n": len(rs), "fp16": sum(r["fp16"][1] for r in rs) / len(rs), "compressed": sum(r[name][1] for r in rs) / len(rs)}
            for (L, d), rs in sorted(grid.items())
        ],
        "rows": [{k: v for k, v in r.items() if k in ("task", "length", "depth", "seed", "fp16", name)} for r in rows],
    }
