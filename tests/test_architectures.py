"""Attention features beyond Llama's that the evaluation simulates (Gemma 2's soft-capped scores, GPT-OSS's attention
sinks, Llama 4's chunked attention, sliding windows in the profile pass), and the architectures refused in one line
right after loading (hybrids with recurrent layers, multi-head latent attention, non-Llama layouts)."""
from __future__ import annotations

import dataclasses

import re

import pytest
import torch

from kvcompress.cache import CompressedCache
from kvcompress.errors import UserError
from kvcompress.eval.attention import check_supported, compressed_attention
from kvcompress.models.base import Geometry, LoadedModel
from kvcompress.models.observe import attention_hook
from kvcompress.models.tokenizer import ByteTokenizer
from kvcompress.stages.validate import self_check

from conftest import fitted_book

COMMON = dict(vocab_size=ByteTokenizer.vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=1)
# every feature binds within the tests' 48 tokens: windows and chunks of 16, a soft cap below the scores' range
ARCHS = {
    "gemma2": dict(sliding_window=16, query_pre_attn_scalar=32, attn_logit_softcapping=2.0, final_logit_softcapping=5.0),
    "gpt_oss": dict(sliding_window=16, num_local_experts=4, num_experts_per_tok=2),
    "llama4_text": dict(attention_chunk_size=16, num_local_experts=2),
    "cohere2": dict(sliding_window=16),
}
T = 48


def tiny(arch: str, seed: int = 0, **over) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(arch, **{k: v for k, v in {**COMMON, **ARCHS.get(arch, {}), **over}.items() if v is not None or k not in COMMON})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    for m in model.modules():  # sharper attention than the random init's near-uniform one, so a cap, a sink or a mask shows
        for n in ("q_proj", "k_proj"):
            if hasattr(m, n):
                getattr(m, n).weight.data *= 6.0
    if arch == "gpt_oss":  # sinks start at 0 in from_config: give each head its own, as trained models have
        for m in model.modules():
            if hasattr(m, "sinks"):
                m.sinks.data = torch.randn(m.sinks.shape, generator=torch.Generator().manual_seed(m.layer_idx)) * 2
    return LoadedModel(model, ByteTokenizer(), Geometry.from_hf_config(model.config), {"name": arch})


def ids(n: int = T, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, 256, (1, n), generator=torch.Generator().manual_seed(seed))


# families of transformers' Llama layout beyond those the export writes: each validates (the survey below)
SURVEY = dict(gemma={}, gemma3_text=dict(sliding_window=16), olmo2={}, olmo3=dict(sliding_window=16), olmoe=dict(num_experts=4, num_experts_per_tok=2),
              starcoder2={}, granite={}, granitemoe=dict(num_local_experts=4, num_experts_per_tok=2), glm={}, glm4={}, smollm3={},
              exaone4=dict(sliding_window=16), seed_oss={}, ernie4_5={}, apertus={}, arcee={}, bitnet={}, phi={}, ministral=dict(sliding_window=16),
              hunyuan_v1_dense={}, hunyuan_v1_moe=dict(num_experts=4, moe_topk=2), helium={})


@pytest.mark.parametrize("arch", list(SURVEY))
def test_other_llama_layout_families_validate(arch):
    """Each is accepted (check_supported), its evaluation path with nothing compressed gives its own logits (validate's
    self-check) and so does the profile pass; it profiles and fits."""
    from kvcompress.stages.fit import fit
    from kvcompress.stages.profile import profile
    from kvcompress.spec import KVSpec
    from conftest import SMOKE_CALIB
    from kvcompress.data import load_texts

    lm = tiny(arch, **SURVEY[arch])
    check_supported(lm.model, arch)
    x = ids()
    assert self_check(lm, x, arch)["passed"]
    with torch.no_grad():
        own = lm.model(input_ids=x).logits
        with attention_hook(lm.model, lambda i, q: None):
            torch.testing.assert_close(lm.model(input_ids=x).logits, own, atol=1e-5, rtol=0)
    fit(profile(lm, SMOKE_CALIB, load_texts(SMOKE_CALIB), progress=False), KVSpec(name="int8k_int4v", window=8, sink_tokens=2))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_evaluation_and_the_profile_pass_compute_the_models_own_attention(arch):
    """The evaluation path with nothing compressed (validate's self-check) and the profile's observing pass give the
    model's own logits (before, the profile pass ran plain causal SDPA: no window, chunk, cap or sink; without them it fails here)."""
    lm = tiny(arch)
    x = ids()
    assert self_check(lm, x, arch)["passed"]
    with torch.no_grad():
        own = lm.model(input_ids=x).logits
        with attention_hook(lm.model, lambda i, q: None):
            observed = lm.model(input_ids=x).logits
    torch.testing.assert_close(observed, own, atol=1e-5, rtol=0)


def test_the_features_bind_in_these_models():
    """Negative controls: without its cap, sinks or chunks each model computes something else (so the test above can fail)."""
    x = ids()
    with torch.no_grad():
        for arch, off in (("gemma2", dict(attn_logit_softcapping=None)), ("llama4_text", dict(attention_chunk_size=10_000)),
                          ("cohere2", dict(sliding_window=10_000))):
            a, b = tiny(arch).model(input_ids=x).logits, tiny(arch, **off).model(input_ids=x).logits
            assert float((a - b).abs().max()) > 1e-2, arch
        lm = tiny("gpt_oss")
        a = lm.model(input_ids=x).logits
        for m in lm.model.modules():
            if hasattr(m, "sinks"):
                m.sinks.data.fill_(-1e4)
        assert float((lm.model(input_ids=x).logits - a).abs().max()) > 1e-2


def _float64(lm: LoadedModel, mp: pytest.MonkeyPatch) -> LoadedModel:
    """The model in float64 end to end, so the two paths agree to ~1e-12 (conftest.float64_model): transformers' norms
    compute in float32 whatever the input, here their formula runs in the input's dtype (Gemma's 1 + w; Llama 4's
    weightless norms); eager attention's softmax(..., dtype=float32) keeps float64; the experts run eagerly (grouped_mm
    has no float64)."""
    for m in lm.model.modules():
        cls = type(m)
        if cls.__name__.endswith("RMSNorm") or cls.__name__.endswith("L2Norm"):
            off = 1.0 if cls.__name__.startswith("Gemma") else 0.0

            def forward(self, x, off=off):
                eps = getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))
                y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
                return y * (off + self.weight) if hasattr(self, "weight") else y

            mp.setattr(cls, "forward", forward)
    softmax = torch.nn.functional.softmax
    mp.setattr(torch.nn.functional, "softmax", lambda x, dim=None, dtype=None, **kw: softmax(x, dim=dim, dtype=None if x.dtype == torch.float64 else dtype, **kw))
    for c in (lm.model.config, getattr(lm.model.config, "text_config", None)):
        if c is not None:
            c._experts_implementation = "eager"
    lm.model.double()
    return lm


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss", "llama4_text"])
def test_onepass_equals_decoding_through_the_compressed_cache(arch):
    """The one-pass evaluation (reference.mixed_attention with the cap, the sinks or the chunks) equals decoding token by
    token through CompressedCache under the model's own attention; the window off by one is far off (negative)."""
    lm = tiny(arch)
    book = fitted_book(lm, window=5, sink_tokens=2, outlier_channels=1)
    x = ids(seed=1)
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        _float64(lm, mp)
        cache = CompressedCache(book)
        dec = torch.cat([lm.model(input_ids=x[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(T)], dim=1)

        def onepass(b):
            with compressed_attention(lm.model, b) as kw:
                return lm.model(input_ids=x, use_cache=False, **kw).logits

        # Llama 4 applies RoPE in complex64 whatever the dtype: its paths agree to ~1e-8, still far below the negative's 1e-3
        torch.testing.assert_close(onepass(book), dec, atol=1e-7 if arch == "llama4_text" else 1e-9, rtol=0)
        off = dataclasses.replace(book, spec=book.spec.model_copy(update={"window": 6}))
        assert float((onepass(off) - dec).abs().max()) > 1e-3


@pytest.mark.parametrize("softcap,sinks,chunk", [(None, None, None), (1.5, None, None), (None, True, None), (None, None, 7), (1.5, True, 7)])
def test_reference_attention_fused_and_explicit_agree_with_a_direct_softmax(softcap, sinks, chunk):
    """reference.mixed_attention (CPU: fused parts merged by log-sum-exp; with a cap: the explicit softmax) against one
    direct softmax written here: scores q.k * scale, capped, masked (causal, sliding 11, chunk), sink column appended."""
    from kvcompress import reference as ref
    from kvcompress.reference import attention as ref_attention

    g = torch.Generator().manual_seed(5)
    B, Hq, Hkv, S, D = 2, 4, 2, 29, 16
    q, k, v = (torch.randn(B, h, S, D, generator=g, dtype=torch.float64) for h in (Hq, Hkv, Hkv))
    kh, vh = k + 0.05 * torch.randn(k.shape, generator=g, dtype=torch.float64), v + 0.05 * torch.randn(v.shape, generator=g, dtype=torch.float64)
    sink = torch.randn(Hq, generator=g, dtype=torch.float64) if sinks else None
    pos = torch.arange(S)
    kw = dict(sink_tokens=2, window=4, scaling=0.3, sliding_window=11, softcap=softcap, sink_logits=sink, chunk=chunk)
    fused = ref.mixed_attention(q, k, v, kh, vh, pos, q_block=8, **kw)
    explicit = ref_attention._mixed_attention_explicit(q, k, v, kh, vh, pos, q_block=8, **kw)
    hp = ref.fp16_mask(pos, S, 2, 4)  # [S, S]: which keys a query reads in fp16
    kk = torch.where(hp[None, None, :, :, None], k[:, :, None], kh[:, :, None]).repeat_interleave(2, 1)  # [B, Hq, Tq, S, D]
    vv = torch.where(hp[None, None, :, :, None], v[:, :, None], vh[:, :, None]).repeat_interleave(2, 1)
    s = torch.einsum("bhtd,bhtsd->bhts", q, kk) * 0.3
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    t, j = pos[:, None], pos[None, :]
    ok = (j <= t) & (t - j < 11) & ((t // chunk == j // chunk) if chunk else True)
    s = s.masked_fill(~ok, float("-inf"))
    if sinks:
        s = torch.cat([s, sink.view(1, Hq, 1, 1).expand(B, Hq, S, 1)], -1)
    p = torch.softmax(s, -1)[..., :S]
    direct = torch.einsum("bhts,bhtsd->bhtd", p, vv)
    torch.testing.assert_close(fused, direct, atol=1e-12, rtol=0)
    torch.testing.assert_close(explicit, direct, atol=1e-12, rtol=0)


GEMMA3N = dict(sliding_window=16, num_hidden_layers=4, intermediate_size=[256] * 4, laurel_rank=8, altup_num_inputs=2, hidden_size_per_layer_input=16,
               vocab_size_per_layer_input=257, activation_sparsity_pattern=[0.0] * 4, layer_types=["sliding_attention", "full_attention"] * 2)


def test_why_gemma3n_kv_sharing_is_refused():
    """With num_kv_shared_layers the one-pass evaluation and decoding through CompressedCache disagree; without, they agree
    (float32, so to ~1e-4): what check_supported's refusal rests on."""
    from conftest import fitted_book

    x = ids(seed=1)
    gaps = []
    for shared in (0, 2):
        lm = tiny("gemma3n_text", **GEMMA3N, num_kv_shared_layers=shared)
        book = fitted_book(lm, window=5, sink_tokens=2, outlier_channels=1)
        with torch.no_grad():
            cache = CompressedCache(book)
            dec = torch.cat([lm.model(input_ids=x[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(T)], dim=1)
            with compressed_attention(lm.model, book) as kw:
                gaps.append(float((lm.model(input_ids=x, use_cache=False, **kw).logits - dec).abs().max()))
    assert gaps[0] < 1e-3 and gaps[1] > 1e-2, gaps


@pytest.mark.parametrize("arch,extra,why", [
    ("qwen3_next", {}, "hybrid: config.layer_types has linear_attention layers"),
    ("jamba", dict(attn_layer_period=2, attn_layer_offset=1, num_experts=2), "hybrid: config.layer_types has linear_attention layers"),
    ("deepseek_v3", dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=24, v_head_dim=32, n_routed_experts=4,
                         num_experts_per_tok=2, first_k_dense_replace=3), "multi-head latent attention (kv_lora_rank=16)"),
    ("gemma3n_text", dict(GEMMA3N, num_kv_shared_layers=2), "its last 2 layers reuse earlier layers' KV caches"),
    ("gpt_neox", {}, "GPTNeoXForCausalLM is not laid out as transformers' Llama-family decoders"),
    ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2, head_dim=None), "FalconForCausalLM is not laid out"),
])
def test_unsupported_architectures_are_one_line(arch, extra, why):
    """Before, these were tracebacks from inside profile (a recurrent-state cache layer, a latent's shape, .model missing)."""
    lm = tiny(arch, **extra)
    with pytest.raises(UserError) as e:
        check_supported(lm.model, arch)
    assert why in str(e.value) and "\n" not in str(e.value)


def test_a_run_checks_the_model_before_its_directory_exists(tmp_path, monkeypatch):
    """pipeline.run loads and checks the model before it writes anything: an unsupported model leaves no run directory."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from conftest import ROOT
    from kvcompress import pipeline
    from kvcompress.config import to_run_config

    monkeypatch.setattr(pipeline, "load_model", lambda cfg, cache_dir: tiny("qwen3_next"))
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["model=tiny_llama", "calib=smoke", "eval=smoke", "export=none", f"cache_dir={tmp_path / 'c'}"])
    with pytest.raises(UserError, match="hybrid"):
        pipeline.run(to_run_config(OmegaConf.to_container(cfg, resolve=True)), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_gemma2_exports_the_fp8_hf_checkpoint_alone(tmp_path):
    """Gemma 2 (soft caps, alternating sliding layers) with kv=native_fp8: hf_ckpt/ alone, bfloat16, the key fold in
    k_proj's rows (Gemma 2 has no q/k norms), a config.json transformers reads back with the caps and windows, re-measured
    through transformers against validate; another kv format or float16 weights: one line, nothing written."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoConfig

    from kvcompress.scalebook import ScaleBook
    from test_export import _dir_run, _hf_dir

    ckpt = _hf_dir(tmp_path, "gemma2")
    p, run = _dir_run(tmp_path, ckpt, "run", "kv=native_fp8", "export.dtype=bfloat16", "kv.fold_strength=1.0", "kv.fold_keys=true",
                      "kv.fold_pairs=false")  # per-channel factors only: the fold below is k_proj's rows / sigma
    assert p.returncode == 0, p.stderr[-3000:]
    manifest = json.loads((run / "export" / "manifest.json").read_text())
    assert set(manifest["artifacts"]) == {"hf_ckpt"} and "trtllm_ckpt" in manifest["not_written"]
    assert all(c["status"] == "passed" for c in manifest["checks"]) and manifest["artifacts"]["hf_ckpt"]["remeasured"]["passed"]
    out = run / "export" / "hf_ckpt"
    cfg, src_cfg = AutoConfig.from_pretrained(str(out)), AutoConfig.from_pretrained(str(ckpt))
    assert type(cfg).__name__ == "Gemma2Config" and cfg.architectures == ["Gemma2ForCausalLM"]
    for k in ("attn_logit_softcapping", "final_logit_softcapping", "sliding_window", "layer_types", "query_pre_attn_scalar"):
        assert getattr(cfg, k) == getattr(src_cfg, k), k
    w, src = load_file(str(next(out.glob("*.safetensors")))), load_file(str(ckpt / "model.safetensors"))
    sigma = ScaleBook.load(run / "scalebook.safetensors").tensors["fold_k"][0]  # [H_kv, D]
    assert (sigma < 1).any()
    k = "model.layers.0.self_attn.k_proj.weight"
    assert w[k].dtype == torch.bfloat16
    torch.testing.assert_close(w[k].float(), (src[k].float() / sigma.reshape(-1, 1)).bfloat16().float())
    p, run2 = _dir_run(tmp_path, ckpt, "run2", "export.dtype=bfloat16")
    assert p.returncode != 0 and "kv=int8k_asym_rotv is not that format: use kv=native_fp8, or add export=none" in p.stderr
    assert "Traceback" not in p.stderr and not run2.exists()
    p, run3 = _dir_run(tmp_path, ckpt, "run3", "kv=native_fp8")
    assert p.returncode != 0 and "export.dtype=float16: Gemma2ForCausalLM is trained and served in bfloat16" in p.stderr and "Traceback" not in p.stderr


# transformers' model_type of each HF_ONLY_ARCH family beyond Gemma 2/3, and the families kept out because the fold is not exact
HF_ONLY_TYPES = {"GemmaForCausalLM": "gemma", "Cohere2ForCausalLM": "cohere2", "Olmo2ForCausalLM": "olmo2", "Olmo3ForCausalLM": "olmo3",
                 "OlmoeForCausalLM": "olmoe", "GraniteForCausalLM": "granite", "GraniteMoeForCausalLM": "granitemoe", "GlmForCausalLM": "glm",
                 "Glm4ForCausalLM": "glm4", "SmolLM3ForCausalLM": "smollm3", "Exaone4ForCausalLM": "exaone4", "SeedOssForCausalLM": "seed_oss",
                 "Ernie4_5ForCausalLM": "ernie4_5", "ApertusForCausalLM": "apertus", "ArceeForCausalLM": "arcee",
                 "MinistralForCausalLM": "ministral", "HeliumForCausalLM": "helium", "GptOssForCausalLM": "gpt_oss",
                 "Llama4ForCausalLM": "llama4_text", "HunYuanDenseV1ForCausalLM": "hunyuan_v1_dense", "HunYuanMoEV1ForCausalLM": "hunyuan_v1_moe"}
# the families where one half of the fold is blocked (profile.fold_obstacles), and which half
BLOCKED = {"llama4_text": "keys", "hunyuan_v1_dense": "keys", "hunyuan_v1_moe": "keys", "bitnet": "values"}


def _folded_logit_error(arch: str, ignore_obstacles: bool = False) -> float:
    """max |logits| difference between a tiny `arch` and the same model with a fitted native_fp8 ScaleBook's fold applied (key
    factors, pair rotations where fit chooses them, value factors; fold.apply_fold is the export's arithmetic). Where the model
    blocks one half of the fold (BLOCKED), fit leaves it unfolded; ignore_obstacles: fit as if nothing were blocked."""
    import copy

    import yaml

    from conftest import ROOT, SMOKE_CALIB
    from kvcompress.data import load_texts
    from kvcompress.fold import apply_fold
    from kvcompress.spec import KVSpec
    from kvcompress.stages.fit import fit
    from kvcompress.stages.profile import profile

    lm = tiny(arch, **SURVEY.get(arch, {}))
    blocked = BLOCKED.get(arch)
    spec = KVSpec(**{**yaml.safe_load((ROOT / "conf" / "kv" / "native_fp8.yaml").read_text()), "fold_strength": 1.0,
                     "fold_keys": True if blocked != "keys" or ignore_obstacles else "auto",
                     "fold_values": True if blocked != "values" or ignore_obstacles else "auto"})
    stats = profile(lm, SMOKE_CALIB, load_texts(SMOKE_CALIB), progress=False)
    assert set(stats.header["fold_obstacles"]) == ({blocked} if blocked else set())
    if ignore_obstacles:
        stats.header["fold_obstacles"] = {}
    t = fit(stats, spec).tensors
    for side, f in (("keys", t["fold_k"]), ("values", t["fold_v"])):  # a fold that moves what it may, so an inexact one shows
        assert float((f != 1).float().mean()) > 0.3 if side != blocked or ignore_obstacles else bool((f == 1).all())
    folded = copy.deepcopy(lm.model)
    apply_fold(folded, t["fold_k"], t["fold_v"], t.get("fold_k_rot"))
    x = ids()
    with torch.no_grad():
        return float((lm.model(input_ids=x).logits - folded(input_ids=x).logits).abs().max())


def test_the_hf_only_list_is_the_tested_one():
    from kvcompress.targets.route import HF_ONLY_ARCH

    assert set(HF_ONLY_ARCH) == set(HF_ONLY_TYPES) | {"Gemma2ForCausalLM", "Gemma3ForCausalLM"}


@pytest.mark.parametrize("arch", sorted(HF_ONLY_TYPES.values()))
def test_the_fold_is_exact_in_every_hf_only_family(arch):
    assert _folded_logit_error(arch) < 1e-4


@pytest.mark.parametrize("arch", sorted(BLOCKED))
def test_a_blocked_half_of_the_fold_is_left_unfolded(arch):
    """Llama 4 and HunYuan normalise q and k after RoPE, BitNet the attention output before o_proj: folded there, the logits
    move by > 1e-2 (the negative: fit told nothing is blocked); profile finds the obstacle, fit folds only the other half,
    and the logits stay. kv.fold_keys / fold_values / fold_pairs = true on the blocked half: one line. BitNet is still not
    exported (its servers re-quantize the weights to ternary)."""
    import yaml

    from conftest import ROOT
    from kvcompress.spec import KVSpec
    from kvcompress.targets.route import export_route
    from kvcompress.stages.fit import check_fold_flags
    from kvcompress.stages.profile import fold_obstacles

    assert _folded_logit_error(arch, ignore_obstacles=True) > 1e-2
    assert _folded_logit_error(arch) < 1e-4
    blocked = fold_obstacles(tiny(arch, **SURVEY.get(arch, {})).model)
    assert list(blocked) == [BLOCKED[arch]]
    base = yaml.safe_load((ROOT / "conf" / "kv" / "native_fp8.yaml").read_text())
    for flag in [f"fold_{BLOCKED[arch]}"] + (["fold_pairs"] if BLOCKED[arch] == "keys" else []):  # fit's and the pipeline's check
        with pytest.raises(UserError, match=f"kv.{flag}=true: {re.escape(blocked[BLOCKED[arch]])}; allowed for this model: kv.{flag}=auto or false"):
            check_fold_flags(KVSpec(**{**base, flag: True}), blocked, None, "none")
    if arch == "bitnet":
        with pytest.raises(UserError, match="add export=none"):
            export_route(tiny(arch, **SURVEY.get(arch, {})).model)
    else:
        assert export_route(tiny(arch, **SURVEY.get(arch, {})).model)[0]


@pytest.mark.parametrize("arch", ["olmo2", "granitemoe", "smollm3", "llama4_text"])
def test_hf_only_families_export_and_remeasure(tmp_path, arch):
    """kv=native_fp8 on an HF directory of OLMo 2 (a q/k norm over all heads: per-head factors in its weight), Granite MoE
    (fused experts written back under the checkpoint's names), SmolLM3 (NoPE layers among RoPE layers), Llama 4 (chunked
    layers, a q/k norm after RoPE: values folded alone): hf_ckpt/ alone, every check passed, re-measured through
    transformers; another kv: one line."""
    import json

    from kvcompress.models.synthetic import byte_tokenizer
    from test_export import _dir_run

    m = tiny(arch, **SURVEY.get(arch, {})).model
    m.config.architectures = [type(m).__name__]
    ckpt = tmp_path / arch
    m.save_pretrained(str(ckpt))
    byte_tokenizer().save_pretrained(str(ckpt))
    p, run = _dir_run(tmp_path, ckpt, "run", "kv=native_fp8", "export.dtype=bfloat16", "kv.fold_strength=1.0",
                      "kv.fold_keys=" + ("auto" if BLOCKED.get(arch) == "keys" else "true"))
    assert p.returncode == 0, p.stderr[-3000:]
    manifest = json.loads((run / "export" / "manifest.json").read_text())
    assert set(manifest["artifacts"]) == {"hf_ckpt"} and all(c["status"] == "passed" for c in manifest["checks"])
    assert manifest["artifacts"]["hf_ckpt"]["remeasured"]["passed"]
    p, run2 = _dir_run(tmp_path, ckpt, "run2", "export=trtllm")
    assert p.returncode != 0 and "use kv=native_fp8, or add export=none" in p.stderr and not run2.exists()


def test_chunked_layers_are_counted_as_holding_one_chunk():
    """Llama 4's chunked layers read only their current chunk, so the byte accounting holds them to attention_chunk_size
    tokens (like a sliding layer's window); its global layers hold every token."""
    lm = tiny("llama4_text", num_hidden_layers=4)  # every 4th layer global
    g = lm.geometry
    types = lm.model.config.layer_types
    assert g.sliding_windows == tuple(16 if t == "chunked_attention" else 0 for t in types) and "full_attention" in types
    assert [g.stored_tokens(i, 1000) for i in range(len(types))] == [16 if t == "chunked_attention" else 1000 for t in types]


def test_tiny_model_takes_model_dtype():
    """model.dtype casts the tiny model's weights as from_pretrained casts a checkpoint's (it was ignored: a run of
    model.dtype=bfloat16 measured float32 under a config.json saying bfloat16); RoPE's inverse frequencies stay float32, so the
    export's RoPE check still holds; the weights are the float32 ones rounded."""
    import torch

    from kvcompress.config import ModelConfig
    from kvcompress.models import load_model
    from kvcompress.paths import load_preset

    lms = {d: load_model(ModelConfig.model_validate({**load_preset("model", "tiny_llama"), "dtype": d}), None) for d in ("float32", "bfloat16")}
    w32, w16 = (dict(lm.model.named_parameters()) for lm in lms.values())
    assert {p.dtype for p in w16.values()} == {torch.bfloat16} and {p.dtype for p in w32.values()} == {torch.float32}
    assert all(torch.equal(w16[k], w32[k].to(torch.bfloat16)) for k in w32)
    assert lms["bfloat16"].model.model.rotary_emb.inv_freq.dtype == torch.float32
