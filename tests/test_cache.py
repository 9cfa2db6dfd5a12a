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
    """Chunked and token-by-token calls store identical layer-0 payloads (a token's encoding depends on it alone). The model
    decodes token by token; the keys and values it gave layer 0 are then stored again in chunks (the same tensors: a model
    run in chunks computes its projections with other GEMM shapes, bit-equal with AVX2 / AVX-512, not with ATen's scalar
    kernels)."""
    lm, book = lm_book
    ids = torch.randint(0, 256, (2, 29), generator=torch.Generator().manual_seed(2))
    c1 = CompressedCache(book)
    seen, update = [], c1.update
    c1.update = lambda k, v, layer, *a, **kw: (seen.append((k, v)) if layer == 0 else None, update(k, v, layer, *a, **kw))[1]
    with torch.no_grad():
        for t in range(29):
            lm.model(input_ids=ids[:, t : t + 1], cache=c1, use_cache=True)
    k, v = (torch.cat(x, -2) for x in zip(*seen))
    assert k.shape[-2] == 29
    c2 = CompressedCache(book)
    for lo in range(0, 29, 5):  # chunks of 5, crossing the window and sink boundaries
        c2.update(k[..., lo : lo + 5, :], v[..., lo : lo + 5, :], 0)
    for name in ("k_payload", "k_outliers", "v_payload", "v_scale", "v_min"):
        assert torch.equal(c1.layers[0].store[name], c2.layers[0].store[name]), name
    assert torch.equal(c1.layers[0].win_k, c2.layers[0].win_k) and torch.equal(c1.layers[0].sink_v, c2.layers[0].sink_v)
    assert c1.layers[0].nbytes() == c2.layers[0].nbytes()


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


@pytest.mark.parametrize("chunks", [[20, 1, 1, 1, 5, 1], [1, 1, 12, 9, 1], [33]])
def test_chunked_calls_follow_the_context_phase_reference(lm_book, chunks):
    """Every call's returned view against reference.context_phase_sources: a chunk of C > 1 tokens
    reads itself exactly, older tokens as stored after the append (fp16 if sink/window, else the
    reference fake-quantized value); a 1-token call is a decode step (reads itself as stored)."""
    lm, book = lm_book
    layer = CompressedCache(book).layers[0]
    p = book.key_params(0)
    g = torch.Generator().manual_seed(len(chunks))
    H, D = book.geometry["n_kv_heads"], book.geometry["head_dim"]
    n = sum(chunks)
    k, v = torch.randn(1, H, n, D, generator=g), torch.randn(1, H, n, D, generator=g)
    k_stored = ref.fake_quant_keys(ref.to_hp(k), p)
    v_stored = ref.fake_quant_values(ref.to_hp(v), book.spec.value.bits, book.value_group(0))
    start = 0
    for c in chunks:
        kv_k, kv_v = layer.update(k[..., start : start + c, :], v[..., start : start + c, :])
        end = start + c
        q_pos = torch.arange(start, end)
        exact, hp = ref.context_phase_sources(q_pos, end, torch.full((c,), start), book.spec.sink_tokens, book.spec.window)
        # the view is shared by the chunk's queries: each of them must agree with it
        for row in range(c):
            want_k = torch.where(exact[row][:, None], k[0, :, :end], torch.where(hp[row][:, None], ref.to_hp(k[0, :, :end]), k_stored[0, :, :end]))
            want_v = torch.where(exact[row][:, None], v[0, :, :end], torch.where(hp[row][:, None], ref.to_hp(v[0, :, :end]), v_stored[0, :, :end]))
            torch.testing.assert_close(kv_k[0], want_k, atol=0, rtol=0)
            torch.testing.assert_close(kv_v[0], want_v, atol=0, rtol=0)
        start = end


def test_context_phase_prefill_then_decode_differs_from_decode_equivalent(lm_book):
    """The two named semantics really differ: a prompt prefilled in one chunk reads itself exactly,
    decode-equivalent prefill (token by token) reads older prompt tokens compressed."""
    lm, book = lm_book
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        chunk = lm.model(input_ids=ids, cache=CompressedCache(book), use_cache=True).logits
        plain = lm.model(input_ids=ids).logits
        cache = CompressedCache(book)
        steps = torch.cat([lm.model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(30)], 1)
    torch.testing.assert_close(chunk, plain, atol=1e-5, rtol=1e-5)  # context phase: the prompt is exact
    assert (steps - plain).abs().max() > 1e-3


def test_a_book_of_another_geometry_is_one_clear_error(lm_book):
    """Keys of another shape (another model's K/V) or a layer past the book's: one line naming both geometries (it was an
    IndexError from transformers' Cache, or at one shape the book applied silently)."""
    from kvcompress.errors import UserError

    _, book = lm_book
    g = book.geometry
    cache = CompressedCache(book)
    ok = torch.randn(1, g["n_kv_heads"], 3, g["head_dim"])
    with pytest.raises(UserError, match=rf"layer 0's keys are \[1, {g['n_kv_heads'] + 1}, 3, {g['head_dim']}\] .* fitted for {g['n_layers']} layers x "
                                        rf"{g['n_kv_heads']} kv heads x head_dim {g['head_dim']}"):
        cache.update(torch.randn(1, g["n_kv_heads"] + 1, 3, g["head_dim"]), ok, 0)
    with pytest.raises(UserError, match=f"layer {g['n_layers']}'s keys"):
        cache.update(ok, ok, g["n_layers"])
    k, _ = cache.update(ok, ok, 0)  # the book's own shape: stored
    assert k.shape == ok.shape and cache.get_seq_length() == 3


def test_model_path_refuses_a_book_profiled_on_another_model_of_the_same_shape(lm_book, tmp_path):
    """CompressedCache(book, model_path=...): the book's model fingerprint against the files at model_path (a fine-tune
    of the same shape passes the K/V shape check); a GGUF file is fingerprinted as a run does. Bad paths: one line."""
    from kvcompress.errors import UserError
    from kvcompress.hashing import dir_fingerprint, file_fingerprint

    _, book = lm_book
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    stamp = lambda fp: dataclasses.replace(book, provenance={**book.provenance, "stats": {"model": {"name": "m", "sha256": fp}}})  # noqa: E731
    ours = stamp(dir_fingerprint(model))
    assert isinstance(CompressedCache(ours, model_path=model), CompressedCache)
    assert isinstance(CompressedCache(stamp(file_fingerprint(gguf)), model_path=gguf), CompressedCache)
    (model / "model.safetensors").write_bytes(b"fine-tuned")  # same shapes, other weights
    with pytest.raises(UserError, match=r"profiled on model m \(fingerprint .*\), not on .*model"):
        CompressedCache(ours, model_path=model)
    with pytest.raises(UserError, match="model_path='/nonexistent' does not exist"):
        CompressedCache(ours, model_path="/nonexistent")
    with pytest.raises(UserError, match="records no model fingerprint"):
        CompressedCache(dataclasses.replace(book, provenance={}), model_path=model)


def test_model_path_accepts_a_book_fingerprinted_by_the_old_edge_hash_with_a_warning(lm_book, tmp_path, monkeypatch, caplog):
    """A book made before whole-file hashing carries the edge hash of a model with a file over 1 GiB: CompressedCache
    accepts it for those files as a run does (pipeline.check_profiled_on, the same hashing helpers), with the warning."""
    import logging

    from kvcompress.hashing import MEMO_MIN, legacy_dir_fingerprint

    monkeypatch.setenv("KVCOMPRESS_CACHE", str(tmp_path / "cache"))
    _, book = lm_book
    model = tmp_path / "model"
    model.mkdir()
    with (model / "model.safetensors").open("wb") as f:
        f.truncate(MEMO_MIN + 4096)  # sparse, over 1 GiB: its legacy fingerprint differs
    legacy = dataclasses.replace(book, provenance={**book.provenance, "stats": {"model": {"name": "m", "sha256": legacy_dir_fingerprint(model)}}})
    with caplog.at_level(logging.WARNING, logger="kvcompress"):
        assert isinstance(CompressedCache(legacy, model_path=model), CompressedCache)
    assert "profiled by an older kvcompress" in caplog.text and "this ScaleBook" in caplog.text
