"""Generated long-context tasks, fp16 vs each validated format, as the format's deployment runs a request.

Two prompt semantics (eval.tasks.prompt; auto picks per format what its deployment does):
* context-phase (the native tier: TensorRT-LLM's context phase; `CompressedCache` given the prompt in one call): the
  prompt is prefilled in one chunk that attends exactly within itself, its K/V are stored in the compressed cache,
  and the answer is decoded token by token over that cache. The first answer token comes from the prefill (exact by
  construction); every later answer token reads the compressed prompt.
* decode-equivalent prompt (the custom tier: its exported engine feeds a prompt one token per step through the
  packed cache): every prompt and answer token reads the compressed past, fp16 in its window and sinks. Scored in one
  teacher-forced pass over prompt + answer with the evaluation attention (the path perplexity and KL use, equal to
  token-by-token decoding through `CompressedCache`: tests/test_eval_equivalence.py); the greedy cross-check feeds the
  prompt to `CompressedCache` one token per call.

Teacher-forced scoring (answer log-probability; exact match = the argmax is the answer at every
answer position, which is exactly when greedy decoding reproduces the answer) shares one prefill
per sample across all formats: the prompt's exact K/V are captured once; each side then scores
the whole answer in one pass whose queries read every older position decode-equivalently (fp16
iff sink or within the window of that query, else the reference-encoded value), which is what
decoding the answer token by token over the cache produces, since a token's stored form depends
on that token alone. The unquantized side runs the same attention path with nothing compressed.
A few samples are also generated greedily through the real `CompressedCache` from the raw
prompt, as an independent check that the teacher-forced scores are what a deployment produces.
"""
from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from kvcompress.cache import CompressedCache
from kvcompress.eval.attention import CONTEXT_PHASE, PROMPT_STEPWISE, eval_call
from kvcompress.eval.intervals import paired_drop, wilson
from kvcompress.eval.tasks import TASKS
from kvcompress.models.observe import attention_implementation
from kvcompress.models.streaming import Pass, run_passes

NEEDLE_TASKS = ("passkey", "multikey", "vartrack")
COPY_TASKS = ("copy_uuid", "copy_json")
GREEDY_CHECKS_PER_TASK = 1
# a decode-equivalent prompt is fed to CompressedCache one token per call (~28 s for a 512-token prompt on the embedded
# model, 2 CPU cores): checked on the shortest needle sample and the shortest copy sample only
GREEDY_CHECKS_STEPWISE = (NEEDLE_TASKS, COPY_TASKS)
SEMANTICS = {"context": CONTEXT_PHASE, "decode": PROMPT_STEPWISE}


def prompt_mode(book, mode: str = "auto") -> str:
    """How a format's task prompts are run: eval.tasks.prompt, or for auto what the format's deployment does: "decode"
    for the custom tier (its engine feeds a prompt one token per step through the packed cache), "context" for the
    native tier (TensorRT-LLM prefills a prompt exactly in its context phase) and for a cache with nothing compressed."""
    if mode != "auto":
        return mode
    return "context" if book.spec.is_native or book.spec.is_baseline else "decode"


def _score(logits: torch.Tensor, answer: torch.Tensor) -> tuple[float, bool]:
    """logits [A, V] predicting answer [A] -> (log-probability, every argmax right)."""
    lp = torch.log_softmax(logits.float(), -1)
    return float(lp.gather(-1, answer[:, None]).sum()), bool((lp.argmax(-1) == answer).all())


class _PrefixLayer(CacheLayerMixin):
    """Hands attention the fixed exact prompt K/V followed by the new tokens; stores nothing.
    kv: a function giving the prompt's (k, v) [B, H, P, D] when the layer runs (streamed, the prompt's K/V of a layer
    exist only once that layer has prefilled it)."""

    is_sliding = False

    def __init__(self, kv, prompt_len: int):
        super().__init__()
        self.kv, self.prompt_len = kv, prompt_len
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        k, v = self.kv()
        if k.shape[-2] != self.prompt_len:  # a cache that dropped prompt tokens (a sliding-window layer) would score a shifted prefix
            raise RuntimeError(f"task scoring: the prompt's cache holds {k.shape[-2]} of its {self.prompt_len} tokens; it needs them all (full_cache)")
        return torch.cat([k, key_states], -2), torch.cat([v, value_states], -2)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.prompt_len + query_length, 0

    def get_seq_length(self) -> int:
        return self.prompt_len

    def get_max_length(self) -> int:
        return -1


class PrefixCache(Cache):
    """A teacher-forcing cache over a prefilled prompt: [prompt K/V (exact), answer K/V]. Each layer reads the prefill
    cache when it runs (streamed, that cache is still being filled layer by layer)."""

    def __init__(self, prefill: DynamicCache, n_layers: int, prompt_len: int):
        super().__init__(layers=[_PrefixLayer(lambda i=i: (prefill.layers[i].keys, prefill.layers[i].values), prompt_len) for i in range(n_layers)])


def full_cache(model) -> DynamicCache:
    """A prefill cache that keeps every token in every layer: transformers' sliding-window layers
    (DynamicCache(config=...) for Gemma 3, Mistral) would keep only the last window, and the
    teacher-forced answer must see the prompt's K/V at their true positions."""
    return DynamicCache()


@torch.no_grad()
def score_sample(model, prompt: list[int], answer: list[int], books: dict, modes: dict[str, str] | None = None) -> dict[str, tuple[float, bool]]:
    """{"fp16": (logprob, exact), name: (...) for each book} for one sample of an in-memory model (score_samples);
    modes: {name: "context" | "decode"} (prompt_mode; default context for every book)."""
    lm = SimpleNamespace(model=model, streamer=None)
    return score_samples(lm, [SimpleNamespace(prompt=prompt, answer=answer)], books, False, modes)[0]


@torch.no_grad()
def score_samples(lm, samples: list, books: dict, progress: bool = True, modes: dict[str, str] | None = None) -> list[dict[str, tuple[float, bool]]]:
    """{"fp16": (logprob, exact), name: (...)} per sample, through models.streaming.run_passes (in memory sample by
    sample, streamed layer by layer: the same passes). Pass 0 prefills the prompt exactly into a full cache and forms
    its last position's logits only (they predict answer[0]; not [T, vocabulary]: 8.6 GB at 8K for Gemma 3). Then
    the unquantized side and each context-phase book score the answer teacher-forced over that exact prefix (the
    first answer token comes from the prefill), and each decode-equivalent book scores prompt + answer in one pass of
    its own, every token reading the compressed past (its answer positions' logits only)."""
    model, L = lm.model, lm.model.config.get_text_config().num_hidden_layers
    modes = modes or {}
    caps = [full_cache(model) for _ in samples]
    prompts = [torch.tensor([s.prompt]) for s in samples]
    answers = [torch.tensor([s.answer[:-1] or s.answer[:1]]) for s in samples]  # 1-token answers: scored from the prefill alone
    fulls = [torch.tensor([s.prompt + s.answer[:-1]]) for s in samples]
    stepwise = [False] + [modes.get(n, "context") == "decode" for n in books]
    calls = [eval_call(None, exact=True)] + [eval_call(b) for b in books.values()]
    passes = [Pass(kwargs=lambda i: {"cache": caps[i], "use_cache": True}, inputs=lambda i: prompts[i], last_only=True)]
    passes += [Pass(kwargs=lambda i, kw=kw: {"use_cache": False, **kw}, context=lambda impl=impl: attention_implementation(model, impl),
                    inputs=lambda i: fulls[i], last=lambda i: len(samples[i].answer)) if sw else
               Pass(kwargs=lambda i, kw=kw: {"cache": PrefixCache(caps[i], L, len(samples[i].prompt)), "use_cache": True, **kw},
                    context=lambda impl=impl: attention_implementation(model, impl), inputs=lambda i: answers[i]) for (impl, kw), sw in zip(calls, stepwise)]
    names = ["fp16", *books]
    first: dict[int, torch.Tensor] = {}
    out: list[dict] = [{} for _ in samples]

    def head(pi: int, i: int, logits: torch.Tensor) -> None:
        ans = torch.tensor(samples[i].answer, device=logits.device)
        if pi == 0:
            first[i] = logits[0, -1:]
        else:
            lg = logits[0] if stepwise[pi - 1] else first[i] if len(ans) == 1 else torch.cat([first[i], logits[0]])
            out[i][names[pi - 1]] = _score(lg, ans)
            if pi == len(passes) - 1:
                first.pop(i)

    def free_layer(li: int) -> None:
        for c in caps:
            c.layers[li].keys = c.layers[li].values = None  # this layer's prompt K/V are no longer needed

    def free_sample(i: int) -> None:
        caps[i] = None  # this sample's prompt K/V are no longer needed

    run_passes(lm, prompts, passes, head, progress=progress, desc="tasks", after_layer=free_layer, after_batch=free_sample)
    return out


@torch.no_grad()
def _greedy(model, prompt: list[int], n: int, cache, stepwise: bool = False) -> list[int]:
    """n greedy tokens after prompt through cache. stepwise: the prompt is fed one token per call (each call a
    generation step reading the compressed past, as the custom-tier engine feeds it), then generate continues from
    its last token; else the prompt is one context-phase call."""
    dev = next(model.parameters()).device
    if stepwise:
        for t in prompt[:-1]:
            model(input_ids=torch.tensor([[t]], device=dev), cache=cache, use_cache=True, logits_to_keep=1)
    out = model.generate(torch.tensor([prompt], device=dev), cache=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def task_samples(tokenizer, corpus_ids: list[int], cfg, window: int) -> list:
    """cfg: TasksConfig. Every sample of cfg.names x lengths x depths x seeds, facts before an fp16 window of `window`
    tokens (a length too short for that is refused: eval.tasks.base.assemble)."""
    return [TASKS.get(name)(tokenizer, corpus_ids, length, depth, seed, window)
            for name in cfg.names for length in cfg.lengths for depth in cfg.depths for seed in range(cfg.seeds)]


def run_tasks(lm, books: dict, corpus_ids: list[int], cfg, window: int, progress: bool = True) -> dict[str, dict]:
    """cfg: TasksConfig; books: {name: ScaleBook}. Returns {name: task summary} (fp16 inside each)."""
    samples = task_samples(lm.tokenizer, corpus_ids, cfg, window)
    rows = []
    streamed = lm.streamer is not None  # the greedy cross-check decodes token by token: in memory only
    greedy = {name: [0, 0] for name, b in books.items() if not b.spec.is_native and not streamed}  # [agree, checked]
    modes = {name: prompt_mode(b, cfg.prompt) for name, b in books.items()}
    by_task = defaultdict(list)
    for j, s in enumerate(samples):
        by_task[s.task].append(j)
    checks = {"context": {j for js in by_task.values() for j in js[:GREEDY_CHECKS_PER_TASK]},
              "decode": {min((j for j, s in enumerate(samples) if s.task in group), key=lambda j: len(samples[j].prompt))
                         for group in GREEDY_CHECKS_STEPWISE if any(s.task in group for s in samples)}}
    scores = score_samples(lm, samples, books, progress, modes)
    for j, s in enumerate(samples):
        sc = scores[j]
        rows.append({"task": s.task, "length": s.length, "depth": s.depth, "seed": s.seed, **{f"{k}": v for k, v in sc.items()}})
        for name in greedy if cfg.greedy else ():
            if j in checks[modes[name]]:
                gen = _greedy(lm.model, s.prompt, len(s.answer), CompressedCache(books[name]), stepwise=modes[name] == "decode")
                greedy[name][0] += int((gen == s.answer) == sc[name][1])
                greedy[name][1] += 1
    return {name: summarise(rows, name, greedy.get(name), modes[name]) for name in books}


def _group(rows, name, tasks) -> dict:
    sel = [r for r in rows if r["task"] in tasks]
    if not sel:
        return None
    base = [r["fp16"][1] for r in sel]
    comp = [r[name][1] for r in sel]
    lengths = sorted({r["length"] for r in sel})  # eval.tasks.lengths: how accuracy falls with the sample's length
    return {"n": len(sel), "fp16": sum(base) / len(sel), "compressed": sum(comp) / len(sel),
            "fp16_ci": wilson(sum(base), len(sel)), "compressed_ci": wilson(sum(comp), len(sel)), "drop": paired_drop(base, comp),
            "by_length": [{"length": n, "n": len(rs), "fp16": sum(r["fp16"][1] for r in rs) / len(rs), "compressed": sum(r[name][1] for r in rs) / len(rs)}
                          for n in lengths for rs in [[r for r in sel if r["length"] == n]]]}


def summarise(rows: list[dict], name: str, greedy: list[int] | None, mode: str = "context") -> dict:
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
        "semantics": SEMANTICS[mode],
        "prompt": mode,
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
