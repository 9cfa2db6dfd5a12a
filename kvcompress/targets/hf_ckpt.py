"""The folded model as a Hugging Face checkpoint with FP8 KV-cache scales.

Format followed: NVIDIA ModelOpt's unified HF export as read in shared/notes/trtllm_export.md §4
(ModelOpt @a2fbac7b, `unified_export_hf.py` / `quant_utils.py`): per layer scalar
`model.layers.{i}.self_attn.k_proj.k_scale` and `...v_proj.v_scale` = amax / 448, plus
`hf_quant_config.json` {"quantization": {"kv_cache_quant_algo": "FP8", "quant_algo": null}} and a
matching `quantization_config` in config.json (quant_method "modelopt"). This is what the
TensorRT-LLM PyTorch backend (`trtllm-serve`) and vLLM read for an FP8 KV cache. Not verified
here: neither can be installed on this machine.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from kvcompress.artifacts import atomic_write_json, save_plain_safetensors

FP8_MAX = 448.0


def write_hf_checkpoint(model, tokenizer, out_dir: Path, kv_amax: torch.Tensor, dtype: torch.dtype = torch.float16) -> Path:
    """kv_amax: [L] amax of the folded K and V per layer (shared, as the per-tensor formats use)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for i, a in enumerate(kv_amax.tolist()):
        s = torch.tensor(a / FP8_MAX, dtype=torch.float32)
        state[f"model.layers.{i}.self_attn.k_proj.k_scale"] = s
        state[f"model.layers.{i}.self_attn.v_proj.v_scale"] = s.clone()
    save_plain_safetensors(out_dir / "model.safetensors", state)
    quant = {"quant_algo": None, "kv_cache_quant_algo": "FP8"}
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["quantization_config"] = {"quant_method": "modelopt", **quant}
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    atomic_write_json(out_dir / "config.json", cfg)
    atomic_write_json(out_dir / "hf_quant_config.json", {"producer": {"name": "kvcompress"}, "quantization": quant})
    if hasattr(tokenizer, "tok"):
        tokenizer.tok.save_pretrained(str(out_dir))
    return out_dir


def read_kv_scales(ckpt: Path) -> dict[str, float]:
    from safetensors import safe_open

    with safe_open(str(Path(ckpt) / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k).item() for k in f.keys() if k.endswith(("k_scale", "v_scale"))}


def read_config(ckpt: Path) -> dict:
    return json.loads((Path(ckpt) / "config.json").read_text())
