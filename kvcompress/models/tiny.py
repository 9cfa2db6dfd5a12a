"""Tiny random-initialised models built in code (tests, smoke runs). Seeded, so reproducible."""
from __future__ import annotations

import torch

from kvcompress.hashing import obj_hash
from kvcompress.models import SOURCES
from kvcompress.models.base import DTYPES, Geometry, LoadedModel
from kvcompress.models.tokenizer import ByteTokenizer


def tiny_hf_config(arch: str, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, max_position: int):
    from transformers import (Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, MixtralConfig, Phi3Config, Qwen2Config, Qwen2MoeConfig,
                              Qwen3Config, Qwen3MoeConfig)

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig, "phi3": Phi3Config, "gemma3": Gemma3TextConfig,
               "gemma2": Gemma2Config, "mixtral": MixtralConfig, "qwen2_moe": Qwen2MoeConfig, "qwen3_moe": Qwen3MoeConfig}
    common = dict(
        vocab_size=ByteTokenizer.vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position,
        bos_token_id=ByteTokenizer.bos_id,
        eos_token_id=ByteTokenizer.bos_id,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if arch in ("mistral", "mixtral"):
        common["sliding_window"] = None
    if arch in ("mixtral", "qwen2_moe", "qwen3_moe"):  # mixture of experts: 4 experts, 2 per token (transformers fuses each layer's experts)
        common |= {"num_local_experts" if arch == "mixtral" else "num_experts": 4, "num_experts_per_tok": 2}
    if arch == "qwen2_moe":  # q/k/v biases and a shared expert behind a sigmoid gate; the released models route without renormalising
        common |= {"moe_intermediate_size": hidden, "shared_expert_intermediate_size": 2 * hidden, "norm_topk_prob": False}
    if arch == "qwen3_moe":  # the released Qwen3-MoE models renormalise their top-k routing weights (transformers' default does not)
        common |= {"moe_intermediate_size": hidden, "norm_topk_prob": True}
    if arch == "gemma3":  # Gemma 3's layout: every 3rd layer global, the others local (window 16), QK-norm, two RoPE bases
        common.update(sliding_window=16, query_pre_attn_scalar=head_dim,
                      layer_types=["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(layers)],
                      rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    if arch == "gemma2":  # Gemma 2's layout: sliding and global layers alternate (window 16), soft-capped attention and output logits
        common.update(sliding_window=16, query_pre_attn_scalar=head_dim, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                      layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)])
    return classes[arch](**common)


def build_tiny(arch="llama", layers=2, hidden=128, heads=6, kv_heads=2, head_dim=32, max_position=4096, seed=0, dtype=torch.float32):
    """A random-init causal LM of family `arch` with GQA, deterministic for a given seed."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_hf_config(arch, layers, hidden, heads, kv_heads, head_dim, max_position)
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    finally:
        torch.random.set_rng_state(gen_state)
    model.generation_config.pad_token_id = 0
    return model.eval()


@SOURCES.register("tiny")
def load_tiny(cfg, cache_dir) -> LoadedModel:
    t = cfg.tiny
    model = build_tiny(t.arch, t.layers, t.hidden, t.heads, t.kv_heads, t.head_dim, t.max_position, t.seed).to(cfg.device)
    # built in float32 (the same seed gives the same weights whatever model.dtype), then its weights cast to model.dtype as
    # from_pretrained loads a checkpoint's: computed buffers (RoPE's inverse frequencies) stay float32 (model.dtype was ignored)
    for p in model.parameters():
        p.data = p.data.to(DTYPES[cfg.dtype])
    identity = {"name": cfg.name, "source": "tiny", "sha256": obj_hash(t.model_dump()), "tiny": t.model_dump()}
    return LoadedModel(model, ByteTokenizer(), Geometry.from_hf_config(model.config), identity)
