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
* a source whose weights are FP8 (models.quantized; export.fp8_weights=keep, the default) keeps them: every float8
  weight the fold leaves alone is copied as stored, its bytes and its scale tensors (`weight_scale_inv`, `weight_scale`,
  `input_scale`) unchanged, so the export is about the source's size, not twice it; the attention projections the fold
  changes (q/k/v/o_proj; q/k stay where a key norm takes the key factors) are written folded in `export.dtype` and
  added to the format's list of unconverted modules; the quantization config keeps the source's format
  (fp8_weight_configs). export.fp8_weights=dequantize writes every weight in `export.dtype`.
Not verified here: loading by vLLM or trtllm-serve (neither installs on this machine).
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import torch

from kvcompress.artifacts import atomic_write_json
from kvcompress.errors import UserError
from kvcompress.models import int_weights, nvfp4_weights
from kvcompress.models.fp8_weights import FLOAT8, dequantize, scale_name
from kvcompress.models.fused import fuse

FP8_MAX = 448.0
PRODUCER = {"name": "kvcompress", "modelopt_format": "0.47 unified HF export"}


def quant_config() -> dict:
    return {"producer": PRODUCER, "quantization": {"quant_algo": None, "kv_cache_quant_algo": "FP8"}}


def config_quantization(hf_quant: dict) -> dict:
    """ModelOpt 0.47's convert_hf_quant_config_format for an FP8 KV cache, with weights unquantized or FP8 (quant_algo FP8:
    one scale per tensor) outside `exclude_modules` (checked against ModelOpt's converter by a test)."""
    q = hf_quant["quantization"]
    fp8 = {"dynamic": False, "num_bits": 8, "type": "float"}
    out = {"ignore": list(q.get("exclude_modules") or []), "kv_cache_scheme": dict(fp8), "producer": hf_quant["producer"], "quant_method": "modelopt"}
    if q.get("quant_algo") == "FP8":
        out |= {"quant_algo": "FP8", "config_groups": {"group_0": {"input_activations": dict(fp8), "weights": dict(fp8), "targets": ["Linear"]}}}
    if q.get("quant_algo") in ("NVFP4", "W4A16_NVFP4"):  # NVFP4 weights (and, for NVFP4, activations) in blocks of group_size
        fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": q.get("group_size", 16)}
        group = {"input_activations": dict(fp4)} if q["quant_algo"] == "NVFP4" else {}
        out |= {"quant_algo": q["quant_algo"], "config_groups": {"group_0": group | {"weights": dict(fp4), "targets": ["Linear"]}}}
    return out


# The list of modules a weight format leaves unquantized, by quant_method (transformers, vLLM and TensorRT-LLM read these):
# fp8 / fbgemm_fp8 `modules_to_not_convert` (vLLM also `ignored_layers`), compressed-tensors `ignore`.
UNCONVERTED = ("modules_to_not_convert", "ignored_layers", "ignore")
DEFAULT_UNCONVERTED = {"fp8": "modules_to_not_convert", "fbgemm_fp8": "modules_to_not_convert", "mxfp4": "modules_to_not_convert",
                       "compressed-tensors": "ignore"}
# compressed-tensors' static FP8 KV cache (one scale per layer for K and one for V: k_scale / v_scale), as llm-compressor writes it
CT_KV_FP8 = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


# fbgemm_fp8 (per-row weight scales, activations quantized per token at run time) as compressed-tensors describes the same
# tensors (weight + weight_scale [rows, 1]): vLLM's fbgemm_fp8 config gives attention no KV-cache method, so it would not
# read the stored k_scale / v_scale (FP8 KV at scale 1.0, not what validate measured); its compressed-tensors config does.
CT_FROM_FBGEMM = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                  "config_groups": {"group_0": {"targets": ["Linear"],
                                                "weights": {"type": "float", "num_bits": 8, "strategy": "channel", "dynamic": False, "symmetric": True},
                                                "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True,
                                                                      "symmetric": True}}}}
# the quantization methods whose configs give vLLM's attention no KV-cache method (read in its source): stored k/v scales unread
KV_SCALES_UNREAD = {"mxfp4": "vLLM's mxfp4 config quantizes no attention layer, so it reads no k_scale / v_scale"}


def fp8_weight_configs(src_qcfg: dict, src_hf_quant: dict | None, unquantized: list[str]) -> tuple[dict, dict | None]:
    """(config.json's quantization_config, hf_quant_config.json or None) of a folded checkpoint that keeps an FP8 source's
    weights except the `unquantized` modules (written in export.dtype): the source's own format with those modules added
    to its list of unconverted modules, and the FP8 KV cache declared where the format has a field for it (ModelOpt:
    kv_cache_quant_algo; compressed-tensors: kv_cache_scheme). fbgemm_fp8 is written as compressed-tensors (CT_FROM_FBGEMM);
    fp8 / mxfp4 (GPT-OSS) have no such field: the server is told by --kv-cache-dtype fp8."""
    method = str(src_qcfg.get("quant_method", "")).lower()
    if method == "fbgemm_fp8":  # its servers skip a module whose name contains an entry; compressed-tensors matches names or "re:" patterns
        have = [m for k in UNCONVERTED for m in (src_qcfg.get(k) or [])]
        below = [f"re:^(.*\\.)?{re.escape(m)}\\..*$" for m in have if isinstance(m, str) and not m.startswith("re:")]  # modules under the entry
        ignore = list(dict.fromkeys(have + below + list(unquantized)))
        return copy.deepcopy(CT_FROM_FBGEMM) | {"ignore": ignore, "kv_cache_scheme": dict(CT_KV_FP8)}, None
    if method == "modelopt":
        q = (src_hf_quant or {}).get("quantization") or {}
        excl = list(q.get("exclude_modules") or src_qcfg.get("exclude_modules") or src_qcfg.get("ignore") or [])
        algo = str(q.get("quant_algo") or src_qcfg.get("quant_algo") or "FP8").upper()  # FP8, or NVFP4 with its block size
        hq = {"producer": PRODUCER, "quantization": {"quant_algo": algo, **({"group_size": int(q.get("group_size") or src_qcfg.get("group_size") or 16)}
                                                                           if "NVFP4" in algo else {}),
                                                     "kv_cache_quant_algo": "FP8", "exclude_modules": excl + [m for m in unquantized if m not in excl]}}
        return config_quantization(hq), hq
    if method not in DEFAULT_UNCONVERTED:
        raise ValueError(f"no FP8-weight export for quant_method={method!r}")
    cfg = copy.deepcopy(src_qcfg)
    for key in [k for k in UNCONVERTED if cfg.get(k)] or [DEFAULT_UNCONVERTED[method]]:
        have = list(cfg.get(key) or [])
        cfg[key] = have + [m for m in unquantized if m not in have]
    if method == "compressed-tensors":
        cfg["kv_cache_scheme"] = dict(CT_KV_FP8)
    return cfg, None


def _text_decoder_lists(q: dict) -> dict:
    """A multimodal source's quantization config with each module list (unconverted modules, exclude_modules) given also
    under the text model's names (`language_model.model.layers.3.mlp.down_proj` -> `model.layers.3.mlp.down_proj`), the
    names the text-only export writes; patterns and the vision tower's names are kept as they are (harmless)."""
    from kvcompress.models.multimodal import decoder_name

    out = dict(q)
    for key in (*UNCONVERTED, "exclude_modules"):
        if isinstance(q.get(key), list):
            mapped = [n.removesuffix(".") for e in q[key] if isinstance(e, str) and (n := decoder_name(e + ".")) is not None]
            out[key] = list(q[key]) + [m for m in mapped if m not in q[key]]
    return out


# the weights fold_layer rewrites (Llama names; Phi-3's fused qkv_proj holds q/k/v); q/k_proj stay where a key norm takes the factors
FOLDED = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")


def folded_by_export(key: str, names) -> bool:
    """Whether the export's fold may change weight `key` (a stored name), given the layer's tensor `names`."""
    parts = key.split(".")
    if len(parts) < 6 or parts[:2] != ["model", "layers"] or parts[3] != "self_attn" or parts[-1] != "weight" or parts[-2] not in FOLDED:
        return False
    key_norm = ".".join(parts[:4]) + ".k_norm.weight" in names
    return not (key_norm and parts[-2] in ("q_proj", "k_proj"))


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


def check_stored_fp8(src, key: str, raw: torch.Tensor, value: torch.Tensor, row: int, target: str) -> None:
    """Raise unless the source's stored float8 rows `raw` (from row `row` of weight `key`) with its stored scale define exactly
    `value`, what the validated model computed with: a kept FP8 weight is copied only if nothing changed it."""
    sk = scale_name(src.entries, key)
    if not torch.equal(dequantize(raw, src.read_stored(sk), src.shape(key), row, src.block).to(value.dtype), value):
        raise RuntimeError(f"{target}: the FP8 weight {key!r} was changed before writing; its stored bytes no longer define it")


class HFWriter:
    """Writes the sharded checkpoint tensor by tensor (kvcompress.targets.st_writer): shards are
    planned from the model's meta tensors (sorted names, at most `shard_mb` each, as before); layers
    arrive one at a time, the embedding and lm_head in row blocks. `model`: tensors are written under the
    names a checkpoint of that model stores (transformers' revert_weight_conversion, as save_pretrained does:
    Mixtral's fused experts back to block_sparse_moe.experts.{e}.w1/w2/w3), which vLLM and TensorRT-LLM read."""

    def __init__(self, meta_state: dict, hf_config, tokenizer, out_dir: Path, kv_scale: torch.Tensor, dtype: torch.dtype, shard_mb: float,
                 model=None, fp8_source=None):
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
        # fp8_source (the source's models.checkpoint.Checkpoint): its float8 weights the fold leaves alone are copied as stored
        self.src, self.kept, self.kept_mx, self.kept_int, self.unquantized = fp8_source, {}, {}, {}, set()
        self.repacked: dict[str, dict[str, str]] = {}  # a GPTQ / AWQ weight -> its pack-quantized tensors' names (int_weights.repack)
        self.kept_nv: dict[str, list[str]] = {}  # an NVFP4 weight kept as stored -> its stored codes and scales (nvfp4_weights.stored)
        if fp8_source is not None:
            self._plan_fp8(plan)
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

    def _plan_fp8(self, plan: dict) -> None:
        """Plan the source's float8 weights: kept as stored with their scale tensors (self.kept: weight -> its other
        tensors), or, where the fold changes them, written in export.dtype (self.unquantized: their modules)."""
        src = self.src
        nv_parts = {p for parts in src.nvfp4.values() for p in nvfp4_weights.stored(parts)}  # NVFP4's float8 block scales are not FP8 weights
        fp8 = [k for k in src.entries if src.stored_dtype(k) in FLOAT8 and k not in nv_parts]
        missing = [k for k in fp8 if k not in plan]
        if missing:
            raise UserError(f"export: the source's FP8 weight {missing[0]!r} has no tensor of that name in the checkpoint kvcompress writes, so it "
                            "cannot be copied as stored; allowed for this model: export.fp8_weights=dequantize")
        others: dict[str, list[str]] = {}
        fbgemm = self.src_method() == "fbgemm_fp8"  # written as compressed-tensors (fp8_weight_configs): weight_scale only
        for k in src.entries:
            module, _, leaf = k.rpartition(".")
            if leaf not in ("weight", "bias") and k not in plan and (leaf == "weight_scale" or not fbgemm):
                others.setdefault(module, []).append(k)
        from kvcompress.models.quantized import quantization_config

        sym = int_weights.repack_symmetric(quantization_config(src.dir) or {}) if src.qweights else False
        # integer weights (compressed-tensors' pack-quantized as stored, GPTQ / AWQ written pack-quantized: the same codes) and
        # NVFP4 weights (codes and scales as stored); or, where the export folds them, written in export.dtype and listed unquantized
        for k, parts in [*src.packed.items(), *src.qweights.items(), *src.nvfp4.items(), *src.int8.items()]:
            kind = "NVFP4" if k in src.nvfp4 else "integer"
            if k not in plan:
                raise UserError(f"export: the source's {kind} weight {k!r} has no tensor of that name in the checkpoint kvcompress writes, so it "
                                "cannot be written quantized; allowed for this model: export.fp8_weights=dequantize")
            if folded_by_export(k, plan):
                self.unquantized.add(k.rpartition(".")[0])
                continue
            del plan[k]
            if k in src.nvfp4:
                self.kept_nv[k] = nvfp4_weights.stored(parts)
                plan |= {t: (src.stored_dtype(t), tuple(src.entries[t][1]["shape"])) for t in self.kept_nv[k]}
            elif k in src.packed or k in src.int8:  # compressed-tensors' packed parts, or int8 codes under the weight's name and their scale
                self.kept_int[k] = ([k] if k in src.int8 else []) + [n for n in parts.values() if n is not None]
                plan |= {t: (src.stored_dtype(t), tuple(src.shape(t))) for t in self.kept_int[k]}
            else:
                m = k.removesuffix("weight")
                (out_f, in_f), groups = src.shape(k), src.shape(parts["scales"])[0]
                shapes = int_weights.repacked_shapes(out_f, in_f, groups, src.bits, sym, src.stored_dtype(parts["scales"]))
                self.repacked[k] = {part: m + part for part in shapes}
                plan |= {m + part: v for part, v in shapes.items()}
        self.repack_symmetric = sym
        for k, stored in src.mxfp4.items():  # GPT-OSS's MXFP4 experts (the fold never changes them): blocks and scales as stored
            if k not in plan:
                raise UserError(f"export: the source's MXFP4 weight {k!r} has no tensor of that name in the checkpoint kvcompress writes, so it "
                                "cannot be copied as stored; allowed for this model: export.fp8_weights=dequantize")
            del plan[k]
            self.kept_mx[k] = stored
            for t in stored:
                plan[t] = (src.stored_dtype(t), tuple(src.shape(t)))
        for k in fp8:
            module = k.rpartition(".")[0]
            if folded_by_export(k, plan):
                self.unquantized.add(module)
                continue
            if scale_name(src.entries, k) is None:
                raise UserError(f"export: the source's FP8 weight {k!r} has no {k}_scale_inv or {k}_scale beside it")
            self.kept[k] = sorted(others.get(module, []))
            for t in (k, *self.kept[k]):
                plan[t] = (src.stored_dtype(t), tuple(src.shape(t)))

    def _write_kept(self, key: str, value: torch.Tensor, row: int) -> None:
        """A kept FP8 weight (rows row.. of it): its stored bytes, after checking that they define exactly `value` (what the
        validated model computed with); its scale tensors with the first rows."""
        src = self.src
        n = value.shape[0] if value.dim() else 1
        raw = src.read_stored(key, row, row + n) if value.dim() > 1 else src.read_stored(key)
        check_stored_fp8(src, key, raw, value, row, "hf_ckpt")
        self._w(key).write(key, raw, row=row)
        if row == 0:
            for t in self.kept[key]:
                self._w(t).write(t, src.read_stored(t))

    def weights_note(self) -> dict:
        """The manifest's word on how the weights were written."""
        if self.src is None:
            return {"weights": str(self.dtype).removeprefix("torch."), "fp8_weights_kept": False}
        dt = str(self.dtype).removeprefix("torch.")
        listed = f"; {len(self.unquantized)} of them were FP8 and are listed as unquantized modules" if self.unquantized else ""
        n_int = len(self.kept_int) + len(self.repacked)
        kinds = " and ".join(k for k, n in (("FP8", len(self.kept)), ("MXFP4", len(self.kept_mx)), ("NVFP4", len(self.kept_nv)), ("integer", n_int)) if n) or "quantized"
        method = self.src_method()
        how = ("quantization_config rewritten from 'fbgemm_fp8' as 'compressed-tensors' (the same tensors), whose KV-cache scheme "
               "servers read" if method == "fbgemm_fp8" else
               f"quantization_config rewritten from {method!r} as 'compressed-tensors' pack-quantized (the same codes, zero points and scales), "
               "whose KV-cache scheme servers read" if self.repacked else f"quantization_config quant_method {method!r}")
        listed = listed.replace("were FP8", "were quantized")
        counts = ", ".join(f"{n} {kind}" for kind, n in (("FP8", len(self.kept)), ("MXFP4", len(self.kept_mx)), ("NVFP4", len(self.kept_nv)),
                                                          ("integer (compressed-tensors, as stored)", len(self.kept_int)),
                                                          (f"integer ({method} repacked as pack-quantized)", len(self.repacked))) if n)
        out = {"fp8_weights_kept": True, "kept_formats": kinds, "weights": f"the source's quantized weights kept as stored ({counts or 'no'} weights with their "
                                                                        f"scales, {how}); the attention projections the fold changes in {dt}{listed}",
               "bytes": self.total}
        if method in KV_SCALES_UNREAD:
            out["kv_scales_unread"] = (f"{KV_SCALES_UNREAD[method]}: served with --kv-cache-dtype fp8 it would run FP8 KV at scale 1.0, which validate "
                                       "did not measure; serve this checkpoint with its KV cache unquantized (--kv-cache-dtype auto) or check it first "
                                       "(check_hf_ckpt.py)")
        return out

    def _plain_linears(self) -> list[str]:
        """The Linear modules written unquantized (lm_head, the attention projections the fold changes, any the source left
        unquantized): compressed-tensors' `ignore` when its config targets every Linear."""
        plain = set(self.unquantized) | ({"lm_head"} if "lm_head.weight" not in self.repacked else set())  # GPTQModel can quantize the head
        if self.model is not None:
            plain |= {n for n, mod in self.model.named_modules() if isinstance(mod, torch.nn.Linear) and f"{n}.weight" in self.where}
        return sorted(plain)

    def src_method(self) -> str:
        from kvcompress.models.quantized import quantization_config

        return str((quantization_config(self.src.dir) or {}).get("quant_method", ""))

    def _stored(self, state: dict) -> dict:
        if self.model is None:
            return state
        from transformers.core_model_loading import revert_weight_conversion

        return revert_weight_conversion(self.model, state)

    def _w(self, key: str):
        return self.writers[self.where[key][1]]

    def write(self, key: str, t: torch.Tensor, row: int = 0) -> None:
        if key in self.kept_mx:  # an MXFP4 weight: its stored blocks and scales, if they define exactly what the validated model used
            from kvcompress.models.mxfp4_weights import dequantize as dequantize_mxfp4

            raw = [self.src.read_stored(n) for n in self.kept_mx[key]]
            if row != 0 or not torch.equal(dequantize_mxfp4(*raw).to(t.dtype), t.detach()):
                raise RuntimeError(f"hf_ckpt: the MXFP4 weight {key!r} was changed before writing; its stored bytes no longer define it")
            for n, r in zip(self.kept_mx[key], raw):
                self._w(n).write(n, r)
            return
        if key in self.repacked:  # a GPTQ / AWQ weight: its codes, zero points and scales as pack-quantized tensors, if they define exactly it
            try:
                parts = int_weights.repack(self.src.int_layout, self.src.qweights[key], self.src.read_stored, self.src.bits, self.repack_symmetric)
            except ValueError as e:
                raise UserError(f"export: {e}: not writable as compressed-tensors pack-quantized; allowed for this model: "
                                "export.fp8_weights=dequantize") from None
            w = int_weights.dequantize(parts["weight_packed"], parts["weight_scale"], parts["weight_shape"], parts.get("weight_zero_point"))
            if row != 0 or not torch.equal(w.to(t.dtype), t.detach()):
                raise RuntimeError(f"hf_ckpt: the integer weight {key!r} was changed before writing; its repacked codes no longer define it")
            for part, n in self.repacked[key].items():
                self._w(n).write(n, parts[part])
            return
        if key in self.kept_nv:  # an NVFP4 weight: its stored codes and scales, if they define exactly what the validated model used
            if row != 0 or not torch.equal(self.src.read(key).to(t.dtype), t.detach()):  # the reader's dequantization of those bytes
                raise RuntimeError(f"hf_ckpt: the NVFP4 weight {key!r} was changed before writing; its stored codes no longer define it")
            for n in self.kept_nv[key]:
                self._w(n).write(n, self.src.read_stored(n))
            return
        if key in self.kept_int:  # a pack-quantized weight: its stored parts, if they define exactly what the validated model used
            if row != 0 or not torch.equal(self.src.read(key).to(t.dtype), t.detach()):  # the reader's dequantization of those parts
                raise RuntimeError(f"hf_ckpt: the integer weight {key!r} was changed before writing; its stored codes no longer define it")
            for n in self.kept_int[key]:
                self._w(n).write(n, self.src.read_stored(n))
            return
        if key not in self.where:  # lm_head of a tied model
            return
        if key in self.kept:
            self._write_kept(key, t.detach(), row)
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
        cfg = hf_config_dict(self.hf_config, self.dtype)
        if not cfg.get("architectures") and self.model is not None:  # a model built from a GGUF or in code: servers pick the class by this
            cfg["architectures"] = [type(self.model).__name__]
        if self.src is None:
            hq = quant_config()
            cfg["quantization_config"] = config_quantization(hq)
        else:
            from kvcompress.models.quantized import quantization_config

            hqp = self.src.dir / "hf_quant_config.json"
            src_q, src_hq = quantization_config(self.src.dir), json.loads(hqp.read_text()) if hqp.is_file() else None
            if self.src.text_decoder:  # a multimodal source written as its text decoder: its module lists under the text model's names
                src_q, src_hq = _text_decoder_lists(src_q), src_hq and {**src_hq, "quantization": _text_decoder_lists(src_hq.get("quantization") or {})}
            if int_weights.layout(src_q) in ("gptq", "gptq_v2", "awq"):  # written pack-quantized: compressed-tensors' config, every other Linear ignored
                cfg["quantization_config"], hq = int_weights.pack_quantized_config(src_q, self._plain_linears()) | {"kv_cache_scheme": dict(CT_KV_FP8)}, None
            else:
                cfg["quantization_config"], hq = fp8_weight_configs(src_q, src_hq, sorted(self.unquantized))
        atomic_write_json(self.dir / "config.json", cfg)
        if hq is not None:
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
