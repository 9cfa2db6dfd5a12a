"""Task scoring, in both prompt semantics, equals what decoding through the real cache produces."""
import torch
from transformers import DynamicCache

from conftest import fitted_book, tiny_lm
from kvcompress.cache import CompressedCache
from kvcompress.eval.retrieval import _greedy, _score, prompt_mode, score_sample


@torch.no_grad()
def _stepwise(model, prompt, answer, cache):
    """The serving loop: prefill the prompt in one chunk, then decode the answer token by token."""
    ans = torch.tensor(answer)
    logits = [model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True).logits[0, -1:]]
    for t in range(len(answer) - 1):
        logits.append(model(input_ids=ans[t : t + 1].view(1, 1), cache=cache, use_cache=True).logits[0, -1:])
    return torch.cat(logits)


def test_one_pass_answer_scoring_equals_prefill_then_decode_through_compressed_cache():
    lm = tiny_lm("llama")
    book = fitted_book(lm, key={"bits": 4}, value={"bits": 4, "group_size": 16}, window=8, sink_tokens=2, outlier_channels=1)
    g = torch.Generator().manual_seed(0)
    prompt, answer = torch.randint(0, 256, (40,), generator=g).tolist(), torch.randint(0, 256, (12,), generator=g).tolist()
    got = score_sample(lm.model, prompt, answer, {"b": book})
    ref = _stepwise(lm.model, prompt, answer, CompressedCache(book))
    want = _score(ref, torch.tensor(answer))
    # float32, the same numbers in a different summation order: 1e-4 on a sum of 12 log-probs
    assert abs(got["b"][0] - want[0]) < 1e-4 and got["b"][1] == want[1]
    plain = _stepwise(lm.model, prompt, answer, DynamicCache(config=lm.model.config))
    assert abs(got["fp16"][0] - _score(plain, torch.tensor(answer))[0]) < 1e-4
    # the answer (8 > window) reads compressed prompt tokens: scores differ from fp16
    assert abs(got["b"][0] - got["fp16"][0]) > 1e-4


def test_task_facts_sit_outside_the_fp16_window_and_short_lengths_are_refused():
    """Every generated task places its facts at least window + FACT_GAP tokens before the last prompt token, so the
    question reads them from the compressed store; a length too short for that is refused (it would test nothing)."""
    import pytest

    from kvcompress.errors import UserError
    from kvcompress.eval.tasks import TASKS
    from kvcompress.eval.tasks.base import FACT_GAP

    lm = tiny_lm("llama")
    corpus = lm.tokenizer.encode("Some held-out text of real words to build a haystack from. " * 40)
    window = 64
    for name in TASKS.names():
        s = TASKS.get(name)(lm.tokenizer, corpus, 1024, 0.9, 0, window)
        assert len(s.prompt) - 1 - s.needle_pos >= window + FACT_GAP, name
        # a sample of length n feeds n tokens, prompt and answer but its last (only predicted): at a length equal to
        # the model's context (eval=long's 8192 on SmolLM2) no answer token is scored past it
        assert len(s.prompt) + len(s.answer) - 1 == 1024 and len(s.answer) > 1, name
        with pytest.raises(UserError, match=f"eval.tasks.lengths contains 80: a {name} sample needs at least"):
            TASKS.get(name)(lm.tokenizer, corpus, 80, 0.5, 0, window)


def test_the_prompt_prefill_forms_the_last_positions_logits_only():
    """A task prompt of 8K tokens would otherwise form [8K, vocabulary] logits that are never read (8.6 GB for
    Gemma 3's 262K vocabulary in float32): the prefill asks the model for its last position only."""
    lm = tiny_lm("llama")
    book = fitted_book(lm, key={"bits": 8}, value={"bits": 4, "group_size": 16}, window=4, sink_tokens=1)
    rows = []
    hook = lm.model.lm_head.register_forward_hook(lambda m, i, o: rows.append(o.shape[-2]))
    try:
        score_sample(lm.model, list(range(1, 41)), [5, 6, 7], {"b": book})
    finally:
        hook.remove()
    assert rows[0] == 1, rows  # the prefill (40 prompt tokens)
    assert rows[1:] == [2, 2], rows  # teacher-forced answers: every answer position but the first is read


@torch.no_grad()
def _token_by_token(model, prompt, answer, cache):
    """The custom-tier engine's loop: the prompt fed one token per step, then the answer, every call a generation step."""
    seq = prompt + answer[:-1]
    logits = [model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True).logits[0, -1:] for t in seq]
    return torch.cat(logits[len(prompt) - 1 :])


def test_decode_equivalent_prompt_scoring_equals_feeding_the_prompt_token_by_token():
    """eval.tasks.prompt=decode (auto for the custom tier, whose engine feeds a prompt one token per step): the one-pass
    score of prompt + answer equals feeding every token one call at a time through CompressedCache, and differs from the
    context-phase score (there the prompt reads itself exactly), so the mode is really applied."""
    lm = tiny_lm("llama")
    book = fitted_book(lm, key={"bits": 4}, value={"bits": 4, "group_size": 16}, window=8, sink_tokens=2, outlier_channels=1)
    g = torch.Generator().manual_seed(1)
    prompt, answer = torch.randint(0, 256, (40,), generator=g).tolist(), torch.randint(0, 256, (6,), generator=g).tolist()
    got = score_sample(lm.model, prompt, answer, {"b": book}, {"b": "decode"})
    want = _score(_token_by_token(lm.model, prompt, answer, CompressedCache(book)), torch.tensor(answer))
    assert abs(got["b"][0] - want[0]) < 1e-4 and got["b"][1] == want[1]
    ctx = score_sample(lm.model, prompt, answer, {"b": book})
    assert abs(got["b"][0] - ctx["b"][0]) > 1e-4 and got["fp16"] == ctx["fp16"]
    # the greedy cross-check feeds the prompt the same way: its tokens are the argmax of the stepwise logits
    gen = _greedy(lm.model, prompt, 3, CompressedCache(book), stepwise=True)
    steps = _token_by_token(lm.model, prompt, gen + [0], CompressedCache(book))
    assert gen == steps.argmax(-1)[:3].tolist()


def test_prompt_mode_follows_each_formats_deployment():
    lm = tiny_lm("llama")
    custom = fitted_book(lm, key={"bits": 8}, value={"bits": 4, "group_size": 16}, window=4, sink_tokens=1)
    native = fitted_book(lm, name="native_int8", format="native_int8", window=0, sink_tokens=0)
    assert prompt_mode(custom) == "decode" and prompt_mode(native) == "context"
    assert prompt_mode(custom, "context") == "context" and prompt_mode(native, "decode") == "decode"


def test_greedy_cross_check_runs_per_task_or_once_per_group_for_stepwise_prompts():
    """The greedy cross-check generates through the real CompressedCache: one sample per task with context-phase
    prompts; with decode-equivalent prompts (fed one token per call, slow) the first needle and the first copy sample.
    Every check agrees with the teacher-forced scores."""
    from kvcompress.config import TasksConfig
    from kvcompress.eval.retrieval import run_tasks

    lm = tiny_lm("llama")
    book = fitted_book(lm, key={"bits": 8}, value={"bits": 4, "group_size": 16}, window=4, sink_tokens=1)
    corpus = lm.tokenizer.encode("Some held-out text of real words to build a haystack from. " * 40)
    for mode, n in (("auto", 2), ("context", 3)):
        cfg = TasksConfig(names=["passkey", "multikey", "copy_uuid"], lengths=[512], depths=[0.5], seeds=2, prompt=mode)
        t = run_tasks(lm, {"b": book}, corpus, cfg, 4, progress=False)["b"]
        assert t["prompt"] == ("decode" if mode == "auto" else "context")
        assert t["greedy_check"]["checked"] == n and t["greedy_check"]["agree"] == n, (mode, t["greedy_check"])


def test_task_summaries_split_accuracy_by_sample_length():
    """retrieval and exact copy carry their accuracy per eval.tasks.lengths (the pooled figure hid whether a move is at 2K
    or at 8K), fp16 and compressed from the same rows; make_results renders it under a table."""
    import importlib.util
    import json

    from conftest import ROOT
    from kvcompress.eval.retrieval import summarise

    rows = [{"task": t, "length": n, "depth": 0.5, "seed": s, "fp16": (0.0, ok), "x": (0.0, ok and s == 0)}
            for t in ("passkey", "copy_uuid") for n, ok in ((2048, True), (8192, False)) for s in range(2)]
    out = summarise(rows, "x", None)
    assert out["retrieval"]["by_length"] == [{"length": 2048, "n": 2, "fp16": 1.0, "compressed": 0.5},
                                             {"length": 8192, "n": 2, "fp16": 0.0, "compressed": 0.0}]
    assert out["exact_copy"]["by_length"] == out["retrieval"]["by_length"] and out["retrieval"]["fp16"] == 0.5
    spec = importlib.util.spec_from_file_location("make_results", ROOT / "scripts" / "make_results.py")
    mr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mr)
    name, r = "long8k_all", json.loads(json.dumps(mr.load_results()["long8k_all"]))
    for f in r["formats"]:  # as a file made before by_length
        for k in ("retrieval", "exact_copy"):
            f["tasks"][k].pop("by_length", None)
    assert "by sample length" not in mr.render({name: r})
    for f in r["formats"]:
        f["tasks"]["retrieval"] = out["retrieval"]
        f["tasks"]["exact_copy"] = out["exact_copy"]
    assert ("Task exact match by sample length (2048 tokens / 8192 tokens), retrieval | copy: fp16 1.00 / 0.00 | 1.00 / 0.00; "
            f"{r['formats'][0]['name']} 0.50 / 0.00 | 0.50 / 0.00; ") in mr.render({name: r})
