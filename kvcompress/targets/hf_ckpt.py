"""The folded model as a Hugging Face checkpoint with FP8 KV-cache scales (ModelOpt's unified format).

What is written, and where each part comes from:
* weights in `export.dtype`, sharded (`model-0000i-of-0000n.safetensors`, at most `export.shard_mb`
  per shard) with `model.safetensors.index.json`, as transformers' save_pretrained lays them out;
* per layer scalars `model.layers.{i}.self_attn.k_proj.k_scale` and `...v_proj.v_scale` =
  amax / 448 (the dequant scale of an FP8 e4m3 KV cache), the names and meaning ModelOpt's
  unified HF export uses (`modelopt/torch/export/quant_utils.py`, 0.47);
* `hf_quant_config.json`: {"producer", "quantization": {"quant_algo": null, "kv_cache_quant_algo":
  "FP8"}}, exactly ModelOpt's `get_quant_config` shape for a KV-only model, and in config.json the
  `quantization_config` that ModelOpt's own `convert_hf_quant_config_format` derives from it (for
  KV-only it has no `quant_algo` key, a `kv_cache_scheme`, `quant_method: modelopt`); a test runs
  ModelOpt's converter on our hf_quant_config.json and compares;
* config.json readable by transformers 4.57 (TensorRT-LLM 1.2's pin: `rope_theta`, `rope_scaling`,
  `torch_dtype`) and 5.x (`rope_parameters`); one dtype value.
Not verified here: loading by vLLM or trtllm-serve (neither installs on this machine).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from kvcompress.artifacts import atomic_write_json
from kvcompress.models.fused import fuse

FP8_MAX = 448.0
PRODUCER = {"name": "kvcompress", "modelopt_format": "0.47 unified HF export"}


def quant_config() -> dict:
    return {"producer": PRODUCER, "quantization": {"quant_algo": None, "kv_cache_quant_algo": "FP8"}}


def config_quantization(hf_quant: dict) -> dict:
    """ModelOpt 0.47's convert_hf_quant_config_format for a KV-only FP8 config (checked by a test)."""
    return {"ignore": [], "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
            "producer": hf_quant["producer"], "quant_method": "modelopt"}


def hf_config_dict(hf_config, dtype: torch.dtype) -> dict:
    """config.json for transformers 4.57 and 5.x: both RoPE spellings (per layer type, Gemma 3: rope_parameters for 5.x, and
    rope_theta / rope_local_base_freq / rope_scaling of the global layers for 4.57), one dtype value."""
    cfg = hf_config.to_dict()
    cfg.pop("quantization_config", None)
    rope = dict(cfg.get("rope_parameters") or {})
    per_type = isinstance(rope.get("full_attention"), dict)  # per layer type (Gemma 3): 4.57 reads the global RoPE and the local base apart
    params = rope["full_attention"] if per_type else rope
    cfg["rope_theta"] = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if per_type and "rope_theta" in (rope.get("sliding_attention") or {}):
        cfg["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    kind = params.get("rope_type", "default")
    cfg["rope_scaling"] = None if kind == "default" else {"rope_type": kind, **{k: v for k, v in params.items() if k not in ("rope_theta", "rope_type")}}
    cfg.pop("dtype", None)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")  # 4.57 reads torch_dtype; 5.x maps it to dtype
    return cfg


class HFWriter:
    """Writes the sharded checkpoint tensor by tensor (kvcompress.targets.st_writer): shards are
    planned from the model's meta tensors (sorted names, at most `shard_mb` each, as before); layers
    arrive one at a time, the embedding and lm_head in row blocks. `model`: tensors are written under the
    names a checkpoint of that model stores (transformers' revert_weight_conversion, as save_pretrained does:
    Mixtral's fused experts back to block_sparse_moe.experts.{e}.w1/w2/w3), which vLLM and TensorRT-LLM read."""

    def __init__(self, meta_state: dict, hf_config, tokenizer, out_dir: Path, kv_scale: torch.Tensor, dtype: torch.dtype, shard_mb: float,
                 model=None):
        from kvcompress.targets.st_writer import SafetensorsWriter, nbytes

        self.dir, self.hf_config, self.tokenizer, self.dtype, self.kv_scale = Path(out_dir), hf_config, tokenizer, dtype, kv_scale
        self.model = model
        meta_state = self._stored(meta_state)
        plan = {k: ((dtype if v.is_floating_point() else v.dtype), tuple(v.shape)) for k, v in meta_state.items()}
        if hf_config.tie_word_embeddings:
            plan.pop("lm_head.weight", None)
        for i in range(len(kv_scale)):
            plan[f"model.layers.{i}.self_attn.k_proj.k_scale"] = (torch.float32, ())
            plan[f"model.layers.{i}.self_attn.v_proj.v_scale"] = (torch.float32, ())
        shards, cur, size = [], {}, 0
        for k in sorted(plan):
            nb = nbytes(*plan[k])
            if cur and size + nb > shard_mb * 1e6:
                shards.append(cur)
                cur, size = {}, 0
            cur[k] = plan[k]
            size += nb
        shards.append(cur)
        self.total = sum(nbytes(*v) for v in plan.values())
        self.where, self.writers = {}, []
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            self.writers.append(SafetensorsWriter(self.dir / name, shard, {"format": "pt"}))
            self.where |= dict.fromkeys(shard, (name, len(self.writers) - 1))
        for i, s in enumerate(kv_scale.tolist()):
            for k in (f"model.layers.{i}.self_attn.k_proj.k_scale", f"model.layers.{i}.self_attn.v_proj.v_scale"):
                self._w(k).write(k, torch.tensor(s, dtype=torch.float32))

    def _stored(self, state: dict) -> dict:
        if self.model is None:
            return state
        from transformers.core_model_loading import revert_weight_conversion

        return revert_weight_conversion(self.model, state)

    def _w(self, key: str):
        return self.writers[self.where[key][1]]

    def write(self, key: str, t: torch.Tensor, row: int = 0) -> None:
        if key not in self.where:  # lm_head of a tied model
            return
        self._w(key).write(key, t.detach().to(self.dtype) if t.is_floating_point() else t, row=row)

    def write_layer(self, state: dict[str, torch.Tensor], i: int) -> None:
        """Layer i's tensors under Llama names; fused again where the model's own names fuse them (Phi-3)."""
        p = f"model.layers.{i}."
        for k, v in self._stored(fuse(state, [n for n in self.where if n.startswith(p)])).items():
            if k.startswith(p):
                self.write(k, v)

    def close(self) -> Path:
        for w in self.writers:
            w.close()
        weight_map = {k: name for k, (name, _) in self.where.items()}
        atomic_write_json(self.dir / "model.safetensors.index.json", {"metadata": {"total_size": self.total}, "weight_map": weight_map})
        hq = quant_config()
        cfg = hf_config_dict(self.hf_config, self.dtype)
        if not cfg.get("architectures") and self.model is not None:  # a model built from a GGUF or in code: servers pick the class by this
            cfg["architectures"] = [type(self.model).__name__]
        cfg["quantization_config"] = config_quantization(hq)
        atomic_write_json(self.dir / "config.json", cfg)
        atomic_write_json(self.dir / "hf_quant_config.json", hq)
        if hasattr(self.tokenizer, "tok"):
            self.tokenizer.tok.save_pretrained(str(self.dir))
        return self.dir

    def abort(self) -> None:
        for w in self.writers:
            w.abort()


def write_hf_checkpoint(state: dict, hf_config, tokenizer, out_dir: Path, kv_scale: torch.Tensor, dtype: torch.dtype, shard_mb: float) -> Path:
    """state: the folded HF state dict; kv_scale: [L] FP8 dequant scale (amax/448) shared by K and V (one call, whole model)."""
    w = HFWriter({k: torch.empty_like(v, device="meta") for k, v in state.items()}, hf_config, tokenizer, out_dir, kv_scale, dtype, shard_mb)
    try:
        for k, v in state.items():
            w.write(k, v)
        return w.close()
    except BaseException:
        w.abort()
        raise


def read_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """All tensors of a sharded checkpoint (via its index)."""
    from safetensors.torch import load_file

    index = json.loads((Path(ckpt) / "model.safetensors.index.json").read_text())
    out = {}
    for f in sorted(set(index["weight_map"].values())):
        out |= load_file(str(Path(ckpt) / f))
    return out


def read_config(ckpt: Path) -> dict:
    return json.loads((Path(ckpt) / "config.json").read_text())
