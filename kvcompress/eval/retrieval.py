"""Run the generated long-context tasks, fp16 vs compressed, scored two ways.

* teacher-forced (one pass, decode-equivalent attention): log-probability of the answer and exact
  match of the argmax at every answer position;
* greedy generation through the real CompressedCache (kvcompress format only; the prompt is
  prefilled in one chunk, see kvcompress.cache): exact match of the generated answer.
"""
from __future__ import annotations

import statistics
from collections import defaultdict

import torch
from tqdm.auto import tqdm

from kvcompress.cache import CompressedCache
from kvcompress.eval.attention import compressed_attention
from kvcompress.eval.tasks import TASKS

NEEDLE_TASKS = ("passkey", "multikey", "vartrack")
COPY_TASKS = ("copy_uuid", "copy_json")


@torch.no_grad()
def _teacher_forced(model, ids: torch.Tensor, n_answer: int) -> tuple[float, bool]:
    logits = model(input_ids=ids, use_cache=False, logits_to_keep=n_answer + 1).logits[0, :-1].float()  # [n_answer, V]
    target = ids[0, -n_answer:]
    logp = torch.log_softmax(logits, -1).gather(-1, target[:, None]).sum()
    return float(logp), bool((logits.argmax(-1) == target).all())


@torch.no_grad()
def _greedy(model, prompt: torch.Tensor, answer: list[int], cache) -> bool:
    out = model.generate(prompt, cache=cache, max_new_tokens=len(answer), do_sample=False, min_new_tokens=len(answer))
    return out[0, prompt.shape[1] :].tolist() == answer


def run_tasks(lm, book, corpus_ids: list[int], cfg, progress: bool = True) -> dict:
    """cfg: TasksConfig. Returns per-task summaries, a length x depth grid and per-seed spread."""
    window = book.spec.window
    rows = []
    samples = [
        TASKS.get(name)(lm.tokenizer, corpus_ids, length, depth, seed, window)
        for name in cfg.names
        for length in cfg.lengths
        for depth in cfg.depths
        for seed in range(cfg.seeds)
    ]
    greedy_ok = cfg.greedy and not book.spec.is_native and not book.spec.is_baseline
    dev = lm.device
    for s in tqdm(samples, desc="tasks", unit="sample", disable=not progress):
        ids = torch.tensor([s.prompt + s.answer], device=dev)
        lp_b, em_b = _teacher_forced(lm.model, ids, len(s.answer))
        with compressed_attention(lm.model, book):
            lp_c, em_c = _teacher_forced(lm.model, ids, len(s.answer))
        row = {"task": s.task, "length": s.length, "depth": s.depth, "seed": s.seed, "logprob_fp16": lp_b, "logprob_compressed": lp_c, "tf_exact_fp16": em_b, "tf_exact_compressed": em_c}
        if greedy_ok:
            prompt = torch.tensor([s.prompt], device=dev)
            row["greedy_exact_fp16"] = _greedy(lm.model, prompt, s.answer, None)
            row["greedy_exact_compressed"] = _greedy(lm.model, prompt, s.answer, CompressedCache(book))
        rows.append(row)
    return summarise(rows)


def _acc(rows, key) -> float | None:
    vals = [r[key] for r in rows if key in r]
    return sum(vals) / len(vals) if vals else None


def summarise(rows: list[dict]) -> dict:
    by_task = defaultdict(list)
    for r in rows:
        by_task[r["task"]].append(r)
    tasks = {}
    for name, rs in by_task.items():
        per_seed = defaultdict(list)
        for r in rs:
            per_seed[r["seed"]].append(r)
        seed_acc = {k: [_acc(v, k2) for v in per_seed.values()] for k, k2 in (("fp16", "tf_exact_fp16"), ("compressed", "tf_exact_compressed"))}
        tasks[name] = {
            "n": len(rs),
            "tf_exact_fp16": _acc(rs, "tf_exact_fp16"),
            "tf_exact_compressed": _acc(rs, "tf_exact_compressed"),
            "greedy_exact_fp16": _acc(rs, "greedy_exact_fp16"),
            "greedy_exact_compressed": _acc(rs, "greedy_exact_compressed"),
            "logprob_fp16": statistics.fmean(r["logprob_fp16"] for r in rs),
            "logprob_compressed": statistics.fmean(r["logprob_compressed"] for r in rs),
            "seed_spread_fp16": statistics.pstdev(seed_acc["fp16"]) if len(seed_acc["fp16"]) > 1 else 0.0,
            "seed_spread_compressed": statistics.pstdev(seed_acc["compressed"]) if len(seed_acc["compressed"]) > 1 else 0.0,
        }
    grid = defaultdict(list)
    for r in rows:
        if r["task"] in NEEDLE_TASKS:
            grid[(r["length"], r["depth"])].append(r)
    return {
        "tasks": tasks,
        "retrieval_fp16": _acc([r for r in rows if r["task"] in NEEDLE_TASKS], "tf_exact_fp16"),
        "retrieval_compressed": _acc([r for r in rows if r["task"] in NEEDLE_TASKS], "tf_exact_compressed"),
        "exact_fp16": _acc([r for r in rows if r["task"] in COPY_TASKS], "tf_exact_fp16"),
        "exact_compressed": _acc([r for r in rows if r["task"] in COPY_TASKS], "tf_exact_compressed"),
        "grid": [
            {"length": L, "depth": d, "fp16": _acc(rs, "tf_exact_fp16"), "compressed": _acc(rs, "tf_exact_compressed")}
            for (L, d), rs in sorted(grid.items())
        ],
        "rows": rows,
    }
