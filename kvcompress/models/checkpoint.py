"""A Hugging Face model directory's safetensors checkpoint, read a tensor (or a row range) at a time.

Which shard holds each tensor (the index, or every *.safetensors file), positioned reads of exactly a tensor's bytes into a
fresh tensor (no mapping of the shard, so resident memory holds only what was asked for), the names transformers' loader
converts stored tensors to, and the dequantization of weights stored quantized (FP8 with its scales, MXFP4 experts, integer
codes, NVFP4; models.quantized says which formats), so every reader sees the values the checkpoint defines. The layer
streamer (models.streaming), the export's writers and the re-measurement read checkpoints through it.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from kvcompress.errors import UserError
from kvcompress.models import int_weights, mxfp4_weights, nvfp4_weights
from kvcompress.models.fp8_weights import FLOAT8, dequantize, scale_name
from kvcompress.models.quantized import quantization_config, stated_bits, weight_block_size
from kvcompress.models.st_dtypes import ST_DTYPES



def read_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header {name: {dtype, shape, data_offsets}} and where its data starts."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


class Checkpoint:
    """Which safetensors file holds each tensor of a Hugging Face model directory, and a reader
    that reads exactly a tensor's bytes (or a row range of them) into a fresh tensor: positioned
    reads, no mapping of the shard, so resident memory holds only what was asked for."""

    def __init__(self, model_dir: str | Path, files: list[Path] | None = None, text_decoder: bool = False):
        """text_decoder: a multimodal checkpoint read as its text decoder (models.multimodal): tensors under the text
        model's names, the vision tower's left out."""
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if files is not None:
            files = [Path(f) for f in files]
        elif index.is_file():
            files = sorted({self.dir / f for f in json.loads(index.read_text())["weight_map"].values()})
        else:
            files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise UserError(f"model.path={str(self.dir)!r} has no *.safetensors files (streaming reads safetensors checkpoints)")
        self.entries: dict[str, tuple[Path, dict, int]] = {}
        for f in files:
            header, start = read_header(f)
            self.entries.update({k: (f, e, start) for k, e in header.items()})
        self.text_decoder = text_decoder
        if text_decoder:
            from kvcompress.models.multimodal import decoder_name

            self.entries = {n: e for k, e in self.entries.items() if (n := decoder_name(k)) is not None}
        self.converted: dict[str, tuple] = {}  # for_model: a module's tensor name -> (transformers' converter, [(pattern, stored name)])
        self._model = None
        self._memo: dict | None = None  # remember(): stored tensors kept for reuse
        self.block = weight_block_size(self.dir)  # FP8 weights (models.quantized): config.json's block size, if it states one
        # MXFP4 weights (GPT-OSS's experts): the weight's name -> its stored (blocks, scales), read dequantized (mxfp4_weights)
        self.mxfp4 = {k.removesuffix("_blocks"): pair for k in self.entries if k.endswith("_blocks")
                      and (pair := mxfp4_weights.blocks_name(self.entries, k.removesuffix("_blocks")))}
        # pack-quantized integer weights (compressed-tensors): the weight's name -> its stored parts, read dequantized (int_weights)
        self.packed = int_weights.packed_names(self.entries)
        # GPTQ / AWQ: the weight's name -> its stored qweight, qzeros, scales (g_idx), read dequantized in their layout
        self.int_layout = int_weights.layout(quantization_config(self.dir)) if any(k.endswith(".qweight") for k in self.entries) else None
        self.qweights = int_weights.qweight_names(self.entries) if self.int_layout in ("gptq", "gptq_v2", "awq") else {}
        self.bits = stated_bits(self.dir) if self.packed or self.qweights else None
        # compressed-tensors' int-quantized int8 weights (W8A8): the weight's name (its int8 codes) -> its scale (zero points)
        self.int8 = int_weights.int8_names(self.entries) if int_weights.layout(quantization_config(self.dir)) == "pack-quantized" else {}
        # NVFP4 weights (ModelOpt's, compressed-tensors'): the weight's name -> its stored codes and scales, read dequantized
        self.nvfp4 = nvfp4_weights.packed_names(self.entries)
        self._packed_shapes: dict[str, list[int]] = {}

    def for_model(self, model) -> "Checkpoint":
        """Read tensors under `model`'s own parameter names where transformers converts the stored ones on loading
        (its weight-conversion mapping for the model: Mixtral's and Qwen-MoE's per-expert w1/w3/w2 stored, one fused
        gate_up_proj and down_proj per layer in the modules; renamed prefixes). transformers' own rules and operations
        are applied to just the tensors asked for, so a layer is still read alone. A model without conversions (Llama,
        Qwen2/3, Phi-3) reads its stored names unchanged."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        if not renamings and not converters:
            return self
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        meta = model.state_dict()
        groups: dict[str, list] = {}
        # experts in index order, as transformers stacks them; integer weights under the names they dequantize to (read())
        for stored in sorted({*self.entries, *self.packed, *self.qweights, *self.nvfp4}, key=dot_natural_key):
            if stored in meta:
                continue
            name, pattern = rename_source_key(stored, renamings, converters, model.base_model_prefix, meta)
            if name != stored and name in meta:
                groups.setdefault(name, []).append((pattern, stored))
        self.converted = {name: (by_pattern.get(srcs[0][0]), srcs) for name, srcs in groups.items()}
        self._model = model
        return self

    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in {e[0] for e in self.entries.values()})

    def __contains__(self, key: str) -> bool:
        return key in self.entries or key in self.converted or key in self.mxfp4 or key in self.packed or key in self.qweights or key in self.nvfp4

    def shape(self, key: str) -> list[int]:
        if key in self.mxfp4 and key not in self.entries:
            return mxfp4_weights.shape(list(self.entries[self.mxfp4[key][0]][1]["shape"]))
        if key in self.packed and key not in self.entries:
            if key not in self._packed_shapes:  # weight_shape's values: two integers read from the file
                parts = self.packed[key]
                if parts["weight_shape"] is None or parts["weight_scale"] is None:
                    raise UserError(f"checkpoint {str(self.dir)!r}: {parts['weight_packed']!r} has no weight_shape or weight_scale beside it")
                self._packed_shapes[key] = [int(x) for x in self.read_stored(parts["weight_shape"]).tolist()]
            return list(self._packed_shapes[key])
        if key in self.nvfp4:
            return nvfp4_weights.shape(list(self.entries[self.nvfp4[key]["codes"]][1]["shape"]))
        if key in self.qweights and key not in self.entries:  # [out, in]: the scales' columns; GPTQ's packed rows or AWQ's rows
            parts = self.qweights[key]
            qw, sc = (list(self.entries[parts[p]][1]["shape"]) for p in ("qweight", "scales"))
            return [sc[1], qw[0] if self.int_layout == "awq" else qw[0] * 32 // self.bits]
        return list(self.entries[key][1]["shape"])

    def stored_dtype(self, key: str) -> torch.dtype:
        if key not in self.entries:
            raise UserError(f"checkpoint {str(self.dir)!r} lacks tensor {key!r}, which the model needs")
        return ST_DTYPES[self.entries[key][1]["dtype"]]

    def read(self, key: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        """Tensor `key` (or its rows lo:hi): as stored, exactly its bytes read; a float8 weight dequantized with its stored
        scale into float32 (models.quantized), or refused in one line when it has none; an MXFP4 weight (stored as
        `<key>_blocks` and `<key>_scales`; rows: experts) dequantized into float32."""
        if key in self.mxfp4 and key not in self.entries:
            b, s = self.mxfp4[key]
            try:
                return mxfp4_weights.dequantize(self.read_stored(b, lo, hi), self.read_stored(s, lo, hi))
            except ValueError as e:
                raise UserError(f"checkpoint {str(self.dir)!r}, tensor {key!r}: {e}") from None
        if key in self.packed and key not in self.entries:
            parts, shape = self.packed[key], self.shape(key)
            opt = {p: self.read_stored(parts[p]) if parts[p] else None for p in ("weight_zero_point", "weight_g_idx")}
            try:
                return int_weights.dequantize(self.read_stored(parts["weight_packed"], lo, hi), self.read_stored(parts["weight_scale"]), shape,
                                              opt["weight_zero_point"], opt["weight_g_idx"], self.bits, lo, hi)
            except ValueError as e:
                raise UserError(f"checkpoint {str(self.dir)!r}, tensor {key!r}: {e}") from None
        if key in self.qweights and key not in self.entries:
            try:
                w = int_weights.dequantize_layer(self.int_layout, self.qweights[key], self.read_stored, self.bits)
            except ValueError as e:
                raise UserError(f"checkpoint {str(self.dir)!r}, tensor {key!r}: {e}") from None
            return w if lo is None else w[lo:hi]
        if key in self.int8:
            try:
                return int_weights.read_int8(self.int8[key], key, self.shape(key), self.read_stored, lo, hi)
            except ValueError as e:
                raise UserError(f"checkpoint {str(self.dir)!r}, tensor {key!r}: {e}") from None
        if key in self.nvfp4:
            try:
                return nvfp4_weights.read(self.nvfp4[key], self.read_stored, lo, hi)
            except ValueError as e:
                raise UserError(f"checkpoint {str(self.dir)!r}, tensor {key!r}: {e}") from None
        t = self.read_stored(key, lo, hi)
        if t.dtype in FLOAT8:
            sk = scale_name(self.entries, key)
            if sk is None:
                raise UserError(f"checkpoint {str(self.dir)!r}: tensor {key!r} is {t.dtype} without a {key}_scale_inv or {key}_scale "
                                "beside it; kvcompress cannot tell its values")
            try:
                return dequantize(t, self.read_stored(sk), self.shape(key), lo or 0, self.block)
            except ValueError as e:
                raise UserError(f"checkpoint {str(self.dir)!r}, tensor {key!r}: {e}") from None
        return t

    def remember(self, on: bool) -> None:
        """From now on (on) keep every tensor read_stored reads until the next remember() call, which forgets them: the export
        reads a layer's FP8 weights for the folded state, then copies them as stored into each checkpoint, from one disk read."""
        self._memo = {} if on else None

    def read_stored(self, key: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        """Tensor `key` (or its rows lo:hi) as stored: exactly its bytes, nothing else read."""
        if key not in self.entries:
            raise UserError(f"checkpoint {str(self.dir)!r} lacks tensor {key!r}, which the model needs")
        if self._memo is None:
            return self._read_stored(key, lo, hi)
        rows = list(self.entries[key][1]["shape"])[:1]
        span = None if lo is None or (lo == 0 and [hi] == rows) else (lo, hi)
        if (key, span) not in self._memo:
            self._memo[key, span] = self._read_stored(key, *(span or (None, None)))
        return self._memo[key, span]

    def _read_stored(self, key: str, lo: int | None, hi: int | None) -> torch.Tensor:
        f, e, start = self.entries[key]
        dtype, shape = ST_DTYPES[e["dtype"]], list(e["shape"])
        b0, b1 = e["data_offsets"]
        if lo is not None:
            row = (b1 - b0) // max(shape[0], 1)
            b0, b1, shape = b0 + lo * row, b0 + hi * row, [hi - lo, *shape[1:]]
        buf = torch.empty(b1 - b0, dtype=torch.uint8)
        with open(f, "rb", buffering=0) as fh:
            fh.seek(start + b0)
            view, got = memoryview(buf.numpy()), 0
            while got < len(view):
                n = fh.readinto(view[got:])
                if not n:
                    raise UserError(f"checkpoint file {str(f)!r} is truncated (tensor {key!r})")
                got += n
        return buf.view(dtype).reshape(shape)

    def load(self, keys: list[str], dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
        """The named tensors (a converted name: built from its stored tensors, see for_model), cast to dtype and placed on device."""
        return {k: (self._convert(k) if k in self.converted else self.read(k)).to(device=device, dtype=dtype) for k in keys}

    def _convert(self, key: str) -> torch.Tensor:
        import copy

        converter, sources = self.converted[key]
        if converter is None:  # renamed only
            return self.read(sources[0][1])
        c = copy.deepcopy(converter)  # one converter instance per tensor, as transformers' loader does
        for pattern, stored in sources:
            c.add_tensor(key, stored, pattern, lambda s=stored: self.read(s))
        return c.convert(key, model=self._model, config=self._model.config)[key]

    def rows(self, key: str, lo: int, hi: int, dtype: torch.dtype, device) -> torch.Tensor:
        """Rows lo:hi of a tensor, reading only those bytes."""
        return self.read(key, lo, hi).to(device=device, dtype=dtype)
