"""Qwen3: the Llama layer with an RMSNorm on each head's q and k before RoPE (one [head_dim] weight per layer
for every head). The norm undoes any scaling of W_q/W_k, so the exact key fold lives in the norms' weights,
shared by every head, and no RoPE-pair rotation can (profile.key_norm, fit, fold.key_norm_weights). The
TensorRT-LLM checkpoint is TensorRT-LLM's QWen class with qwen_type qwen3 (attention.q_layernorm /
k_layernorm); the custom-tier graph normalises q and k before RoPE. TensorRT itself is not run."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import SMOKE_CALIB, assert_folded_like, fitted_book, tiny_lm

from kvcompress.data import load_texts
from kvcompress.errors import UserError
from kvcompress.fold import apply_fold, fold_factors
from kvcompress.spec import native_spec
from kvcompress.stages.fit import fit
from kvcompress.stages.profile import key_norm, profile
from kvcompress.targets import network_oracle as no
from kvcompress.targets import trtllm_network as tn
from kvcompress.targets import trtllm_reader
from kvcompress.targets.trtllm_ckpt import write_checkpoint


def qwen3_lm(**kw):
    """A tiny Qwen3 whose q/k norm weights are not all ones (random init leaves them at 1: make them matter)."""
    lm = tiny_lm("qwen3", **kw)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in lm.model.model.layers:
            for n in ("q_norm", "k_norm"):
                w = getattr(layer.self_attn, n).weight
                w.copy_(torch.rand(w.shape, generator=g) * 1.5 + 0.25)
    return lm


@pytest.fixture(scope="module")
def lm():
    return qwen3_lm(heads=8, kv_heads=2)


def test_key_norm_kinds():
    assert key_norm(tiny_lm("llama").model, tiny_lm("llama").geometry) == "none"
    q = tiny_lm("qwen3")
    assert key_norm(q.model, q.geometry) == "shared" and q.model.model.layers[0].self_attn.k_norm.weight.numel() == q.geometry.head_dim


def test_fold_into_the_key_norms_is_exact_and_refuses_what_they_cannot_carry(lm):
    """Head-shared factors tied across RoPE pairs, folded into q_norm/k_norm: the same logits, the cached keys
    divided by sigma. Per-head factors or pair rotations cannot live in one elementwise [head_dim] weight."""
    L, H, D = lm.geometry.n_layers, lm.geometry.n_kv_heads, lm.geometry.head_dim
    g = torch.Generator().manual_seed(0)
    absmax = torch.rand(L, 1, D, generator=g) * 5 + 0.1
    sigma = fold_factors(absmax, absmax.amax(dim=(1, 2)), 1.0, tie_pairs=True).expand(L, H, D).contiguous()
    folded = copy.deepcopy(lm.model)
    apply_fold(folded, sigma, None)
    assert not torch.equal(folded.model.layers[0].self_attn.k_norm.weight, lm.model.model.layers[0].self_attn.k_norm.weight)
    assert torch.equal(folded.model.layers[0].self_attn.k_proj.weight, lm.model.model.layers[0].self_attn.k_proj.weight)
    assert_folded_like(lm.model, folded, sigma, torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1)))
    # scaling W_k instead (what a Llama fold does) would be undone by the norm: the cache would not hold k / sigma
    per_head = sigma.clone()
    per_head[:, 1] = per_head[:, 1].flip(-1)
    with pytest.raises(ValueError, match="differ between heads"):
        apply_fold(copy.deepcopy(lm.model), per_head, None)
    with pytest.raises(ValueError, match="RoPE-pair rotations cannot be folded"):
        apply_fold(copy.deepcopy(lm.model), sigma, None, torch.full((L, H, D // 2), 0.3))


def test_fit_gives_head_shared_key_factors_and_no_pair_rotation(lm):
    stats = profile(lm, SMOKE_CALIB, load_texts(SMOKE_CALIB), progress=False)
    assert stats.header["key_norm"] == "shared"
    book = fit(stats, native_spec("native_fp8"))
    fk = book.tensors["fold_k"]
    assert torch.equal(fk, fk[:, :1].expand_as(fk)) and (fk < 1).any()  # folded, one factor per channel for every head
    assert not book.tensors["fold_k_rot"].any() and "fold_pairs" not in book.fit_info and "q/k norm weights" in book.fit_info["key_norm"]
    with pytest.raises(UserError, match="kv.fold_pairs=true: this model normalises each head's keys"):
        fit(stats, native_spec("native_fp8").model_copy(update={"fold_pairs": True}))
    # the validated book's fold, applied to the model, is the checkpoint's: cached keys are k / sigma
    folded = copy.deepcopy(lm.model)
    apply_fold(folded, fk, book.tensors["fold_v"], book.tensors["fold_k_rot"])
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(folded(input_ids=ids).logits, lm.model(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_checkpoint_carries_the_norms_and_the_reader_applies_them(tmp_path, lm, tp):
    """Written as TensorRT-LLM's QWen checkpoint (qwen_type qwen3, no biases, attention.q_layernorm/k_layernorm
    replicated); read back by the reader it reproduces transformers' Qwen3. Negative: without the norms, far off."""
    write_checkpoint(lm.model, lm.geometry, tmp_path, tp, "float32", None, None)
    cfg = trtllm_reader.read_config(tmp_path)
    assert cfg["architecture"] == "Qwen3ForCausalLM" and cfg["qwen_type"] == "qwen3" and cfg["attn_bias"] is False
    ranks = [trtllm_reader.load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(tp)]
    for r in ranks:
        assert torch.equal(r["transformer.layers.1.attention.k_layernorm.weight"], lm.model.model.layers[1].self_attn.k_norm.weight.detach())
        assert "transformer.layers.0.attention.qkv.bias" not in r
    ids = torch.randint(0, 256, (2, 17))
    with torch.no_grad():
        expect = lm.model(input_ids=ids).logits
    torch.testing.assert_close(trtllm_reader.forward(tmp_path, ids), expect, atol=1e-5, rtol=1e-5)
    cfg, w = trtllm_reader.merge_shards(tmp_path)
    w = {k: v for k, v in w.items() if "layernorm.weight" not in k or "attention." not in k}
    assert (trtllm_reader.forward((cfg, w), ids) - expect).abs().max() > 1e-2


def test_network_graph_of_qwen3_decodes_like_the_validated_cache(tmp_path, monkeypatch):
    """The custom-tier graph normalises each head's q and k before RoPE (Qwen3's q_norm/k_norm): it decodes like
    transformers' Qwen3 through CompressedCache. Negative: the same graph without the norms is far outside."""
    from test_trtllm_network import SPEC, _bundle

    lm = qwen3_lm()
    book = fitted_book(lm, **SPEC)
    bundle, hf = _bundle(tmp_path, lm, book)
    prompt = lm.tokenizer.encode("The plugin owns its cache.")[:12]
    res = no.check_network(bundle, hf, lm.model, book, prompt, max_new_tokens=8)
    assert res["crossed_into_store"] and res["kl_mean"] < 1e-5 and res["max_abs_logit_diff"] < 0.02, res
    real = tn.load_hf_weights
    monkeypatch.setattr(tn, "load_hf_weights", lambda *a, **k: {n: v for n, v in real(*a, **k).items() if not n.endswith((".qn", ".kn"))})
    dropped = no.check_network(bundle, hf, lm.model, book, prompt, max_new_tokens=8)
    assert dropped["kl_mean"] > 100 * max(res["kl_mean"], 1e-7), (dropped["kl_mean"], res["kl_mean"])


def test_the_oracle_enforces_tensorrts_rank_rules():
    """TensorRT's elementwise and matrix-multiply layers take inputs of equal rank (broadcast only from 1) and one
    type; the oracle refuses what TensorRT would, so a graph that runs here relies on no rank or type promotion."""
    g = no.TorchGraph()
    x = torch.ones(2, 4)
    assert g.mul(x, torch.ones(1, 4)).shape == (2, 4)
    with pytest.raises(ValueError, match="same rank"):
        g.mul(x, torch.ones(4))
    with pytest.raises(ValueError, match="same rank"):
        g.matmul(torch.ones(2, 3, 4), torch.ones(4, 4))
    with pytest.raises(ValueError, match="one type"):
        g.add(x, torch.ones(1, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="one type"):
        g.matmul(x, torch.ones(4, 4, dtype=torch.float16))


def test_the_report_says_where_the_native_key_fold_lives(lm):
    from kvcompress.config import EvalConfig, TasksConfig
    from kvcompress.stages.validate import validate

    stats = profile(lm, SMOKE_CALIB, load_texts(SMOKE_CALIB), progress=False)
    ecfg = EvalConfig(name="smoke", split="heldout", n_windows=1, seq_len=64, batch_size=1, tasks=TasksConfig(names=[]))
    report = validate(lm, {"primary": fit(stats, native_spec("native_int8"))}, ecfg, progress=False)[0]
    assert any(n.startswith("native formats: key_norm=shared: the model normalises each head's keys before RoPE") for n in report.notes), report.notes
