"""CompressedCache: real packed storage, exact byte accounting, generate() and chunked calls."""
import dataclasses

import pytest
import torch

from conftest import fitted_book, tiny_lm
from kvcompress import CompressedCache, ScaleBook
from kvcompress import reference as ref
from kvcompress.models.base import Geometry


@pytest.fixture(scope="module")
def lm_book():
    lm = tiny_lm("llama")
    return lm, fitted_book(lm, value={"bits": 4, "group_size": 16}, window=8, sink_tokens=3, outlier_channels=2)


@pytest.mark.parametrize("n_tokens", [1, 2, 3, 10, 11, 12, 40])
@pytest.mark.parametrize("key_bits", [4, 8])
def test_nbytes_equals_reference_accounting(lm_book, n_tokens, key_bits):
    lm, book = lm_book
    book = dataclasses.replace(book, spec=book.spec.model_copy(update={"key": book.spec.key.model_copy(update={"bits": key_bits})}))
    cache = CompressedCache(book)
    ids = torch.randint(0, 256, (2, n_tokens))
    with torch.no_grad():
        lm.model(input_ids=ids, cache=cache, use_cache=True)
    geom = Geometry(**book.geometry)
    assert cache.nbytes_breakdown() == ref.spec_cache_nbytes(book.spec, geom, n_tokens, batch=2)
    # and the payload really is packed integers
    store = cache.layers[0].store
    if n_tokens > 11:
        assert store["k_payload"].dtype == (torch.uint8 if key_bits == 4 else torch.int8)
        assert store["k_payload"].shape[-1] == (32 // 2 if key_bits == 4 else 32)
        assert store["v_payload"].dtype == torch.uint8 and store["v_payload"].shape[-1] == 16
        assert store["v_scale"].dtype == torch.float16


def test_generate_with_compressed_cache_batch_and_gqa(lm_book):
    lm, book = lm_book
    ids = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(0))
    cache = CompressedCache(book)
    out = lm.model.generate(ids, cache=cache, max_new_tokens=12, do_sample=False)
    assert out.shape == (3, 32)
    assert cache.get_seq_length() == 31  # the last generated token is never fed back
    assert cache.bytes_per_token() > 0


def test_generate_matches_manual_greedy_loop(lm_book):
    """generate() through the cache == prefill in one chunk then a manual greedy loop, same cache type."""
    lm, book = lm_book
    ids = torch.randint(0, 256, (1, 15), generator=torch.Generator().manual_seed(1))
    gen = lm.model.generate(ids, cache=CompressedCache(book), max_new_tokens=10, do_sample=False)
    cache, seq = CompressedCache(book), ids
    with torch.no_grad():
        logits = lm.model(input_ids=ids, cache=cache, use_cache=True).logits
        for _ in range(10):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
            logits = lm.model(input_ids=nxt, cache=cache, use_cache=True).logits
    assert torch.equal(gen, seq)


def test_chunked_calls_store_each_token_independently(lm_book):
    """Chunked and token-by-token calls store identical layer-0 payloads (a token's encoding depends on it alone)."""
    lm, book = lm_book
    ids = torch.randint(0, 256, (2, 29), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        c1 = CompressedCache(book)
        for t in range(29):
            lm.model(input_ids=ids[:, t : t + 1], cache=c1, use_cache=True)
        c2 = CompressedCache(book)
        for lo in range(0, 29, 5):  # chunks of 5, crossing the window and sink boundaries
            lm.model(input_ids=ids[:, lo : lo + 5], cache=c2, use_cache=True)
    for name in ("k_payload", "k_outliers", "v_payload", "v_scale", "v_min"):
        assert torch.equal(c1.layers[0].store[name], c2.layers[0].store[name]), name
    assert torch.equal(c1.layers[0].win_k, c2.layers[0].win_k) and torch.equal(c1.layers[0].sink_v, c2.layers[0].sink_v)
    assert c1.nbytes_breakdown() == c2.nbytes_breakdown()


def test_fp16_spec_is_plain_cache(lm_book):
    lm, book = lm_book
    base = dataclasses.replace(book, spec=type(book.spec).model_validate({**book.spec.model_dump(), "key": {"bits": 16}, "value": {"bits": 16}}))
    ids = torch.randint(0, 256, (1, 10))
    with torch.no_grad():
        a = lm.model(input_ids=ids).logits
        b = lm.model(input_ids=ids, cache=CompressedCache(base), use_cache=True).logits
    assert torch.equal(a, b)


def test_public_api_loads_saved_scalebook(tmp_path, lm_book):
    lm, book = lm_book
    book.save(tmp_path / "sb.safetensors")
    loaded = ScaleBook.load(tmp_path / "sb.safetensors", lm.geometry.to_dict())
    cache = CompressedCache(loaded)
    with torch.no_grad():
        lm.model(input_ids=torch.randint(0, 256, (1, 30)), cache=cache, use_cache=True)
    assert cache.nbytes() == sum(v for k, v in ref.spec_cache_nbytes(loaded.spec, lm.geometry, 30).items() if k != "static")
