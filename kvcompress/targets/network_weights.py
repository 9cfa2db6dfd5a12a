"""The custom-tier network's weights: an HF directory's text-decoder tensors as the fp16 arrays the network takes.

Weights stored quantized are dequantized with the readers copied beside this file in the bundle (fp8_weights, nvfp4_weights,
int_weights: targets.bundle.WEIGHT_READERS), a multimodal checkpoint is read as its text decoder, Phi-3's fused projections
are split, experts stacked, and the values' Hadamard rotation folded into W_v / W_o. Part of the network's code
(trtllm_network.py): copied into the plugin bundle with it and run on the GPU host by build_engine.py; imports only numpy at
module level (torch and safetensors inside the functions that need them).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np


class WeightsMismatch(ValueError):
    """The HF directory given to the network does not fit it (or its network.json): build_engine.py reports it in one line."""


def layer_variant(spec: dict, i: int) -> dict:
    """The variant layer i runs: the bundle's one variant, or the layer's own (per-layer formats)."""
    return spec["layers"][i] if spec.get("layers") else spec["variant"]


FP8_METADATA = ("_scale_inv", "_scale")  # an FP8 checkpoint's scale tensors: read to dequantize the weights, not constants of the network


def safetensors_header(path: Path) -> dict:
    """A .safetensors file's JSON header (each tensor's dtype, shape and offsets), without reading a tensor."""
    with open(path, "rb") as f:
        return json.loads(f.read(int.from_bytes(f.read(8), "little")))


def weight_reader(name: str):
    """kvcompress.models.<name> (a weight format's reader: fp8_weights, int_weights, nvfp4_weights), or in the bundle the
    <name>.py copied beside this file (targets.bundle.WEIGHT_READERS)."""
    import importlib

    try:
        return importlib.import_module(f"kvcompress.models.{name}")
    except ImportError:
        return importlib.import_module(name)


def _quantization_config(hf_dir: Path) -> dict:
    """config.json's quantization_config of an HF directory ({} without one)."""
    cfg = Path(hf_dir) / "config.json"
    return (json.loads(cfg.read_text()).get("quantization_config") or {}) if cfg.is_file() else {}


def dense_shapes(shapes: dict, hf_dir: Path) -> dict:
    """Tensor shapes with each pack-quantized weight (`<m>.weight_packed` int32 [out, words] and its parts) as the weight
    `<m>.weight` [out, in] the loader makes of it (in = words * 32 / bits, the config's code width), its parts left out."""
    iw = weight_reader("int_weights")
    packed = [k for k in shapes if k.endswith(".weight_packed")]
    qweights = [k for k in shapes if k.endswith(".qweight")]
    if not packed and not qweights:
        return shapes
    q = _quantization_config(hf_dir)
    b = iw.config_bits(q) or 4
    if qweights:  # GPTQ [in * b / 32, out], AWQ [in, out / 8] -> [out, in] (out: the scales' columns)
        awq = iw.layout(q) == "awq"
        drop = {k.removesuffix("qweight") + p for k in qweights for p in iw.GPTQ_PARTS}
        return {k: s for k, s in shapes.items() if k not in drop} | {
            k.removesuffix("qweight") + "weight": [shapes[k.removesuffix("qweight") + "scales"][1], shapes[k][0] if awq else shapes[k][0] * 32 // b]
            for k in qweights}
    out = {k: s for k, s in shapes.items() if not iw.is_part(k)}
    return out | {k.removesuffix("_packed"): [shapes[k][0], shapes[k][1] * 32 // b] for k in packed}


# A multimodal checkpoint's text decoder (Mistral3ForConditionalGeneration, Gemma3ForConditionalGeneration) under the text
# model's names, stored -> text model. Defined here because this file runs alone on the GPU host; kvcompress.models.multimodal
# reads the same mapping from here.
TEXT_DECODER_KEYS = ((r"^model\.language_model\.", "model."), (r"^language_model\.model\.", "model."),
                     (r"^language_model\.lm_head\.", "lm_head."), (r"^lm_head\.", "lm_head."))


def text_decoder_name(stored: str) -> str | None:
    """The text model's name of a stored tensor, or None for a tensor outside the text decoder (vision tower, projector)."""
    for pattern, repl in TEXT_DECODER_KEYS:
        if re.match(pattern, stored):
            return re.sub(pattern, repl, stored, count=1)
    return None


def text_decoder_tensors(raw: dict) -> dict:
    """`raw` itself for a text model's checkpoint; for a multimodal one, its text decoder's tensors under the text model's
    names (text_decoder_name), the vision tower's and projector's left out."""
    if "model.embed_tokens.weight" in raw:
        return raw
    return {n: v for k, v in raw.items() if (n := text_decoder_name(k)) is not None} or raw


def dequantize_fp8(raw: dict, hf_dir: Path) -> dict:
    """An FP8-weight checkpoint's float8 tensors as float32 values w * scale (their `_scale_inv` / `_scale` tensors dropped;
    fp8_weights.py, copied beside this file in the bundle; block size from config.json's quantization_config)."""
    import torch

    if not any(t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for t in raw.values()):
        return raw
    fp8 = weight_reader("fp8_weights")
    FLOAT8, dequantize, scale_name = fp8.FLOAT8, fp8.dequantize, fp8.scale_name
    cfg = Path(hf_dir) / "config.json"
    block = (json.loads(cfg.read_text()).get("quantization_config") or {}).get("weight_block_size") if cfg.is_file() else None
    out = {}
    for k, t in raw.items():
        if t.dtype in FLOAT8:
            sk = scale_name(raw, k)
            if sk is None:
                raise WeightsMismatch(f"{hf_dir}: {k} is {t.dtype} without a {k}_scale_inv or {k}_scale beside it")
            out[k] = dequantize(t, raw[sk], list(t.shape), 0, block)
        elif not (k.endswith(("_scale_inv", "_scale")) and k.rsplit("_scale", 1)[0] in raw and raw[k.rsplit("_scale", 1)[0]].dtype in FLOAT8):
            out[k] = t
    return out


def dequantize_nvfp4(raw: dict, hf_dir: Path) -> dict:
    """An NVFP4 checkpoint's weights (Model Optimizer's or compressed-tensors' layout) as float32 values (nvfp4_weights.py,
    copied beside this file in the bundle), their codes' other names, scales and input scales dropped; any other checkpoint
    as it is. Before dequantize_fp8: the block scales are float8 tensors that are not weights."""
    nv = weight_reader("nvfp4_weights")
    layers = nv.packed_names(raw)
    if not layers:
        return raw
    drop = {p for parts in layers.values() for p in nv.stored(parts)}
    out = {k: t for k, t in raw.items() if k not in drop}
    for name, parts in layers.items():
        try:
            out[name] = nv.read(parts, lambda k, lo=None, hi=None: raw[k])
        except ValueError as e:
            raise WeightsMismatch(f"{hf_dir}: {name}: {e}") from None
    return out


def dequantize_packed(raw: dict, hf_dir: Path) -> dict:
    """An integer checkpoint's weights (compressed-tensors pack-quantized and int-quantized int8, GPTQ, AWQ GEMM) as their values, `<m>.weight` =
    (q - z) * s in float32 (int_weights.py, copied beside this file in the bundle), their packed parts dropped; any
    other checkpoint as it is."""
    int_weights = weight_reader("int_weights")
    packed = int_weights.packed_names(raw)
    q = _quantization_config(hf_dir)
    fmt, bits = int_weights.layout(q), int_weights.config_bits(q)
    if fmt in ("gptq", "gptq_v2", "awq"):  # GPTQ's and AWQ's qweight / qzeros / scales (g_idx)
        layers = int_weights.qweight_names(raw)
        out = {k: t for k, t in raw.items() if not (int_weights.is_qweight_part(k) and k.rsplit(".", 1)[0] + ".weight" in layers)}
        for name, parts in layers.items():
            try:
                if bits is None:
                    raise ValueError(f"its quantization_config ({fmt}) states no bits")
                out[name] = int_weights.dequantize_layer(fmt, parts, raw.__getitem__, bits)
            except ValueError as e:
                raise WeightsMismatch(f"{hf_dir}: {e}") from None
        return out
    int8 = int_weights.int8_names(raw) if fmt == "pack-quantized" else {}
    if int8:  # int8 codes under the weight's own name beside their scale (zero points, g_idx)
        try:
            raw = {k: t for k, t in raw.items() if k not in {p for parts in int8.values() for p in parts.values()}} | {
                name: int_weights.read_int8(parts, name, list(raw[name].shape), lambda k, lo=None, hi=None: raw[k]) for name, parts in int8.items()}
        except ValueError as e:
            raise WeightsMismatch(f"{hf_dir}: {e}") from None
    if not packed:
        return raw
    out = {k: t for k, t in raw.items() if not int_weights.is_part(k)}
    for name, parts in packed.items():
        if parts["weight_scale"] is None or parts["weight_shape"] is None:
            raise WeightsMismatch(f"{hf_dir}: {parts['weight_packed']} has no weight_scale or weight_shape beside it")
        opt = {p: raw[parts[p]] if parts[p] else None for p in ("weight_zero_point", "weight_g_idx")}
        out[name] = int_weights.dequantize(raw[parts["weight_packed"]], raw[parts["weight_scale"]], raw[parts["weight_shape"]].tolist(),
                                           opt["weight_zero_point"], opt["weight_g_idx"], bits)
    return out


def load_hf_weights(hf_dir: Path, spec: dict, params: dict | None = None) -> dict[str, np.ndarray]:
    """The Llama-layer weights of an HF directory (*.safetensors; Llama, Mistral, Qwen2 with its q/k/v biases, Qwen3 with its
    per-head q/k norms, Phi-3/Phi-4 with fused q/k/v and gate/up, split here) as fp16
    numpy arrays under short names; with network.json's value_rotation, the plugin_params' v_rotation folded into
    W_v and W_o."""
    import torch  # bf16 checkpoints: numpy cannot read them
    from safetensors.torch import load_file

    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {hf_dir}")
    raw = {}
    for f in files:
        raw.update(load_file(str(f)))
    raw = text_decoder_tensors(dequantize_packed(dequantize_fp8(dequantize_nvfp4(raw, hf_dir), hf_dir), hf_dir))
    a = spec["arch"]
    p = "model."
    for name in [n for n in raw if n.endswith(("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"))]:  # Phi-3/Phi-4: fused rows q|k|v, gate|up
        w = raw.pop(name)
        if "qkv_proj" in name:
            nq, nkv = a["n_heads"] * a["head_dim"], a["n_kv_heads"] * a["head_dim"]
            parts = dict(zip(("q_proj", "k_proj", "v_proj"), torch.split(w, [nq, nkv, nkv])))
        else:
            parts = dict(zip(("gate_proj", "up_proj"), torch.chunk(w, 2)))
        raw |= {name.replace(name.split(".")[-2], k): t for k, t in parts.items()}
    if p + "embed_tokens.weight" not in raw:
        raise WeightsMismatch(f"{hf_dir}: not a Llama checkpoint (no model.embed_tokens.weight)")

    def get(name):
        return raw[name].to(dtype=torch.float16).numpy()

    moe = a.get("moe")

    w = {"embed": get(p + "embed_tokens.weight"), "norm": get(p + "norm.weight")[None]}
    w["lm_head"] = get("lm_head.weight") if "lm_head.weight" in raw else w["embed"]
    for i in range(a["n_layers"]):
        t = f"{p}layers.{i}."
        w |= {f"{i}.ln1": get(t + "input_layernorm.weight")[None], f"{i}.ln2": get(t + "post_attention_layernorm.weight")[None],
              f"{i}.wq": get(t + "self_attn.q_proj.weight"), f"{i}.wk": get(t + "self_attn.k_proj.weight"),
              f"{i}.wv": get(t + "self_attn.v_proj.weight"), f"{i}.wo": get(t + "self_attn.o_proj.weight")}
        experts = _expert_weights(raw, t, moe["num_experts"]) if moe else None
        has_moe = f"{t}block_sparse_moe.gate.weight" in raw or f"{t}mlp.gate.weight" in raw  # a router (a dense MLP's is gate_proj)
        if has_moe != bool(moe):
            raise WeightsMismatch(f"{hf_dir}: network.json {'has' if moe else 'has no'} mixture-of-experts block but layer {i} "
                                  f"{'has' if has_moe else 'has no'} expert tensors (Mixtral's block_sparse_moe, Qwen-MoE's mlp.gate and mlp.experts)")
        if moe and experts is None:
            raise WeightsMismatch(f"{hf_dir}: layer {i} lacks the gate, up or down weights of some of its {moe['num_experts']} experts (network.json moe)")
        if moe:
            w |= {f"{i}.{n}": a for n, a in experts.items()}
            if bool(moe.get("shared_expert")) != (f"{t}mlp.shared_expert_gate.weight" in raw):
                raise WeightsMismatch(f"{hf_dir}: network.json {'has' if moe.get('shared_expert') else 'has no'} shared expert but layer {i} "
                                      f"{'has no' if moe.get('shared_expert') else 'has a'} mlp.shared_expert_gate (Qwen2-MoE's)")
            if moe.get("shared_expert"):  # Qwen2-MoE: the shared expert's gate, up, down and its sigmoid gate's [1, hidden] row
                s = f"{t}mlp.shared_expert."
                missing = [n for n in ("gate_proj", "up_proj", "down_proj") if f"{s}{n}.weight" not in raw]
                if missing:
                    raise WeightsMismatch(f"{hf_dir}: network.json has a shared expert but layer {i} lacks its {', '.join(missing)} weights")
                w |= {f"{i}.sg": get(s + "gate_proj.weight"), f"{i}.su": get(s + "up_proj.weight"), f"{i}.sd": get(s + "down_proj.weight"),
                      f"{i}.sgate": get(f"{t}mlp.shared_expert_gate.weight")}
        else:
            w |= {f"{i}.wg": get(t + "mlp.gate_proj.weight"), f"{i}.wu": get(t + "mlp.up_proj.weight"), f"{i}.wd": get(t + "mlp.down_proj.weight")}
        if f"{t}self_attn.o_proj.bias" in raw:
            raise WeightsMismatch(f"{hf_dir}: an output-projection bias is not in this network (Llama, Mistral, Qwen2, Qwen3)")
        for n in "qkv":  # Qwen2's q/k/v biases (folded with the weights)
            if f"{t}self_attn.{n}_proj.bias" in raw:
                w[f"{i}.b{n}"] = get(f"{t}self_attn.{n}_proj.bias")[None]
        if f"{t}self_attn.k_norm.weight" in raw:  # Qwen3's per-head q/k norms (the key fold lives in their weights)
            qn, kn = get(f"{t}self_attn.q_norm.weight"), get(f"{t}self_attn.k_norm.weight")
            if qn.size != a["head_dim"] or kn.size != a["head_dim"]:
                raise WeightsMismatch(f"{hf_dir}: q/k norm weights of {qn.size}/{kn.size} values; this network takes one [head_dim] weight for every head (Qwen3)")
            w[f"{i}.qn"], w[f"{i}.kn"] = qn, kn
        if spec.get("value_rotation", "none") != "none" and layer_variant(spec, i)["value_bits"] != 16:  # fp16 layers store values as they are
            if params is None or "v_rotation" not in params:
                raise WeightsMismatch(f"network.json says value_rotation={spec['value_rotation']} but plugin_params has no v_rotation")
            _fold_value_rotation(w, raw, t, i, a, params["v_rotation"])
    return w


def _expert_weights(raw: dict, t: str, E: int) -> dict[str, np.ndarray] | None:
    """Layer t's router (float32 [E, hidden]) and its experts' gate, up, down ([E, out, in] fp16) from the checkpoint as
    stored: Mixtral's block_sparse_moe.gate and experts.{e}.w1 (gate), w3 (up), w2 (down); Qwen-MoE's mlp.gate and
    mlp.experts.{e}.gate_proj, up_proj, down_proj; or transformers' fused mlp.experts.gate_up_proj (rows gate | up per
    expert) and down_proj. None when the layer has not all of one of these."""
    import torch

    layouts = ((f"{t}block_sparse_moe.", "gate.weight", ("w1", "w3", "w2")), (f"{t}mlp.", "gate.weight", ("gate_proj", "up_proj", "down_proj")))
    for base, router, names in layouts:
        keys = [[f"{base}experts.{e}.{n}.weight" for e in range(E)] for n in names]
        if base + router in raw and all(k in raw for ks in keys for k in ks):
            g, u, d = (np.stack([raw[k].to(torch.float16).numpy() for k in ks]) for ks in keys)
            return {"wr": raw[base + router].float().numpy(), "wg": g, "wu": u, "wd": d}
    fused = (f"{t}mlp.experts.gate_up_proj", f"{t}mlp.experts.down_proj", f"{t}mlp.gate.weight")
    if all(k in raw for k in fused) and raw[fused[0]].shape[0] == E:
        g, u = (x.to(torch.float16).numpy() for x in raw[fused[0]].chunk(2, dim=1))
        return {"wr": raw[fused[2]].float().numpy(), "wg": g, "wu": u, "wd": raw[fused[1]].to(torch.float16).numpy()}
    return None


def _fold_value_rotation(w: dict, raw: dict, t: str, i: int, a: dict, R: np.ndarray) -> None:
    """The values' rotation folded into the weights (kv.value.rotate beside static keys; R = plugin_params
    v_rotation [D, D], orthogonal, v -> v @ R): each kv head's v = x W_v^T becomes v R (W_v_h' = R^T W_v_h, its
    bias b_h R), and each query head's columns of W_o become W_o_h R, so o = (attn R) (W_o R)^T = attn W_o^T:
    the same output, the cache holding the rotated values. float32 from the checkpoint's weights, fp16 once."""
    D, HKV = a["head_dim"], a["n_kv_heads"]
    R = np.asarray(R, np.float32)
    f32 = lambda name: raw[name].float().numpy()  # noqa: E731  (bf16 checkpoints: through torch)
    wv = f32(f"{t}self_attn.v_proj.weight").reshape(HKV, D, -1)  # [HKV, D, hidden]
    w[f"{i}.wv"] = np.einsum("dc,hdk->hck", R, wv).reshape(HKV * D, -1).astype(np.float16)
    if f"{t}self_attn.v_proj.bias" in raw:
        w[f"{i}.bv"] = (f32(f"{t}self_attn.v_proj.bias").reshape(HKV, D) @ R).reshape(1, -1).astype(np.float16)
    wo = f32(f"{t}self_attn.o_proj.weight")  # [hidden, H*D]
    w[f"{i}.wo"] = (wo.reshape(wo.shape[0], -1, D) @ R).reshape(wo.shape).astype(np.float16)
