"""The native tier's writers, driven together: one pass over the model, layer by layer, each layer read once (from the
loaded model or streamed from its checkpoint), folded with each validated native ScaleBook (guard, fold, range check) and
written to every rank file of every tensor-parallel size of trtllm_ckpt/ and to its hf_ckpt/ shard.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from tqdm.auto import tqdm

from kvcompress.errors import UserError
from kvcompress.fold import absorb_kv_scale, check_range, fold_layer, guard_layer
from kvcompress.models import int_weights
from kvcompress.models.base import DTYPES
from kvcompress.models.fused import unfuse
from kvcompress.models.quantized import quantization_config, weight_quantization
from kvcompress.models.streaming import HEAD_CHUNK_BYTES
from kvcompress.scalebook import ScaleBook
from kvcompress.spec import NATIVE_ALGO
from kvcompress.targets.checks import Checks
from kvcompress.targets.hf_ckpt import KV_SCALES_UNREAD, HFWriter
from kvcompress.targets.trtllm_ckpt import TrtllmWriter


class ModelTensors:
    """The model's Hugging Face-named tensors, one decoder layer (or one row block) at a time:
    views of the loaded model's state dict, or read from the checkpoint of a streamed model, in
    the model's dtype either way (so both give the same exported bytes). Layers come under Llama
    names (fused Phi-3 q/k/v and gate/up split, models.fused); `own_meta` has the model's own names."""

    def __init__(self, lm):
        self.lm = lm
        state = lm.model.state_dict()
        if lm.model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        self.own_meta = {k: torch.empty_like(v, device="meta") for k, v in state.items()}
        self.meta = unfuse(self.own_meta, lm.geometry)
        self.state = None if lm.streamer is not None else {k: v.detach() for k, v in state.items()}

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        keys = [k for k in self.own_meta if k.startswith(f"model.layers.{i}.")]
        if self.state is not None:
            return unfuse({k: self.state[k] for k in keys}, self.lm.geometry)
        return unfuse(self.lm.streamer.ckpt.load(keys, self.lm.dtype, "cpu"), self.lm.geometry)

    def row_blocks(self, key: str, rows: int):
        """(lo, tensor rows lo:lo+rows) over a global tensor (embedding, lm_head, final norm)."""
        n = self.meta[key].shape[0] if self.meta[key].dim() > 1 else 0
        if n == 0:
            yield 0, (self.state[key] if self.state is not None else self.lm.streamer.ckpt.load([key], self.lm.dtype, "cpu")[key])
            return
        for lo in range(0, n, rows):
            hi = min(n, lo + rows)
            yield lo, (self.state[key][lo:hi] if self.state is not None else self.lm.streamer.ckpt.rows(key, lo, hi, self.lm.dtype, "cpu"))


class FoldedLayers:
    """Fold one ScaleBook into each layer as it passes (guard, fold, range check), recording the
    guard's changes and any range problem for the manifest."""

    def __init__(self, book: ScaleBook, geom, dtype: torch.dtype, label: str, norm_offset: float = 0.0):
        self.book, self.geom, self.dtype, self.label, self.norm_offset = book, geom, dtype, label, norm_offset
        self.sigma = book.tensors["fold_k"].clone()
        self.guard = {"raised": 0, "layers": []}
        self.bad: list[str] = []
        self.weights: dict = {}  # the writer's word on how the weights were written (write_native_checkpoints)

    def __call__(self, layer: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
        self.sigma[i], n = guard_layer(layer, self.geom, i, self.book.tensors["fold_k"][i], self.dtype, norm_offset=self.norm_offset)
        if n:
            self.guard["raised"] += n
            self.guard["layers"].append(i)
        folded = {**layer, **fold_layer(layer, self.geom, i, self.sigma, self.book.tensors["fold_v"], self.book.tensors.get("fold_k_rot"), self.norm_offset)}
        self.bad += check_range(folded, self.dtype)
        if self.bad:
            raise UserError(f"export: folding {self.book.spec.name} puts weights outside {self.dtype}: {self.bad[0]}; nothing exported")
        return folded

    def record(self, checks: Checks) -> None:
        checks.add(f"{self.label}: folded q/k/v/o weights within {str(self.dtype).removeprefix('torch.')} range (no overflow, no rows flushed)", not self.bad,
                   {"factors_raised_by_guard": self.guard["raised"], "layers": self.guard["layers"], "problems": self.bad[:5]})


def write_native_checkpoints(lm, geom, trt_book: ScaleBook | None, hf_book: ScaleBook, ecfg, tp_dirs: list[Path], hf_dir: Path, progress: bool = True):
    """One pass over the model, layer by layer: each layer is read once, folded with each book and
    written to every rank file of every tp size and to its HF shard. Returns the two FoldedLayers
    (trt_book None, an HF_ONLY_ARCH model: the HF checkpoint alone, and None for the first)."""
    from kvcompress.stages.profile import key_norm_offset

    dtype = DTYPES[ecfg.dtype]
    src = ModelTensors(lm)
    offset = key_norm_offset(lm.model)
    keep = lm.streamer.ckpt if ecfg.fp8_weights == "keep" and lm.streamer is not None and (weight_quantization(lm.streamer.ckpt.dir) in ("fp8", "mxfp4", "nvfp4")
                                                                                           or lm.streamer.ckpt.packed or lm.streamer.ckpt.int8 or repackable(lm.streamer.ckpt)) else None
    unread = KV_SCALES_UNREAD.get(str((quantization_config(keep.dir) or {}).get("quant_method", "")).lower()) if keep is not None else None
    absorbed = bool(unread) and not (hf_book.fit_info.get("fold_keys_off") or hf_book.fit_info.get("fold_values_off"))
    if absorbed:  # the server reads no stored KV scale and quantizes at 1.0: the scale goes into the fold, the stored scales are 1.0
        sk, sv = absorb_kv_scale(hf_book.tensors["fold_k"], hf_book.tensors["fold_v"], hf_book.tensors["native_scale"])
        hf_book = dataclasses.replace(hf_book, tensors={**hf_book.tensors, "fold_k": sk, "fold_v": sv,
                                                        "native_scale": torch.ones_like(hf_book.tensors["native_scale"])})
    trt_fold = None if trt_book is None else FoldedLayers(trt_book, geom, dtype, "trtllm_ckpt", offset)
    hf_fold = FoldedLayers(hf_book, geom, dtype, "hf_ckpt", offset)
    trt_keep = keep if keep is not None and weight_quantization(keep.dir) in ("fp8", "nvfp4") else None
    trt = [] if trt_book is None else [TrtllmWriter(src.meta, geom, d, tp, ecfg.dtype, NATIVE_ALGO[trt_book.spec.format], trt_book.tensors["native_scale"],
                                                    lm.model.config, fp8_source=trt_keep) for tp, d in zip(ecfg.tp_sizes, tp_dirs)]
    hf = HFWriter(src.own_meta, lm.model.config, lm.tokenizer, hf_dir, hf_book.tensors["native_scale"], dtype, ecfg.shard_mb, model=lm.model,
                  fp8_source=keep)
    writers = [*trt, hf]
    try:
        rows = max(1, HEAD_CHUNK_BYTES // (geom.hidden_size * 4))
        for key in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            if key in src.meta:
                for lo, block in src.row_blocks(key, rows):
                    for w in trt:
                        w.write_rows(key, lo, block)
                    hf.write(key, block, row=lo)
        for i in tqdm(range(geom.n_layers), desc="export", unit="layer", disable=not progress):
            if keep is not None:  # the layer's stored tensors, read once for its folded state and for each writer's copies
                keep.remember(True)
            layer = src.layer(i)
            if trt:
                t = trt_fold(layer, i)
                for w in trt:
                    w.write_layer(t, i)
                del t
            hf.write_layer(hf_fold(layer, i), i)
        for w in writers:
            w.close()
    except BaseException:
        for w in writers:
            w.abort()
        raise
    finally:
        if keep is not None:
            keep.remember(False)
    hf_fold.weights = hf.weights_note()
    if absorbed:
        del hf_fold.weights["kv_scales_unread"]
        hf_fold.weights["kv_scale_absorbed"] = (f"{unread}: each layer's FP8 KV scale was folded into the attention weights (keys and values "
                                                "divided by it) and the stored k_scale / v_scale are 1.0, the scale such a server quantizes "
                                                "with, so --kv-cache-dtype fp8 caches what validate measured")
    if trt_fold is not None:
        trt_fold.weights = trt[0].weights_note()
    return trt_fold, hf_fold


def repackable(ckpt) -> bool:
    """A GPTQ / AWQ source hf_ckpt writes as compressed-tensors pack-quantized (int_weights.repack_obstacle says why not)."""
    return bool(ckpt.qweights) and int_weights.repack_obstacle(quantization_config(ckpt.dir)) is None
