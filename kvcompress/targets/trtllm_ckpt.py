"""Writer of a TensorRT-LLM 1.2.x checkpoint (Llama family): config.json + rank{r}.safetensors.

Format followed: TensorRT-LLM's `docs/source/legacy/architecture/checkpoint.md` and its Llama
converter `tensorrt_llm/models/llama/convert.py` (1.2 line), read through the project's notes
(shared/notes/trtllm_export.md §1.2). Names and splits:
    transformer.vocab_embedding.weight                      [V, hidden]            replicated
    transformer.layers.{i}.input_layernorm.weight           [hidden]               replicated
    transformer.layers.{i}.attention.qkv.weight             [(nh+2nkv)*hd/tp, hidden]  q|k|v of this rank's heads
    transformer.layers.{i}.attention.dense.weight           [hidden, nh*hd/tp]     split on columns
    transformer.layers.{i}.attention.{q,k}_layernorm.weight [hd]                   Qwen3's q_norm/k_norm, replicated
    transformer.layers.{i}.attention.kv_cache_scaling_factor [1] fp32 dequant scale (amax/127 INT8, amax/448 FP8)
    transformer.layers.{i}.post_layernorm.weight            [hidden]
    transformer.layers.{i}.mlp.fc.weight   <- HF gate_proj  [inter/tp, hidden]     (the naming trap:
    transformer.layers.{i}.mlp.gate.weight <- HF up_proj    [inter/tp, hidden]      fc is gate_proj)
    transformer.layers.{i}.mlp.proj.weight <- HF down_proj  [hidden, inter/tp]
    transformer.ln_f.weight, lm_head.weight                 [V/tp, hidden]         split on rows
KV heads are duplicated up to tp when nkv < tp, as the converter does.
Mixtral (mixture of experts; the converter's load_weights_from_hf_safetensors, MoE branch; LLaMAConfig's
`moe` block, hidden_act swiglu, experts split over the tp ranks on their intermediate dimension, moe_tp_size = tp):
    transformer.layers.{i}.mlp.router.weight <- HF mlp.gate (block_sparse_moe.gate) [E, hidden]   float32, replicated
    transformer.layers.{i}.mlp.fc.weight     <- w3 | w1 (up | gate) of each expert   [E, 2*inter/tp, hidden]
    transformer.layers.{i}.mlp.proj.weight   <- w2 of each expert                    [E, hidden, inter/tp]
Qwen3-MoE (TensorRT-LLM's QWen class, qwen_type qwen3_moe: Qwen3's attention with q/k_layernorm, every layer a
mixture of experts of moe_intermediate_size, no shared expert; the converter's convert_hf_qwen MoE branch): the same
expert tensors as Mixtral (router float32, fc = up | gate, proj), from transformers' mlp.gate and mlp.experts. The
routing follows the model's norm_topk_prob (normalization_mode 1, RENORMALIZE, when set; 0, the top k of the softmax
over all experts, when not), written in the config's `moe` block, which QWenConfig reads as given.
Qwen2-MoE (qwen_type qwen2_moe: Qwen2's attention with q/k/v biases, the same experts, and a shared expert that every
token runs, scaled by a sigmoid gate: TensorRT-LLM's SharedMoE with use_shared_gate, its MLP with swiglu = SiLU(second
half) * first half):
    transformer.layers.{i}.mlp.shared_expert.fc.weight   <- up | gate of HF shared_expert   [2*shared/tp, hidden]  per rank
    transformer.layers.{i}.mlp.shared_expert.proj.weight <- HF shared_expert.down_proj      [hidden, shared/tp]
    transformer.layers.{i}.mlp.shared_expert_gate.weight <- HF shared_expert_gate           [1, hidden]   replicated
FP8-weight sources (fp8_mlp): a dense model whose MLP weights are stored float8 e4m3 with one scale per tensor or per output
row keeps them as stored, in the layouts Model Optimizer's own TensorRT-LLM exporter writes for FP8 and for
FP8_PER_CHANNEL_PER_TOKEN with the attention left unquantized (checked in the tests):
    transformer.layers.{i}.mlp.{fc,gate,proj}.weight                     float8 e4m3, split as above
  quant_algo FP8 (per-tensor weight scales and static input scales everywhere: Model Optimizer's FP8, static per-tensor FP8):
    transformer.layers.{i}.mlp.{fc,gate,proj}.weights_scaling_factor     [1] fp32 <- HF {gate,up,down}_proj.weight_scale
    transformer.layers.{i}.mlp.{fc,gate,proj}.activation_scaling_factor  [1] fp32 <- HF {gate,up,down}_proj.input_scale
  quant_algo FP8_PER_CHANNEL_PER_TOKEN (otherwise: per-row scales, or activations quantized at run time; fbgemm_fp8,
  FP8-dynamic):
    transformer.layers.{i}.mlp.{fc,gate,proj}.per_channel_scale          [rows/tp] fp32 (fc, gate) / [hidden] (proj) <- weight_scale
  both: exclude_modules (fp8_excluded): every attention (the fold's, in `dtype`), lm_head, the MLP of a layer the source keeps
  unquantized; FP8_PER_CHANNEL_PER_TOKEN also the norms feeding unquantized modules (TensorRT-LLM would make them quantize)
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from kvcompress.artifacts import atomic_write_json
from kvcompress.errors import UserError
from kvcompress.models.base import DTYPES

TRTLLM_VERSION = "1.2.1"


def check_tp(geom, tp: int, hf_cfg=None) -> None:
    """tp splits the heads, the MLP's (or each expert's) intermediate dimension and the vocabulary (padded) evenly."""
    sizes = {}
    if getattr(hf_cfg, "intermediate_size", None) is not None:
        sizes = {"MLP intermediate size" + (" (per expert)" if num_experts(hf_cfg) else ""): expert_intermediate_size(hf_cfg),
                 "shared expert's intermediate size": shared_expert_size(hf_cfg)}
    for what, inter in sizes.items():
        if inter % tp:
            raise UserError(f"export.tp_sizes contains {tp}: the model's {what} {inter} does not split over {tp} ranks")
    if geom.n_heads % tp:
        raise UserError(f"export.tp_sizes contains {tp}: the model's {geom.n_heads} attention heads do not split over {tp} ranks")
    if geom.n_kv_heads % tp and tp % geom.n_kv_heads:
        raise UserError(f"export.tp_sizes contains {tp}: {geom.n_kv_heads} kv heads neither split over nor duplicate to {tp} ranks")


def _split(w: torch.Tensor, tp: int, rank: int, dim: int) -> torch.Tensor:
    return torch.chunk(w, tp, dim=dim)[rank].contiguous()


def _dup_kv(w: torch.Tensor, nkv: int, tp: int) -> torch.Tensor:
    """[nkv*hd, hidden] -> [tp*hd, hidden]: each kv head repeated tp/nkv times (converter's dup_kv_weight)."""
    if nkv >= tp:
        return w
    return w.unflatten(0, (nkv, -1)).repeat_interleave(tp // nkv, dim=0).flatten(0, 1)


QWEN_TYPES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
OWN_ARCH = {**QWEN_TYPES, "mixtral": "MixtralForCausalLM"}  # written under their own name; the rest as Llama
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight")  # transformers 5's fused experts and router


def num_experts(hf_cfg) -> int:
    """The experts of each layer's MLP (Mixtral: num_local_experts; Qwen2/3-MoE: num_experts); 0 for a dense MLP."""
    return int(getattr(hf_cfg, "num_local_experts", 0) or getattr(hf_cfg, "num_experts", 0) or 0)


def expert_intermediate_size(hf_cfg) -> int:
    """The intermediate size tp splits: each expert's (Qwen2/3-MoE: moe_intermediate_size; Mixtral: intermediate_size)."""
    return int(getattr(hf_cfg, "moe_intermediate_size", 0) or hf_cfg.intermediate_size) if num_experts(hf_cfg) else int(hf_cfg.intermediate_size)


def shared_expert_size(hf_cfg) -> int:
    """The intermediate size of the shared expert every token runs (Qwen2-MoE); 0 without one."""
    return int(getattr(hf_cfg, "shared_expert_intermediate_size", 0) or 0) if num_experts(hf_cfg) else 0


def moe_block(hf_cfg) -> dict:
    """The checkpoint's `moe` block (TensorRT-LLM's MoeConfig): experts, top k and the routing's normalization_mode,
    1 (RENORMALIZE: the top k softmax probabilities renormalised; Mixtral, and Qwen2/3-MoE with norm_topk_prob) or
    0 (NONE: the top k of the softmax over all experts, as they are; Qwen2/3-MoE without norm_topk_prob)."""
    renorm = bool(getattr(hf_cfg, "norm_topk_prob", True)) if getattr(hf_cfg, "model_type", None) in ("qwen2_moe", "qwen3_moe") else True
    return {"num_experts": num_experts(hf_cfg), "top_k": int(hf_cfg.num_experts_per_tok), "normalization_mode": int(renorm)}


def trtllm_architecture(hf_cfg) -> str:
    """The checkpoint's `architecture`: Qwen2 and Qwen3 keep their own (TensorRT-LLM's QWen class: qwen_type qwen2
    is the Llama layer with q/k/v biases, qwen3 the Llama layer with an RMSNorm on each head's q and k before RoPE,
    the same tensor names plus attention.q_layernorm/k_layernorm); Llama and Mistral without a sliding window, and
    Phi-3/Phi-4 with full-width default RoPE (targets.route.check_exportable), are written as Llama, the same forward.
    Mixtral keeps its name (TensorRT-LLM's Llama class with a mixture-of-experts MLP), and so does Qwen3-MoE (the QWen
    class, qwen_type qwen3_moe: Qwen3's attention, an expert MLP in every layer) and Qwen2-MoE (qwen_type qwen2_moe: Qwen2's
    attention, experts and a gated shared expert in every layer)."""
    return OWN_ARCH.get(getattr(hf_cfg, "model_type", None), "LlamaForCausalLM")


def trtllm_config(hf_cfg, geom, tp: int, dtype: str, kv_algo: str | None, fp8_algo: str | None = None, fp8_layers: list[int] | None = None,
                  clamp_val: list[float] | None = None) -> dict:
    rope = getattr(hf_cfg, "rope_parameters", None) or {}
    # unset fields (None) are left out: TensorRT-LLM then takes its defaults, as transformers does for None
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "rope_type") and v is not None} if rope.get("rope_type", "default") != "default" else None
    if scaling is not None:
        scaling["type"] = rope["rope_type"]
    cfg = {
        "architecture": trtllm_architecture(hf_cfg),
        "dtype": dtype,
        "logits_dtype": "float32",
        "vocab_size": geom.vocab_size,
        "max_position_embeddings": geom.max_position,
        "hidden_size": geom.hidden_size,
        "num_hidden_layers": geom.n_layers,
        "num_attention_heads": geom.n_heads,
        "num_key_value_heads": geom.n_kv_heads,
        "head_size": geom.head_dim,
        "hidden_act": "silu",
        "intermediate_size": hf_cfg.intermediate_size,
        "norm_epsilon": hf_cfg.rms_norm_eps,
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": geom.rope_theta,
        "rotary_scaling": scaling,
        "tie_word_embeddings": bool(hf_cfg.tie_word_embeddings),
        "mlp_bias": bool(getattr(hf_cfg, "mlp_bias", False)),
        "attn_bias": bool(getattr(hf_cfg, "attention_bias", False)),
        "mapping": {"world_size": tp, "tp_size": tp, "pp_size": 1},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": kv_algo, "group_size": 128, "has_zero_point": False, "pre_quant_scale": False, "exclude_modules": None},
    }
    if fp8_algo:  # the source's FP8 MLP weights kept (fp8_mlp); TensorRT-LLM's quantizers skip what exclude_modules matches (fnmatch)
        cfg["quantization"] |= {"quant_algo": fp8_algo, "exclude_modules": fp8_excluded(geom, fp8_algo, fp8_layers)}
        if fp8_algo == "NVFP4":
            cfg["quantization"]["group_size"] = 16  # NVFP4's block
        if clamp_val:  # fbgemm_fp8's activation_scale_ub: the per-token quantizers clamp activations to it (QuantConfig.clamp_val)
            cfg["quantization"]["clamp_val"] = clamp_val
    if num_experts(hf_cfg):  # LLaMAConfig/QWenConfig.from_hugging_face: explicit gated activation; the routing as the model routes
        cfg |= {"hidden_act": "swiglu", "moe": moe_block(hf_cfg)}
        cfg["mapping"] |= {"moe_tp_size": tp, "moe_ep_size": 1}
    if cfg["architecture"] == "Qwen2ForCausalLM":  # QWenConfig's fields (tensorrt_llm/models/qwen/config.py): q/k/v biases, no dense bias
        cfg |= {"qwen_type": "qwen2", "attn_bias": True, "mlp_bias": False, "use_logn_attn": False}
    if cfg["architecture"] in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):  # no biases; QWenDecoderLayer turns on qk_layernorm (RmsNorm) for both
        cfg |= {"qwen_type": hf_cfg.model_type, "attn_bias": False, "mlp_bias": False, "use_logn_attn": False}
    if cfg["architecture"] == "Qwen2MoeForCausalLM":  # Qwen2's q/k/v biases; SharedMoE with the shared expert's size
        cfg |= {"qwen_type": "qwen2_moe", "attn_bias": True, "mlp_bias": False, "use_logn_attn": False}
    if cfg["architecture"] in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):  # QWenDecoderLayer sizes the experts by moe_intermediate_size
        cfg |= {"moe_intermediate_size": expert_intermediate_size(hf_cfg), "moe_shared_expert_intermediate_size": shared_expert_size(hf_cfg)}
    return cfg


def rank_weights(state: dict[str, torch.Tensor], geom, tp: int, rank: int, kv_scales: torch.Tensor | None, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One rank's tensors from a (folded) HF Llama state dict (meta tensors give the rank's plan)."""
    out = global_rank_tensors(state, tp, rank, dtype)
    for i in range(geom.n_layers):
        out |= layer_rank_tensors(state, geom, i, tp, rank, kv_scales, dtype)
    return out


def global_rank_tensors(state: dict[str, torch.Tensor], tp: int, rank: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Embedding (replicated), lm_head (padded to a multiple of tp, split on rows), final norm."""
    emb = state["model.embed_tokens.weight"]
    lm = state.get("lm_head.weight", emb)
    pad = (-lm.shape[0]) % tp
    if pad:
        lm = torch.cat([lm, lm.new_zeros(pad, lm.shape[1])])
    out = {"transformer.vocab_embedding.weight": emb, "lm_head.weight": _split(lm, tp, rank, 0), "transformer.ln_f.weight": state["model.norm.weight"]}
    return {k: v.to(dtype) for k, v in out.items()}


def layer_rank_tensors(state: dict[str, torch.Tensor], geom, i: int, tp: int, rank: int, kv_scales: torch.Tensor | None, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One rank's tensors of decoder layer i; `state` needs only that layer's (folded) HF tensors."""
    out: dict[str, torch.Tensor] = {}
    hd, nkv = geom.head_dim, geom.n_kv_heads
    p, t = f"model.layers.{i}.", f"transformer.layers.{i}."
    wq = state[p + "self_attn.q_proj.weight"]
    wk = _dup_kv(state[p + "self_attn.k_proj.weight"], nkv, tp)
    wv = _dup_kv(state[p + "self_attn.v_proj.weight"], nkv, tp)
    assert wk.shape[0] % (tp * hd) == 0
    out[t + "attention.qkv.weight"] = torch.cat([_split(wq, tp, rank, 0), _split(wk, tp, rank, 0), _split(wv, tp, rank, 0)])
    if p + "self_attn.q_proj.bias" in state:
        bq, bk, bv = (state[p + f"self_attn.{n}_proj.bias"] for n in "qkv")
        bk, bv = (_dup_kv(b.unsqueeze(1), nkv, tp).squeeze(1) for b in (bk, bv))
        out[t + "attention.qkv.bias"] = torch.cat([_split(bq, tp, rank, 0), _split(bk, tp, rank, 0), _split(bv, tp, rank, 0)])
    out[t + "attention.dense.weight"] = _split(state[p + "self_attn.o_proj.weight"], tp, rank, 1)
    if p + "self_attn.k_norm.weight" in state:  # Qwen3: one [head_size] weight per layer for every head, replicated
        out[t + "attention.q_layernorm.weight"] = state[p + "self_attn.q_norm.weight"]
        out[t + "attention.k_layernorm.weight"] = state[p + "self_attn.k_norm.weight"]
    out[t + "input_layernorm.weight"] = state[p + "input_layernorm.weight"]
    out[t + "post_layernorm.weight"] = state[p + "post_attention_layernorm.weight"]
    if p + EXPERTS[0] in state:  # Mixtral, Qwen2/3-MoE: [E, 2I, H] rows gate | up (Phi3-style chunk), [E, H, I]
        gate, up = state[p + EXPERTS[0]].chunk(2, dim=1)
        out[t + "mlp.fc.weight"] = torch.cat([_split(up, tp, rank, 1), _split(gate, tp, rank, 1)], dim=1)  # w3 | w1
        out[t + "mlp.proj.weight"] = _split(state[p + EXPERTS[1]], tp, rank, 2)
        if p + "mlp.shared_expert.up_proj.weight" in state:  # Qwen2-MoE: this rank's up | gate rows, as the experts' fc
            s = p + "mlp.shared_expert."
            out[t + "mlp.shared_expert.fc.weight"] = torch.cat([_split(state[s + "up_proj.weight"], tp, rank, 0), _split(state[s + "gate_proj.weight"], tp, rank, 0)])
            out[t + "mlp.shared_expert.proj.weight"] = _split(state[s + "down_proj.weight"], tp, rank, 1)
            out[t + "mlp.shared_expert_gate.weight"] = state[p + "mlp.shared_expert_gate.weight"]
    else:
        out[t + "mlp.fc.weight"] = _split(state[p + "mlp.gate_proj.weight"], tp, rank, 0)
        out[t + "mlp.gate.weight"] = _split(state[p + "mlp.up_proj.weight"], tp, rank, 0)
        out[t + "mlp.proj.weight"] = _split(state[p + "mlp.down_proj.weight"], tp, rank, 1)
    out = {k: v.to(dtype) for k, v in out.items()}
    if p + EXPERTS[2] in state:  # the router stays float32 (the converter loads block_sparse_moe.gate as float32)
        out[t + "mlp.router.weight"] = state[p + EXPERTS[2]].float()
    if kv_scales is not None:
        out[t + "attention.kv_cache_scaling_factor"] = kv_scales[i].reshape(1).float()
    return out


MLP_NAMES = (("gate_proj", "fc", 0), ("up_proj", "gate", 0), ("down_proj", "proj", 1))  # HF -> TensorRT-LLM (fc is gate_proj), split dim


def nvfp4_mlp(src, geom, hf_cfg, tp: int = 1) -> tuple[str | None, str, list[int]]:
    """fp8_mlp for an NVFP4 source (models.nvfp4_weights): ("NVFP4", '', the layers whose MLP is NVFP4) when trtllm_ckpt/ can
    hold its MLP weights as stored, in the layout Model Optimizer's TensorRT-LLM exporter writes for quant_algo NVFP4
    (`weight` uint8 e2m1 codes, `weights_scaling_factor` float8 block scales [out, in / 16], `weights_scaling_factor_2` and
    `activation_scaling_factor` float32 scalars), else (None, why not, [])."""
    from kvcompress.models.nvfp4_weights import BLOCK
    from kvcompress.models.quantized import quantization_config

    q = quantization_config(src.dir) or {}
    if num_experts(hf_cfg):
        return None, "a mixture of experts: kvcompress writes no NVFP4 expert layout for TensorRT-LLM", []
    if str(q.get("quant_method", "")).lower() != "modelopt":
        return None, ("compressed-tensors stores the reciprocal of the global scale TensorRT-LLM multiplies by, and its float32 inverse "
                      "would not define the validated weights exactly (hf_ckpt/ keeps them)"), []
    if str(q.get("quant_algo")).upper() != "NVFP4":
        return None, f"TensorRT-LLM has no weight-only NVFP4 quant_algo for {q.get('quant_algo')} (hf_ckpt/ keeps them)", []
    layers = []
    for i in range(geom.n_layers):
        names = [f"model.layers.{i}.mlp.{hf}.weight" for hf, _, _ in MLP_NAMES]
        nv = [k in src.nvfp4 and src.nvfp4[k]["layout"] == "modelopt" and "input" in src.nvfp4[k] for k in names]
        if not any(nv):
            continue
        if not all(nv):
            return None, f"layer {i}'s MLP is partly NVFP4 with static input scales under these names ({', '.join(n for n, f in zip(names, nv) if f)})", []
        inter = src.shape(names[2])[1]
        if (inter // tp) % BLOCK:
            return None, f"at tp {tp} a rank's {inter // tp} MLP columns do not hold whole blocks of {BLOCK} (NVFP4's block scales)", []
        layers.append(i)
    if not layers:
        return None, "no layer's MLP is stored as NVFP4 under Llama names", []
    return "NVFP4", "", layers


def fp8_mlp(src, geom, hf_cfg, tp: int = 1) -> tuple[str | None, str, list[int]]:
    """(TensorRT-LLM quant_algo, '', the layers whose MLP is FP8) when trtllm_ckpt/ can hold the FP8 source `src` (a streaming
    Checkpoint)'s MLP weights as stored, else (None, why not: the manifest's word, []). "FP8": float8 e4m3 with one scale per
    tensor and a static input scale everywhere; "FP8_PER_CHANNEL_PER_TOKEN": one scale per output row (or per tensor, spread
    over the rows) with activations quantized per token at run time (the source's dynamic activations). A layer whose MLP the
    source keeps unquantized (Meta's FP8 Llama 3.1 405B: the first and the last) is written in `dtype` and excluded."""
    from kvcompress.models.fp8_weights import scale_name

    if src.nvfp4:
        return nvfp4_mlp(src, geom, hf_cfg, tp)
    if num_experts(hf_cfg):
        return None, "a mixture of experts: kvcompress writes no FP8 expert layout for TensorRT-LLM", []
    static, layers = True, []
    for i in range(geom.n_layers):
        names = [f"model.layers.{i}.mlp.{hf}.weight" for hf, _, _ in MLP_NAMES]
        fp8 = [k in src.entries and src.stored_dtype(k) == torch.float8_e4m3fn for k in names]
        if not any(fp8):
            continue
        if not all(fp8):
            return None, f"layer {i}'s MLP is partly float8 e4m3 under these names ({', '.join(n for n, f in zip(names, fp8) if f)})", []
        for k in names:
            sk = scale_name(src.entries, k)
            shape = src.shape(sk) if sk else [0]
            rows = src.shape(k)[0]
            if math.prod(shape) != 1 and shape not in ([rows], [rows, 1]):  # by shape: a block grid can hold as many scales as rows
                return None, ("its FP8 weights have block scales; trtllm-build's FP8 layers take one scale per tensor (quant_algo FP8) "
                              "or per output row (FP8_PER_CHANNEL_PER_TOKEN), and FP8_BLOCK_SCALES is a PyTorch-backend format "
                              "(hf_ckpt/ keeps them)"), []
            si = k.removesuffix("weight") + "input_scale"
            static = static and math.prod(shape) == 1 and si in src.entries and math.prod(src.shape(si)) == 1
        layers.append(i)
    if not layers:
        return None, "no layer's MLP is stored as float8 e4m3 under Llama names", []
    return ("FP8" if static else "FP8_PER_CHANNEL_PER_TOKEN"), "", layers


def fp8_excluded(geom, algo: str, layers: list[int]) -> list[str]:
    """quantization.exclude_modules of a checkpoint with FP8 MLPs in `layers`: every attention (folded, in `dtype`), the MLPs
    of the other layers, lm_head; for FP8_PER_CHANNEL_PER_TOKEN also the norms that feed an unquantized module, which
    TensorRT-LLM's fp8_rowwise_quantize would otherwise turn into per-token quantizing norms (its Meta recipe excludes
    '*input_layernorm' with '*attention' for that reason)."""
    out = [f"transformer.layers.{i}.attention*" for i in range(geom.n_layers)]
    rest = [i for i in range(geom.n_layers) if i not in layers]
    out += [f"transformer.layers.{i}.mlp*" for i in rest]
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":
        out += [f"transformer.layers.{i}.input_layernorm" for i in range(geom.n_layers)]
        out += [f"transformer.layers.{i}.post_layernorm" for i in rest]
    return out + ["lm_head"]


class TrtllmWriter:
    """Writes the rank files of one tp size tensor by tensor (kvcompress.targets.st_writer): the
    plan comes from the model's meta tensors; layers arrive one at a time, the embedding and
    lm_head in row blocks. Nothing larger than one layer is held."""

    def __init__(self, meta_state: dict[str, torch.Tensor], geom, out_dir: Path, tp: int, dtype: str, kv_algo: str | None,
                 kv_scales: torch.Tensor | None, hf_config, fp8_source=None):
        from kvcompress.targets.st_writer import SafetensorsWriter

        check_tp(geom, tp, hf_config)
        self.geom, self.dir, self.tp, self.dtype_name, self.dtype = geom, Path(out_dir), tp, dtype, DTYPES[dtype]
        self.kv_algo, self.kv_scales, self.hf_config = kv_algo, kv_scales, hf_config
        self.vocab = meta_state["model.embed_tokens.weight"].shape[0]
        # fp8_source (the FP8 source's models.checkpoint.Checkpoint): its MLP weights kept as stored where TensorRT-LLM's FP8 takes them
        self.fp8_algo, self.fp8_why, self.fp8_layers = (None, None, []) if fp8_source is None else fp8_mlp(fp8_source, geom, hf_config, tp)
        self.src = fp8_source if self.fp8_algo else None
        self.clamp_val = None  # Meta's fbgemm_fp8 bounds activations before quantizing them per token, as TensorRT-LLM's converter carries it
        if self.src is not None and self.fp8_algo == "FP8_PER_CHANNEL_PER_TOKEN":
            from kvcompress.models.quantized import quantization_config

            q = quantization_config(self.src.dir) or {}
            if q.get("quant_method") == "fbgemm_fp8" and q.get("activation_scale_ub"):
                self.clamp_val = [-float(q["activation_scale_ub"]), float(q["activation_scale_ub"])]
        self.writers = []
        for r in range(tp):
            plan = {k: (v.dtype, tuple(v.shape)) for k, v in rank_weights(meta_state, geom, tp, r, kv_scales, self.dtype).items()}
            if self.src is not None:
                plan |= {k: (v.dtype, tuple(v.shape)) for i in self.fp8_layers for k, v in self._fp8_layer(None, i, r).items()}
            self.writers.append(SafetensorsWriter(self.dir / f"rank{r}.safetensors", plan, {"format": "pt"}))

    def _fp8_read(self, state: dict[str, torch.Tensor], i: int) -> dict[str, tuple]:
        """Layer i's FP8 MLP weights as stored in the source, each checked first to define exactly the validated model's
        (state's) value: {HF name: (float8 weight, its scales as written)}, read once for every rank. quant_algo FP8: the
        weight scale [1] and the static activation scale [1]; FP8_PER_CHANNEL_PER_TOKEN: one scale per output row [rows]."""
        from kvcompress.models.fp8_weights import scale_name
        from kvcompress.targets.hf_ckpt import check_stored_fp8

        src, out = self.src, {}
        if self.fp8_algo == "NVFP4":  # codes and block scales as stored, the global and input scales as float32 scalars
            for hf, _, _ in MLP_NAMES:
                k = f"model.layers.{i}.mlp.{hf}.weight"
                if not torch.equal(src.read(k).to(state[k].dtype), state[k]):  # the reader's dequantization of those bytes
                    raise RuntimeError(f"trtllm_ckpt: the NVFP4 weight {k!r} was changed before writing; its stored codes no longer define it")
                parts = src.nvfp4[k]
                out[k] = (src.read_stored(parts["codes"]), src.read_stored(parts["scale"]), *(src.read_stored(parts[r]).float().reshape(()) for r in ("global", "input")))
            return out
        for hf, _, _ in MLP_NAMES:
            k = f"model.layers.{i}.mlp.{hf}.weight"
            raw = src.read_stored(k)
            check_stored_fp8(src, k, raw, state[k], 0, "trtllm_ckpt")
            ws = src.read_stored(scale_name(src.entries, k)).float().reshape(-1)
            if self.fp8_algo == "FP8":
                out[k] = (raw, ws, src.read_stored(k.removesuffix("weight") + "input_scale").float().reshape(1))
            else:
                out[k] = (raw, ws.expand(raw.shape[0]).contiguous())
        return out

    def _fp8_layer(self, stored: dict[str, tuple] | None, i: int, rank: int) -> dict[str, torch.Tensor]:
        """Rank `rank`'s FP8 MLP tensors of layer i from _fp8_read's (None: meta tensors, for the plan). Per-row scales follow
        their weight's rows: split with fc and gate, whole with proj (split on its columns)."""
        out = {}
        for hf, t, dim in MLP_NAMES:
            k, n = f"model.layers.{i}.mlp.{hf}.weight", f"transformer.layers.{i}.mlp.{t}."
            if stored is None and self.fp8_algo == "NVFP4":
                codes, scale = (list(self.src.entries[self.src.nvfp4[k][r]][1]["shape"]) for r in ("codes", "scale"))
                codes[dim] //= self.tp
                scale[dim] //= self.tp
                out |= self._fp8_names(n, (torch.empty(codes, dtype=torch.uint8, device="meta"), torch.empty(scale, dtype=torch.float8_e4m3fn, device="meta"),
                                           torch.empty((), device="meta"), torch.empty((), device="meta")))
                continue
            if stored is None:
                shape = self.src.shape(k)
                rows = shape[0]
                shape[dim] //= self.tp
                meta = torch.empty(shape, dtype=torch.float8_e4m3fn, device="meta")
                stored_k = (meta, torch.empty(1, device="meta"), torch.empty(1, device="meta")) if self.fp8_algo == "FP8" else \
                    (meta, torch.empty(rows // self.tp if dim == 0 else rows, device="meta"))
                out |= self._fp8_names(n, stored_k)
                continue
            raw, *scales = stored[k]
            if self.fp8_algo == "NVFP4":  # the block scales follow their codes: rows for fc and gate, column blocks for proj
                out |= self._fp8_names(n, (_split(raw, self.tp, rank, dim), _split(scales[0], self.tp, rank, dim), *scales[1:]))
                continue
            if self.fp8_algo != "FP8" and dim == 0:
                scales = [_split(scales[0], self.tp, rank, 0)]
            out |= self._fp8_names(n, (_split(raw, self.tp, rank, dim), *scales))
        return out

    def _fp8_names(self, n: str, t: tuple) -> dict[str, torch.Tensor]:
        if self.fp8_algo == "NVFP4":
            return {n + "weight": t[0], n + "weights_scaling_factor": t[1], n + "weights_scaling_factor_2": t[2], n + "activation_scaling_factor": t[3]}
        if self.fp8_algo == "FP8":
            return {n + "weight": t[0], n + "weights_scaling_factor": t[1], n + "activation_scaling_factor": t[2]}
        return {n + "weight": t[0], n + "per_channel_scale": t[1]}

    def weights_note(self) -> dict:
        """The manifest's word on how the weights were written."""
        dt = self.dtype_name
        if self.src is not None:
            how = {"FP8": "float8 e4m3 weights with their per-tensor weight and static activation scales",
                   "NVFP4": "e2m1 weights with their fp8 block scales, global scales and static input scales; activations quantized to FP4 at run time"
                   }.get(self.fp8_algo, "float8 e4m3 weights with their weight scales per output row; activations quantized per token at run time")
            kind = "NVFP4" if self.fp8_algo == "NVFP4" else "FP8"
            return {"fp8_weights_kept": True, "weights": f"the source's {kind} MLP weights kept as stored (quant_algo {self.fp8_algo}: "
                    f"{3 * len(self.fp8_layers)} {how}); embedding and, listed in exclude_modules, "
                    f"attention (folded), lm_head{', the MLPs the source keeps unquantized' if len(self.fp8_layers) < self.geom.n_layers else ''}"
                    f" in {dt}" + ("; TensorRT-LLM runs NVFP4 GEMMs on Blackwell GPUs (compute capability 10.0 and later) only: for an "
                                   "earlier GPU, export.fp8_weights=dequantize writes them dequantized" if kind == "NVFP4" else "")}
        if self.fp8_why:
            return {"fp8_weights_kept": False, "fp8_dequantized_why": self.fp8_why, "weights": f"{dt}: the source's FP8 weights dequantized, because {self.fp8_why}"}
        return {"fp8_weights_kept": False, "weights": dt}

    def write_rows(self, key: str, lo: int, rows: torch.Tensor) -> None:
        """Rows lo.. of model.embed_tokens.weight / lm_head.weight (HF names) / the final norm."""
        rows = rows.to(self.dtype)
        if key == "model.norm.weight":
            for w in self.writers:
                w.write("transformer.ln_f.weight", rows)
            return
        if key == "model.embed_tokens.weight":
            for w in self.writers:
                w.write("transformer.vocab_embedding.weight", rows, row=lo)
        if key == "lm_head.weight" or (key == "model.embed_tokens.weight" and self.hf_config.tie_word_embeddings):
            per = (self.vocab + (-self.vocab) % self.tp) // self.tp  # rows per rank of the padded lm_head
            hi = lo + rows.shape[0]
            for r, w in enumerate(self.writers):
                a, b = max(lo, r * per), min(hi, (r + 1) * per)
                if a < b:
                    w.write("lm_head.weight", rows[a - lo : b - lo], row=a - r * per)
                if hi == self.vocab and r == self.tp - 1 and self.vocab < (r + 1) * per:  # zero padding rows
                    w.write("lm_head.weight", rows.new_zeros((r + 1) * per - self.vocab, rows.shape[1]), row=self.vocab - r * per)

    def write_layer(self, state: dict[str, torch.Tensor], i: int) -> None:
        stored = self._fp8_read(state, i) if self.src is not None and i in self.fp8_layers else None
        for r, w in enumerate(self.writers):
            out = layer_rank_tensors(state, self.geom, i, self.tp, r, self.kv_scales, self.dtype)
            if stored is not None:
                out |= self._fp8_layer(stored, i, r)
            for k, v in out.items():
                w.write(k, v)

    def close(self) -> Path:
        for w in self.writers:
            w.close()
        atomic_write_json(self.dir / "config.json", trtllm_config(self.hf_config, self.geom, self.tp, self.dtype_name, self.kv_algo, self.fp8_algo,
                                                                   self.fp8_layers, self.clamp_val))
        return self.dir

    def abort(self) -> None:
        for w in self.writers:
            w.abort()


def write_checkpoint(model_or_state, geom, out_dir: Path, tp: int, dtype: str, kv_algo: str | None, kv_scales: torch.Tensor | None, hf_config=None) -> Path:
    """Write config.json and rank{r}.safetensors for tensor parallel size tp (one call, whole model).

    model_or_state: a transformers model, or a (folded) HF state dict with its `hf_config`.
    """
    from kvcompress.models.fused import unfuse

    if hasattr(model_or_state, "state_dict"):
        hf_config = model_or_state.config
        state = unfuse({k: v.detach() for k, v in model_or_state.state_dict().items()}, geom)
    else:
        state = model_or_state
    if hf_config.tie_word_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    meta = {k: torch.empty_like(v, device="meta") for k, v in state.items()}
    w = TrtllmWriter(meta, geom, out_dir, tp, dtype, kv_algo, kv_scales, hf_config)
    try:
        for k in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            if k in state:
                w.write_rows(k, 0, state[k])
        for i in range(geom.n_layers):
            w.write_layer(state, i)
        return w.close()
    except BaseException:
        w.abort()
        raise


def read_config(ckpt: Path) -> dict:
    return json.loads((Path(ckpt) / "config.json").read_text())
