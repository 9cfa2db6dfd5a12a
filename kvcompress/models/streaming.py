"""Layer-streamed execution: a model whose weights stay on disk until a layer is needed.

The model is built from its config with empty (meta) parameters: transformers' own decoder
layers, rotary embedding, mask construction and attention interface, no forked modeling code.
`LayerStreamer.run` pushes every batch of every *pass* (a stream of hidden states with its own
forward keywords and attention implementation, e.g. the fp16 baseline and each compressed
format) through decoder layer 0, frees it, loads layer 1, and so on. Each layer's tensors are
read from the checkpoint's safetensors shards (memory-mapped, only that layer's keys), cast to
the compute dtype and put on the compute device. Embeddings are gathered and `lm_head` applied in
vocabulary chunks, never more than about one layer's bytes at a time.

How the layers are called is taken from the model itself: its forward runs up to the first
decoder layer (a forward pre-hook captures the layer's arguments: attention mask, position
embeddings, cache, evaluation context) and stops; every later layer is called with the same
arguments, exactly as the model's own loop does.
"""
from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from kvcompress.errors import UserError

HEAD_CHUNK_BYTES = 256 << 20  # embedding / lm_head chunk size (in the compute dtype)


class Checkpoint:
    """Which safetensors file holds each tensor of a Hugging Face model directory."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            self.where = {k: self.dir / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise UserError(f"model.path={str(self.dir)!r} has no *.safetensors files (streaming reads safetensors checkpoints)")
            self.where = {}
            for f in files:
                with safe_open(str(f), "pt") as h:
                    self.where.update({k: f for k in h.keys()})

    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in set(self.where.values()))

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def load(self, keys: list[str], dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
        """The named tensors, cast and placed; each shard is opened (mapped) only while read."""
        missing = [k for k in keys if k not in self.where]
        if missing:
            raise UserError(f"checkpoint {str(self.dir)!r} lacks tensors the model needs: {missing[:3]}{' ...' if len(missing) > 3 else ''}")
        out = {}
        by_file: dict[Path, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.where[k], []).append(k)
        for f, ks in by_file.items():
            with safe_open(str(f), "pt") as h:
                for k in ks:
                    out[k] = h.get_tensor(k).to(device=device, dtype=dtype)
        return out

    def rows(self, key: str, lo: int, hi: int, dtype: torch.dtype, device) -> torch.Tensor:
        """Rows lo:hi of a 2-D tensor, reading only those bytes."""
        with safe_open(str(self.where[key]), "pt") as h:
            return h.get_slice(key)[lo:hi].to(device=device, dtype=dtype)

    def shape(self, key: str) -> list[int]:
        with safe_open(str(self.where[key]), "pt") as h:
            return list(h.get_slice(key).get_shape())


@dataclass
class Pass:
    """One stream of hidden states through the layers.

    kwargs(i): the forward keywords of batch i (e.g. a cache, an evaluation context);
    context(): entered around every call of the model's code for this pass (attention implementation).
    """

    kwargs: Callable[[int], dict] = lambda i: {}
    context: Callable[[], ContextManager] = nullcontext
    hidden: list = field(default_factory=list)
    layer_kwargs: list = field(default_factory=list)


class _Caught(Exception):
    def __init__(self, args, kwargs):
        self.args_, self.kwargs_ = args, kwargs


class LayerStreamer:
    """Runs a causal LM layer by layer from its checkpoint directory (see the module doc)."""

    def __init__(self, model, checkpoint: Checkpoint, dtype: torch.dtype, device: str | torch.device):
        self.model, self.ckpt, self.dtype, self.device = model, checkpoint, dtype, torch.device(device)
        base = getattr(model, "model", None)
        self.layers = getattr(base, "layers", None)
        if self.layers is None or not hasattr(model, "lm_head"):
            raise UserError(f"streaming supports decoder-only models with model.layers and lm_head; {type(model).__name__} has not")
        self.embed_key = "model.embed_tokens.weight"
        self.head_key = "lm_head.weight" if "lm_head.weight" in checkpoint else self.embed_key  # tied embeddings
        if self.embed_key not in checkpoint:
            raise UserError(f"checkpoint {str(checkpoint.dir)!r} has no {self.embed_key}")
        self.vocab, self.hidden_size = checkpoint.shape(self.embed_key)
        esize = torch.empty(0, dtype=dtype).element_size()
        self.layer_bytes = max(sum(p.numel() for p in self.layers[0].parameters()) * esize, 1)
        self.chunk_rows = max(1, min(self.vocab, max(HEAD_CHUNK_BYTES, self.layer_bytes) // (self.hidden_size * esize)))
        self._head_cache: dict[int, torch.Tensor] = {}

    # --- weights -----------------------------------------------------------------------------
    def _materialize(self, module: torch.nn.Module, prefix: str) -> None:
        names = [n for n, _ in module.named_parameters()]
        state = self.ckpt.load([prefix + n for n in names], self.dtype, self.device)
        module.load_state_dict({n: state[prefix + n] for n in names}, strict=False, assign=True)

    @staticmethod
    def _release(module: torch.nn.Module) -> None:
        for sub in module.modules():
            for n, p in list(sub.named_parameters(recurse=False)):
                sub._parameters[n] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows of ids [B, T] -> [B, T, hidden], gathered chunk by chunk of the vocabulary."""
        out = torch.empty(*ids.shape, self.hidden_size, dtype=self.dtype, device=self.device)
        ids = ids.to(self.device)
        for lo in range(0, self.vocab, self.chunk_rows):
            hi = min(self.vocab, lo + self.chunk_rows)
            sel = (ids >= lo) & (ids < hi)
            if sel.any():
                out[sel] = self.ckpt.rows(self.embed_key, lo, hi, self.dtype, self.device)[ids[sel] - lo]
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head, vocabulary chunk by chunk: [B, T, hidden] -> [B, T, V] float32."""
        h = self.model.model.norm(hidden)
        out = torch.empty(*h.shape[:-1], self.vocab, dtype=torch.float32, device=h.device)
        for lo in range(0, self.vocab, self.chunk_rows):
            hi = min(self.vocab, lo + self.chunk_rows)
            w = self._head_cache.get(lo)
            if w is None:
                w = self.ckpt.rows(self.head_key, lo, hi, self.dtype, self.device)
                if self.chunk_rows >= self.vocab:
                    self._head_cache[lo] = w  # one chunk: keep it for the head phase
            out[..., lo:hi] = torch.nn.functional.linear(h, w).float()
        return out

    # --- execution ---------------------------------------------------------------------------
    def _catch(self, emb: torch.Tensor, p: Pass, i: int) -> tuple[tuple, dict]:
        def hook(module, args, kwargs):
            raise _Caught(args, kwargs)

        h = self.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
        try:
            with p.context():
                self.model(inputs_embeds=emb, **{"use_cache": False, "logits_to_keep": 1, **p.kwargs(i)})
        except _Caught as c:
            return c.args_, c.kwargs_
        finally:
            h.remove()
        raise RuntimeError("streaming: the model's forward never reached its first decoder layer")

    @torch.no_grad()
    def run(self, batches: list[torch.Tensor], passes: list[Pass], head: Callable[[int, int, torch.Tensor], None] | None = None,
            before_batch: Callable[[int], None] | None = None, progress: bool = True, desc: str = "layers") -> None:
        """Push every batch (ids [B, T]) of every pass through all layers, then (if `head`) call
        head(pass index, batch index, logits [B, T, V] float32) batch by batch, passes in order."""
        spill = self.device.type == "cuda"  # hidden states wait in pinned CPU memory between layers
        for p in passes:
            p.hidden, p.layer_kwargs = [], []
        for i, ids in enumerate(batches):
            emb = self.embed(ids)
            for p in passes:
                args, kw = self._catch(emb, p, i)
                p.hidden.append(args[0].pin_memory() if spill else args[0])
                p.layer_kwargs.append(kw)
        n = len(self.layers)
        bar = tqdm(range(n), desc=desc, unit="layer", disable=not progress)
        for li in bar:
            layer = self.layers[li]
            self._materialize(layer, f"model.layers.{li}.")
            try:
                for i in range(len(batches)):
                    if before_batch is not None:
                        before_batch(i)
                    for p in passes:
                        with p.context():
                            h = p.hidden[i].to(self.device, non_blocking=True)
                            out = layer(h, **p.layer_kwargs[i])
                            out = out[0] if isinstance(out, tuple) else out
                        p.hidden[i] = out.pin_memory() if spill else out
            finally:
                self._release(layer)
        if head is None:
            return
        self._materialize(self.model.model.norm, "model.norm.")
        try:
            for i in range(len(batches)):
                for pi, p in enumerate(passes):
                    head(pi, i, self.logits(p.hidden[i].to(self.device)))
                    p.hidden[i] = None
        finally:
            self._release(self.model.model.norm)
            self._head_cache.clear()


def build_empty(model_dir: Path, dtype: torch.dtype):
    """The model's modules from its config.json, parameters on the meta device (buffers real)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def weights_exceed_device(ckpt: Checkpoint, dtype: torch.dtype, device: str) -> bool:
    """model.streaming=auto: stream when the weights (in the compute dtype) exceed 80% of what the
    compute device has free (CPU: available RAM; CUDA: free device memory)."""
    import psutil

    with safe_open(str(ckpt.where["model.embed_tokens.weight"]), "pt") as h:
        stored = 4 if h.get_slice("model.embed_tokens.weight").get_dtype() == "F32" else 2
    need = ckpt.nbytes() * torch.empty(0, dtype=dtype).element_size() / stored
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
    else:
        free = psutil.virtual_memory().available
    return need > 0.8 * free


def load_streamed(model_dir: Path, cfg, tokenizer, identity: dict):
    """A LoadedModel whose `model` is the empty skeleton and whose `streamer` runs it from disk."""
    from kvcompress.models.base import DTYPES, Geometry, LoadedModel

    dtype = DTYPES[cfg.dtype]
    model = build_empty(model_dir, dtype)
    device = "cuda:0" if cfg.device == "cuda" else cfg.device
    streamer = LayerStreamer(model, Checkpoint(model_dir), dtype, device)
    return LoadedModel(model, tokenizer, Geometry.from_hf_config(model.config), {**identity, "streamed": True}, streamer=streamer)


def should_stream(cfg, model_dir: Path) -> bool:
    """Resolve model.streaming (auto|true|false) for a checkpoint directory."""
    from kvcompress.models.base import DTYPES

    if cfg.streaming == "auto":
        return cfg.device != "auto" and weights_exceed_device(Checkpoint(model_dir), DTYPES[cfg.dtype], cfg.device)
    return bool(cfg.streaming)
