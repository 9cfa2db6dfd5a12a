"""Task scoring in context-phase semantics equals what decoding through the real cache produces."""
import torch
from transformers import DynamicCache

from conftest import fitted_book, tiny_lm
from kvcompress.cache import CompressedCache
from kvcompress.eval.retrieval import _score, score_sample


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
