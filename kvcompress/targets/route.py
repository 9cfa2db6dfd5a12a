"""Where a model can go: which artifacts can carry it (the TensorRT-LLM checkpoint and the custom tier implement the Llama
layer; a known family beyond it goes out as the folded FP8 HF checkpoint alone), what the export needs (disk, GPUs for the
checkpoint's weights) and whether an engine can be built here. Checked before profiling (pipeline) and again by the export
stage, so a run says what cannot be written before the hours of validation, not after.
"""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import torch

from kvcompress.errors import UserError
from kvcompress.models.base import Geometry
from kvcompress.targets.trtllm_ckpt import check_tp, trtllm_config

EXPORT_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # targets.trtllm_reader.rope_inv_freq re-measures these
SUPPORTED_ARCH = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                  "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
EVERY_LAYER_MOE = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")  # configs that can place dense layers among the expert layers
# written as the folded FP8 HF checkpoint only (hf_ckpt: TensorRT-LLM's PyTorch backend and vLLM run the model's own code from
# config.json, sliding windows, GeGLU, sandwich norms and all); no TensorRT-LLM checkpoint (the reader and the custom-tier
# graph implement the Llama layer), so kv=native_fp8 only
# Beyond Gemma 3, the families whose fold (key factors, pair rotations, value factors) is exact in transformers' modeling code
# (tests/test_architectures.py folds a fitted native_fp8 ScaleBook into each and compares logits) and whose folded checkpoint
# exports and re-measures. Llama 4 (a weightless norm of q and k after RoPE) and HunYuan (q/k layernorms after RoPE) fold their
# values only (profile.fold_obstacles: fit leaves their keys unfolded); not here: BitNet (its value fold is blocked by the
# attention output's norm, and its servers re-quantize the weights to ternary, which folded rows would not survive). GPT-OSS:
# its MXFP4 experts are copied as stored (targets.hf_ckpt, export.fp8_weights=keep), its bfloat16 attention folded (sinks and
# biases: the fold is exact)
HF_ONLY_ARCH = ("Gemma3ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM", "Cohere2ForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM",
                "OlmoeForCausalLM", "GraniteForCausalLM", "GraniteMoeForCausalLM", "GlmForCausalLM", "Glm4ForCausalLM", "SmolLM3ForCausalLM",
                "Exaone4ForCausalLM", "SeedOssForCausalLM", "Ernie4_5ForCausalLM", "ApertusForCausalLM", "ArceeForCausalLM", "MinistralForCausalLM",
                "HeliumForCausalLM", "GptOssForCausalLM", "Llama4ForCausalLM", "HunYuanDenseV1ForCausalLM",
                "HunYuanMoEV1ForCausalLM")
BF16_ARCH = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM")  # trained and served in bfloat16: export.dtype=float16 is refused


def hf_only(model) -> bool:
    """The export writes this model's folded FP8 HF checkpoint only (export_route)."""
    return export_route(model)[0]


def export_route(model) -> tuple[bool, str]:
    """(HF checkpoint only?, why). The TensorRT-LLM checkpoint, its reader and the custom-tier graph implement the Llama
    layer (trtllm_obstacle); where they cannot carry a model of a known family, the folded FP8 HF checkpoint still can:
    TensorRT-LLM's PyTorch backend and vLLM run it with the model's own code (windows, biases, RoPE variants, MLPs), and
    the re-measure reads it through transformers. Gemma 3 (HF_ONLY_ARCH) always goes that way. An architecture outside
    both lists is refused (the fold's tensor names are the Llama family's)."""
    arch = type(model).__name__
    if arch in HF_ONLY_ARCH:
        return True, f"{arch}: kvcompress's TensorRT-LLM checkpoint writer, its reader and the custom-tier graph implement the Llama layer"
    if arch not in SUPPORTED_ARCH:
        raise UserError(f"export=trtllm supports {', '.join(SUPPORTED_ARCH)} (and, as the FP8 HF checkpoint with kv=native_fp8, "
                        f"{', '.join(HF_ONLY_ARCH)}); this model is {arch}: add export=none to profile, fit and validate it")
    why = trtllm_obstacle(model)
    return bool(why), why


def check_exportable(model, spec=None, dtype: str | None = None) -> None:
    """export=trtllm: say before profiling, not after validating, what cannot be written. Where the TensorRT-LLM
    checkpoint cannot carry the model (export_route), the folded FP8 HF checkpoint is written alone, the native tier's
    hf_ckpt: the run's kv `spec` must then be native_fp8 (what hf_ckpt holds; nothing else would ship what was
    validated), and Gemma's weights bfloat16 or float32 (`dtype`, export.dtype), as Gemma is trained and served (its
    residual stream outgrows float16)."""
    only_hf, why = export_route(model)
    arch = type(model).__name__
    if not only_hf:
        D = Geometry.from_hf_config(model.config).head_dim
        if spec is not None and spec.format == "kvcompress" and D & (D - 1):
            raise UserError(f"export=trtllm: the custom tier's kernels (kv={spec.name}) take a power-of-two head_dim; this {arch} has head_dim={D}: "
                            "use kv=native_int8 or kv=native_fp8 (the native tier), or add export=none")
        return
    if spec is not None and spec.format != "native_fp8":
        raise UserError(f"export=trtllm writes this {arch} as the folded FP8 Hugging Face checkpoint only (hf_ckpt, for TensorRT-LLM's PyTorch "
                        f"backend and vLLM; {why}); kv={spec.name} is not that format: use kv=native_fp8, or add export=none")
    if dtype == "float16" and arch in BF16_ARCH:
        raise UserError(f"export.dtype=float16: {arch} is trained and served in bfloat16 (its residual stream outgrows float16's range); "
                        "allowed for it: bfloat16, float32")


TP_CHOICES = (2, 4, 8, 16)  # the tensor-parallel sizes tp_advice suggests


def export_disk(n_params: int, tp_sizes: list[int], only_hf: bool, bytes_per_param: float) -> float:
    """Disk bytes of the export's checkpoints at bytes_per_param: a full copy of the weights per TensorRT-LLM tp size and one
    for hf_ckpt (the plugin bundle's kernels are small beside them)."""
    return n_params * bytes_per_param * ((0 if only_hf else len(tp_sizes)) + 1)


def _free_bytes(where: Path) -> tuple[Path, int]:
    """The free bytes of the filesystem `where` will be on (its nearest existing parent: a run directory may not exist yet)."""
    where = Path(where).absolute()
    while not where.exists():
        where = where.parent
    return where, shutil.disk_usage(where).free


def disk_warning(where: Path, n_params: int, tp_sizes: list[int], only_hf: bool) -> str:
    """'' when the export's checkpoints at 2 bytes a parameter fit the free space under `where`, else one line saying so
    (before profiling: FP8 weights kept as stored take half, so this warns and check_disk refuses)."""
    where, free = _free_bytes(where)
    need = export_disk(n_params, tp_sizes, only_hf, 2)
    return "" if need <= free else (f"its checkpoints take about {need / 1e9:.1f} GB at 2 bytes a parameter and {free / 1e9:.1f} GB are free "
                                    f"under {where}: free space, write fewer export.tp_sizes or set hydra.run.dir on a larger disk")


def check_disk(where: Path, n_params: int, tp_sizes: list[int], only_hf: bool) -> None:
    """Refuse, before anything is written, an export whose checkpoints cannot fit the free space under `where` even at one
    byte a parameter (every weight FP8); otherwise a full disk would stop it halfway, after the hours of validation."""
    where, free = _free_bytes(where)
    low = export_disk(n_params, tp_sizes, only_hf, 1)
    if low > free:
        n = int(round(low / n_params))
        raise UserError(f"export: its {n} checkpoint(s) of {n_params / 1e9:.2f}B parameters need at least {low / 1e9:.1f} GB and {free / 1e9:.1f} GB "
                        f"are free under {where}: free space, write fewer export.tp_sizes or set hydra.run.dir on a larger disk; nothing was written")


def tp_advice(weight_bytes: float, tp_sizes: list[int], gpu_memory_gb: float, geom, hf_cfg) -> str:
    """'' when the largest of export.tp_sizes puts at most export.gpu_memory_gb of the TensorRT-LLM checkpoint's weights
    (weight_bytes in all) on each GPU, else one line saying so, with the smallest size of TP_CHOICES whose share fits and
    the model's shapes allow (trtllm_ckpt.check_tp)."""
    gpu, tp = gpu_memory_gb * 1e9, max(tp_sizes)
    if weight_bytes / tp <= gpu:
        return ""

    def allowed(t: int) -> bool:
        try:
            check_tp(geom, t, hf_cfg)
            return True
        except UserError:
            return False

    fit = next((t for t in TP_CHOICES if t > tp and weight_bytes / t <= gpu and allowed(t)), None)
    return (f"trtllm_ckpt at tp {tp} puts {weight_bytes / tp / 1e9:.1f} GB of weights on each GPU, more than export.gpu_memory_gb={gpu_memory_gb:g}: "
            + (f"add export.tp_sizes=[{fit}]" if fit else f"no tensor-parallel size of {list(TP_CHOICES)} the model's shapes allow brings it under"))


def trtllm_obstacle(model) -> str:
    """'' when the TensorRT-LLM checkpoint (and the custom tier) can carry this model of SUPPORTED_ARCH, else why not.
    A Mistral model is a Llama forward (same tensors, same attention) unless it has a sliding window, which
    the checkpoint cannot carry (TensorRT-LLM maps MistralForCausalLM to its Llama class); Phi-3/Phi-4 are the Llama
    forward with fused q/k/v and gate/up matrices (split on reading, models.fused), written as Llama; Mixtral is the
    Llama attention with a mixture-of-experts MLP (TensorRT-LLM's Llama class with its `moe` block); Qwen2 is the
    Llama layer with q/k/v biases, Qwen3 the Llama layer with a per-head q/k RMSNorm before RoPE (TensorRT-LLM's
    QWen class, the same tensor names); Qwen3-MoE is Qwen3's attention with Mixtral's expert tensors in every layer
    (the QWen class, qwen_type qwen3_moe), Qwen2-MoE Qwen2's attention with those experts and a shared expert behind
    a sigmoid gate (qwen_type qwen2_moe): a model of either with dense layers among its expert layers (mlp_only_layers,
    decoder_sparse_step > 1) cannot be written, as the checkpoint gives every layer the same MLP. A sliding_window of 0
    or None is no window (Qwen2-MoE's config says 0 when use_sliding_window is off)."""
    arch, cfg = type(model).__name__, model.config
    dense, step = list(getattr(cfg, "mlp_only_layers", None) or []), int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    if arch in EVERY_LAYER_MOE and (dense or step != 1):
        return (f"the TensorRT-LLM checkpoint has an expert MLP in every layer; this {arch} has dense layers (mlp_only_layers={dense}, "
                f"decoder_sparse_step={step}; allowed: [] and 1)")
    window, positions = getattr(cfg, "sliding_window", None), getattr(cfg, "max_position_embeddings", None)
    sliding = "sliding_attention" in (getattr(cfg, "layer_types", None) or [])
    if sliding or (window and (positions is None or window < positions)):
        return f"the TensorRT-LLM checkpoint has no attention window; this {arch} has sliding_window={window} < max_position_embeddings={positions}"
    biases = [n for n in ("attention_bias", "mlp_bias") if getattr(cfg, n, False)]
    if biases:  # Llama's attention_bias also puts a bias on o_proj: neither the checkpoint writer nor the custom-tier graph carries it
        return f"the TensorRT-LLM checkpoint carries q/k/v biases only (Qwen2's); this {arch} has {' and '.join(f'{n}=True' for n in biases)}"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if kind not in EXPORT_ROPE_TYPES:  # the checkpoint reader (and so the re-measure of what ships) implements these only
        return f"the TensorRT-LLM checkpoint is written with RoPE scaling of type {', '.join(EXPORT_ROPE_TYPES)}; this {arch} has rope_type={kind!r}"
    from kvcompress.stages.profile import rotary_dim

    g = Geometry.from_hf_config(cfg)
    r = rotary_dim(model, g)
    if r < g.head_dim:  # Phi-4-mini, GPT-NeoX: a Llama checkpoint rotates every channel
        return f"the TensorRT-LLM checkpoint rotates the whole head; this {arch} rotates {r} of its {g.head_dim} head channels (partial rotary)"
    mismatch = rope_mismatch(model)
    if mismatch:
        return f"the TensorRT-LLM checkpoint's RoPE {kind}, as TensorRT-LLM computes it, differs from this {arch}'s own ({mismatch})"
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        return f"the TensorRT-LLM checkpoint is a Llama checkpoint (SiLU gated MLP); this {arch} has hidden_act={act!r}"
    return ""


def rope_mismatch(model) -> str:
    """'' when the RoPE the checkpoint config describes, as TensorRT-LLM computes it (trtllm_reader.rope_inv_freq and
    rope_scale on trtllm_ckpt's rotary_scaling), is the model's own (its rotary module's inv_freq and attention_scaling);
    else what differs. transformers and TensorRT-LLM read some YaRN settings differently (an explicit attention_factor,
    truncate=false, mscale without mscale_all_dim or the reverse): such a checkpoint would serve another model."""
    from kvcompress.targets.trtllm_reader import rope_inv_freq, rope_scale

    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    own = getattr(rotary, "inv_freq", None)
    if own is None:
        return ""
    geom = Geometry.from_hf_config(model.config)
    rc = trtllm_config(model.config, geom, 1, "float16", None)
    inv, scale = rope_inv_freq(geom.head_dim, rc["rotary_base"], rc["rotary_scaling"]), rope_scale(rc["rotary_scaling"])
    own_scale = float(getattr(rotary, "attention_scaling", 1.0))
    out = []
    if own.numel() != inv.numel() or not torch.allclose(inv.double(), own.detach().cpu().double(), rtol=1e-5, atol=0):
        out.append("inverse frequencies")
    if abs(scale - own_scale) > 1e-6 * max(1.0, own_scale):
        out.append(f"cos/sin scale {scale:.6g} vs {own_scale:.6g}")
    return ", ".join(out)


def engine_status(policy: str) -> tuple[bool, str]:
    """(build now?, why) for export.build_engine; `always` without TensorRT-LLM + GPU is a user error."""
    have_trtllm = importlib.util.find_spec("tensorrt_llm") is not None
    have_gpu = torch.cuda.is_available()
    missing = [n for n, ok in (("tensorrt_llm", have_trtllm), ("a CUDA GPU", have_gpu)) if not ok]
    if policy == "never":
        return False, "export.build_engine=never"
    if missing:
        if policy == "always":
            raise UserError(f"export.build_engine=always but this machine lacks {' and '.join(missing)}; use build_engine=auto or run on a TensorRT-LLM GPU host")
        return False, f"this machine lacks {' and '.join(missing)}"
    return True, "TensorRT-LLM and a GPU are present"
