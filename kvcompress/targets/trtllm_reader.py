"""A pure-PyTorch reader of a TensorRT-LLM Llama checkpoint: the CPU proof of the weight mapping.

It merges the rank shards back (any tp size) and runs the Llama forward from TensorRT-LLM's
names and layouts alone (fused q|k|v per rank, Qwen2's q/k/v biases, Qwen3's per-head q/k RMSNorm
before RoPE, GPT-NeoX RoPE, GQA, SiLU-gated MLP with fc = gate and gate = up, Mixtral's and Qwen2/3-MoE's experts with
fc = up | gate and top-k routing, renormalised or not as the config's moe.normalization_mode says, Qwen2-MoE's gated shared expert; FP8 weights
times their per-tensor or per-row scales), optionally with TensorRT-LLM's per-tensor KV quantization. Tests
compare its logits with the Hugging Face model's.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from kvcompress import reference as ref
from kvcompress.spec import ALGO_FORMAT
from kvcompress.targets.trtllm_ckpt import read_config


def merge_shards(ckpt: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, merged tensors in float32): q, k, v un-fused, kv-head duplicates dropped."""
    cfg = read_config(ckpt)
    ranks = [load_file(str(Path(ckpt) / f"rank{r}.safetensors")) for r in range(cfg["mapping"]["tp_size"])]
    merged = merge_rank_tensors(cfg, ranks)
    merged["lm_head.weight"] = merged["lm_head.weight"][: cfg["vocab_size"]]
    return cfg, merged


# an FP8 linear's (quant_algo FP8 / FP8_PER_CHANNEL_PER_TOKEN) and an NVFP4 one's (the fp8 block scales and the global scale)
SCALES = ("weights_scaling_factor", "activation_scaling_factor", "per_channel_scale", "weights_scaling_factor_2")


def dequantized(rank: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One rank's tensors with FP8 weights (float8 e4m3 values times their per-tensor weights_scaling_factor, or their
    per_channel_scale per output row) and NVFP4 weights (nvfp4_weights: codes, block and global scales) as float32 values, and the linears' scale tensors dropped. Activation scales are not
    applied: the re-measurement runs the validated arithmetic, float activations on these weights."""
    from kvcompress.models.fp8_weights import dequantize
    from kvcompress.models.nvfp4_weights import dequantize as dequantize_nvfp4

    out = {}
    for n, v in rank.items():
        if n.endswith(SCALES):
            continue
        m = n.removesuffix("weight")
        if n.endswith(".weight") and m + "weights_scaling_factor_2" in rank:  # NVFP4: e2m1 codes x block scale x global scale
            out[n] = dequantize_nvfp4(v, rank[m + "weights_scaling_factor"], rank[m + "weights_scaling_factor_2"])
            continue
        scale = next((rank[s] for s in (n.removesuffix("weight") + SCALES[0], n.removesuffix("weight") + SCALES[2]) if s in rank), None)
        out[n] = dequantize(v, scale, list(v.shape)) if n.endswith(".weight") and scale is not None else v
    return out


def merge_rank_tensors(cfg: dict, ranks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The same-named tensors of every rank merged back into one (float32; FP8 weights dequantized), q|k|v un-fused."""
    ranks = [dequantized(r) for r in ranks]
    tp = cfg["mapping"]["tp_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_size"]
    kv_per_rank = max(1, nkv // tp)
    merged: dict[str, torch.Tensor] = {}
    for name in ranks[0]:
        parts = [r[name].float() for r in ranks]
        if name.endswith("attention.qkv.weight") or name.endswith("attention.qkv.bias"):
            q = torch.cat([p[: nh // tp * hd] for p in parts])
            ks = [p[nh // tp * hd : nh // tp * hd + kv_per_rank * hd] for p in parts]
            vs = [p[nh // tp * hd + kv_per_rank * hd :] for p in parts]
            step = max(1, tp // nkv)  # duplicated kv heads: keep one copy per original head
            merged[name.replace("qkv", "q")] = q
            merged[name.replace("qkv", "k")] = torch.cat(ks[::step])
            merged[name.replace("qkv", "v")] = torch.cat(vs[::step])
        elif name.endswith("mlp.fc.weight") and parts[0].dim() == 3:  # experts [E, 2I/tp, H], rows up | gate per rank
            halves = [p.chunk(2, dim=1) for p in parts]
            merged[name] = torch.cat([torch.cat([h[0] for h in halves], 1), torch.cat([h[1] for h in halves], 1)], 1)
        elif name.endswith("mlp.shared_expert.fc.weight"):  # Qwen2-MoE's shared expert [2S/tp, H], rows up | gate per rank
            halves = [p.chunk(2, dim=0) for p in parts]
            merged[name] = torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
        elif name.endswith(("attention.dense.weight", "mlp.proj.weight", "mlp.shared_expert.proj.weight")):
            merged[name] = torch.cat(parts, dim=-1)  # experts: [E, H, I/tp]
        elif name.endswith(("mlp.fc.weight", "mlp.gate.weight")) or name == "lm_head.weight":
            merged[name] = torch.cat(parts, dim=0)
        else:
            merged[name] = parts[0]
    return merged


HF_NAMES = {"attention.q.weight": "self_attn.q_proj.weight", "attention.k.weight": "self_attn.k_proj.weight", "attention.v.weight": "self_attn.v_proj.weight",
            "attention.q.bias": "self_attn.q_proj.bias", "attention.k.bias": "self_attn.k_proj.bias", "attention.v.bias": "self_attn.v_proj.bias",
            "attention.dense.weight": "self_attn.o_proj.weight", "input_layernorm.weight": "input_layernorm.weight",
            "post_layernorm.weight": "post_attention_layernorm.weight", "mlp.fc.weight": "mlp.gate_proj.weight", "mlp.gate.weight": "mlp.up_proj.weight",
            "mlp.proj.weight": "mlp.down_proj.weight", "attention.q_layernorm.weight": "self_attn.q_norm.weight",
            "attention.k_layernorm.weight": "self_attn.k_norm.weight", "mlp.router.weight": "mlp.gate.weight",
            "mlp.shared_expert.proj.weight": "mlp.shared_expert.down_proj.weight", "mlp.shared_expert_gate.weight": "mlp.shared_expert_gate.weight"}
SHARED_FC = ("mlp.shared_expert.fc.weight", ("mlp.shared_expert.up_proj.weight", "mlp.shared_expert.gate_proj.weight"))  # rows up | gate
MOE_NAMES = {"mlp.fc.weight": "mlp.experts.gate_up_proj", "mlp.proj.weight": "mlp.experts.down_proj"}  # Mixtral's and Qwen3-MoE's experts (transformers 5)


class TrtllmAsHF:
    """A TensorRT-LLM checkpoint read back under Hugging Face names, one layer (or row block) at a
    time: what the layer-streamed executor needs to re-measure a checkpoint too large to merge.
    Names and splits are undone exactly as merge_shards does (fc = gate_proj, gate = up_proj)."""

    def __init__(self, ckpt: Path):
        from kvcompress.models.checkpoint import Checkpoint

        self.dir = Path(ckpt)
        self.cfg = read_config(ckpt)
        self.tp = self.cfg["mapping"]["tp_size"]
        self.ranks = [Checkpoint(self.dir, files=[self.dir / f"rank{r}.safetensors"]) for r in range(self.tp)]

    def __contains__(self, key: str) -> bool:
        return key in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight") or key.startswith("model.layers.")

    def shape(self, key: str) -> list[int]:
        assert key == "model.embed_tokens.weight"
        return self.ranks[0].shape("transformer.vocab_embedding.weight")

    def kv_scales(self) -> torch.Tensor:
        n = self.cfg["num_hidden_layers"]
        return torch.cat([self.ranks[0].read(f"transformer.layers.{i}.attention.kv_cache_scaling_factor").float() for i in range(n)])

    def layer_keys(self, i: int) -> list[str]:
        """The HF names of layer i's tensors in this checkpoint (biases included when written)."""
        t = f"transformer.layers.{i}."
        names = [n[len(t):].replace("qkv", q) for n in self.ranks[0].entries if n.startswith(t) and not n.endswith(("kv_cache_scaling_factor", *SCALES))
                 for q in (("q", "k", "v") if ".qkv." in n else ("qkv",))]
        return [f"model.layers.{i}.{h}" for n in names for h in (SHARED_FC[1] if n == SHARED_FC[0] else (self._hf_name(n),))]

    def _hf_name(self, name: str) -> str:
        return MOE_NAMES[name] if name in MOE_NAMES and (self.cfg.get("moe") or {}).get("num_experts", 0) > 1 else HF_NAMES[name]

    def load(self, keys: list[str], dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
        """`keys` under HF names; a fused name (Phi-3's qkv_proj, gate_up_proj) is joined from its Llama-named parts."""
        from kvcompress.models.fused import fuse

        out = {}
        if "model.norm.weight" in keys:
            out["model.norm.weight"] = self.ranks[0].read("transformer.ln_f.weight")
        layers = sorted({int(k.split(".")[2]) for k in keys if k.startswith("model.layers.")})
        for i in layers:
            t = f"transformer.layers.{i}."
            names = [n for n in self.ranks[0].entries if n.startswith(t) and not n.endswith("kv_cache_scaling_factor")]
            merged = merge_rank_tensors(self.cfg, [{n: r.read_stored(n) for n in names} for r in self.ranks])  # FP8: values and scales as stored
            if t + "mlp.router.weight" in merged:  # experts: fc rows up | gate -> transformers' gate_up_proj rows gate | up
                up, gate = merged[t + "mlp.fc.weight"].chunk(2, dim=1)
                merged[t + "mlp.fc.weight"] = torch.cat([gate, up], dim=1)
            if t + SHARED_FC[0] in merged:  # Qwen2-MoE's shared expert: up | gate rows -> transformers' up_proj, gate_proj
                out |= dict(zip((f"model.layers.{i}.{h}" for h in SHARED_FC[1]), merged.pop(t + SHARED_FC[0]).chunk(2, dim=0)))
            out |= {f"model.layers.{i}.{self._hf_name(n[len(t):])}": v for n, v in merged.items()}
        out = fuse(out, keys)
        missing = [k for k in keys if k not in out]
        if missing:
            raise KeyError(f"TensorRT-LLM checkpoint {self.dir}: no tensor for {missing[:3]}")
        return {k: out[k].to(device=device, dtype=dtype) for k in keys}

    def rows(self, key: str, lo: int, hi: int, dtype: torch.dtype, device) -> torch.Tensor:
        if key == "model.embed_tokens.weight":
            return self.ranks[0].rows("transformer.vocab_embedding.weight", lo, hi, dtype, device)
        per = self.ranks[0].shape("lm_head.weight")[0]  # rows per rank (padded)
        parts = []
        for r in range(lo // per, (hi - 1) // per + 1):
            a, b = max(lo, r * per) - r * per, min(hi, (r + 1) * per) - r * per
            parts.append(self.ranks[r].rows("lm_head.weight", a, b, dtype, device))
        return torch.cat(parts)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_inv_freq(D: int, base: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [D/2] of the checkpoint's RoPE, with its `rotary_scaling` applied:
    none, "linear" (all frequencies / factor), "llama3" (Llama-3.1's published rule: low
    frequencies / factor, high ones kept, a smooth ramp between) or "yarn" (TensorRT-LLM's rule, a ramp
    over the channel range beta_fast..beta_slow; cos and sin also scaled, rope_scale). Other types are refused."""
    inv = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    kind = (scaling or {}).get("type")
    if kind is None:
        return inv
    f = float(scaling["factor"])
    if kind == "linear":
        return inv / f
    if kind == "llama3":
        lo, hi, old = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"]), float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / f, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(mid, (1 - smooth) * scaled / f + smooth * scaled, scaled)
    if kind == "yarn":  # TensorRT-LLM's RopeEmbeddingUtils.create_sinusoidal_positions_yarn (transformers' default YaRN)
        orig = float(scaling.get("original_max_position_embeddings", 4096))
        fast, slow = float(scaling.get("beta_fast", 32.0)), float(scaling.get("beta_slow", 1.0))

        def corr(rot: float) -> float:  # the channel index at which a pair turns `rot` times over the original context
            return D * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = max(math.floor(corr(fast)), 0), min(math.ceil(corr(slow)), D - 1)
        ramp = ((torch.arange(D // 2, dtype=torch.float32) - lo) / ((hi - lo) or 0.001)).clamp(0, 1)
        return inv / f * ramp + inv * (1 - ramp)  # fast pairs keep their frequency, slow ones are interpolated
    raise ValueError(f"trtllm_reader: rotary_scaling type {kind!r} is not implemented (none, linear, llama3, yarn)")


def rope_scale(scaling: dict | None) -> float:
    """The factor on cos and sin of the checkpoint's RoPE: YaRN's attention scaling as TensorRT-LLM computes it,
    get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) with 0.1 * m * ln(factor) + 1 (1 if factor <= 1);
    1 for every other type."""
    if (scaling or {}).get("type") != "yarn":
        return 1.0
    f = float(scaling["factor"])

    def get(m: float) -> float:
        return 1.0 if f <= 1 else 0.1 * m * math.log(f) + 1.0

    return get(float(scaling.get("mscale", 1.0))) / get(float(scaling.get("mscale_all_dim", 0.0)))


def _rope(x: torch.Tensor, pos: torch.Tensor, base: float, scaling: dict | None = None) -> torch.Tensor:
    """GPT-NeoX rotary embedding: channel pairs (d, d + D/2). x: [B, H, T, D]."""
    D = x.shape[-1]
    inv = rope_inv_freq(D, base, scaling)
    ang = pos.float()[:, None] * inv[None, :]  # [T, D/2]
    m = rope_scale(scaling)
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1) * m, torch.cat([ang.sin(), ang.sin()], -1) * m
    rot = torch.cat([-x[..., D // 2 :], x[..., : D // 2]], -1)
    return x * cos + rot * sin


def _experts(h: torch.Tensor, router: torch.Tensor, fc: torch.Tensor, proj: torch.Tensor, moe: dict) -> torch.Tensor:
    """TensorRT-LLM's mixture-of-experts MLP (moe.normalization_mode 1, RENORMALIZE: the top_k softmax probabilities
    renormalised to sum to 1; 0: used as they are): fc [E, 2I, H] rows up | gate, swiglu, proj [E, H, I]."""
    if moe.get("normalization_mode", 1) not in (0, 1):
        raise ValueError(f"trtllm_reader: moe normalization_mode {moe['normalization_mode']} is not implemented (0, 1)")
    flat = h.reshape(-1, h.shape[-1])
    p = torch.softmax(F.linear(flat.float(), router.float()), dim=-1)
    top, idx = p.topk(int(moe["top_k"]), dim=-1)
    if moe.get("normalization_mode", 1) == 1:
        top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(flat)
    for e in idx.unique().tolist():
        rows, slot = (idx == e).nonzero(as_tuple=True)
        up, gate = fc[e].chunk(2, dim=0)
        y = F.linear(F.silu(F.linear(flat[rows], gate)) * F.linear(flat[rows], up), proj[e])
        out.index_add_(0, rows, y * top[rows, slot, None].to(y.dtype))
    return out.view_as(h)


@torch.no_grad()
def forward(ckpt, ids: torch.Tensor, simulate_kv_quant: bool = False) -> torch.Tensor:
    """Logits [B, T, V] of the checkpoint on ids [B, T] (float32 math on the checkpoint's values).

    ckpt: a checkpoint directory, or merge_shards(dir) already loaded. simulate_kv_quant: round K
    and V to fp16, then through the checkpoint's kv_cache_quant_algo with its per-layer
    kv_cache_scaling_factor, before attention (what TensorRT-LLM caches).
    """
    loaded = ckpt if isinstance(ckpt, tuple) else merge_shards(ckpt)
    return head(loaded, final_hidden(loaded, ids, simulate_kv_quant))


def head(loaded, normed: torch.Tensor) -> torch.Tensor:
    """lm_head of merge_shards(dir) on final-normed hidden states [..., hidden] -> logits [..., V]."""
    return F.linear(normed, loaded[1]["lm_head.weight"])


def final_hidden(ckpt, ids: torch.Tensor, simulate_kv_quant: bool = False) -> torch.Tensor:
    """The decoder's final-normed hidden states [B, T, hidden] of forward (its logits are head of them)."""
    cfg, w = ckpt if isinstance(ckpt, tuple) else merge_shards(ckpt)
    nh, nkv, hd, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_size"], cfg["norm_epsilon"]
    algo = (cfg.get("quantization") or {}).get("kv_cache_quant_algo")
    B, T = ids.shape
    pos = torch.arange(T)
    x = w["transformer.vocab_embedding.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        t = f"transformer.layers.{i}."
        h = _rms(x, w[t + "input_layernorm.weight"], eps)
        q = F.linear(h, w[t + "attention.q.weight"], w.get(t + "attention.q.bias")).view(B, T, nh, hd).transpose(1, 2)
        k = F.linear(h, w[t + "attention.k.weight"], w.get(t + "attention.k.bias")).view(B, T, nkv, hd).transpose(1, 2)
        v = F.linear(h, w[t + "attention.v.weight"], w.get(t + "attention.v.bias")).view(B, T, nkv, hd).transpose(1, 2)
        if t + "attention.k_layernorm.weight" in w:  # Qwen3: RMSNorm of each head's q and k before RoPE
            q, k = _rms(q, w[t + "attention.q_layernorm.weight"], eps), _rms(k, w[t + "attention.k_layernorm.weight"], eps)
        q, k = _rope(q, pos, cfg["rotary_base"], cfg.get("rotary_scaling")), _rope(k, pos, cfg["rotary_base"], cfg.get("rotary_scaling"))
        if simulate_kv_quant and algo:
            s = w[t + "attention.kv_cache_scaling_factor"].item()
            fmt = ALGO_FORMAT[algo]
            k, v = ref.native_fake_quant(ref.to_hp(k), s, fmt), ref.native_fake_quant(ref.to_hp(v), s, fmt)
        g = nh // nkv
        a = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True, scale=1 / math.sqrt(hd))
        x = x + F.linear(a.transpose(1, 2).reshape(B, T, nh * hd), w[t + "attention.dense.weight"])
        h = _rms(x, w[t + "post_layernorm.weight"], eps)
        if t + "mlp.router.weight" in w:
            x = x + _experts(h, w[t + "mlp.router.weight"], w[t + "mlp.fc.weight"], w[t + "mlp.proj.weight"], cfg["moe"])
            if t + SHARED_FC[0] in w:  # Qwen2-MoE (SharedMoE): the shared expert (swiglu: SiLU of the gate half times the up half) times sigmoid(gate)
                up, gate = w[t + SHARED_FC[0]].chunk(2, dim=0)
                shared = F.linear(F.silu(F.linear(h, gate)) * F.linear(h, up), w[t + "mlp.shared_expert.proj.weight"])
                x = x + torch.sigmoid(F.linear(h, w[t + "mlp.shared_expert_gate.weight"])) * shared
        else:
            x = x + F.linear(F.silu(F.linear(h, w[t + "mlp.fc.weight"])) * F.linear(h, w[t + "mlp.gate.weight"]), w[t + "mlp.proj.weight"])
    return _rms(x, w["transformer.ln_f.weight"], eps)
