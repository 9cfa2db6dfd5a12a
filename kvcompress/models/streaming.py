"""Layer-streamed execution: a model whose weights stay on disk until a layer is needed.

The model is built from its config with empty (meta) parameters: transformers' own decoder
layers, rotary embedding, mask construction and attention interface, no forked modeling code.
`LayerStreamer.run` pushes every batch of every *pass* (a stream of hidden states with its own
forward keywords and attention implementation, e.g. the fp16 baseline and each compressed
format) through decoder layer 0, frees it, loads layer 1, and so on. Each layer's tensors are
read from the checkpoint's safetensors shards (models.checkpoint: positioned reads of only that layer's bytes), cast to
the compute dtype and put on the compute device. Embeddings are gathered and `lm_head` applied in
vocabulary chunks, never more than about one layer's bytes at a time.

How the layers are called is taken from the model itself: its forward runs up to the first
decoder layer (a forward pre-hook captures the layer's arguments: attention mask, position
embeddings, cache, evaluation context) and stops; every later layer is called with the same
arguments, exactly as the model's own loop does.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager

import torch
from tqdm.auto import tqdm

from kvcompress.errors import UserError
from kvcompress.models.checkpoint import Checkpoint
from kvcompress.models.st_dtypes import ST_DTYPES
from kvcompress.models.quantized import weight_quantization

HEAD_CHUNK_BYTES = 64 << 20  # embedding / lm_head chunk size (in the compute dtype)
HEAD_KEEP_LAYERS = 2  # the head phase keeps lm_head's rows on the device if they take at most this many decoder layers' bytes,
HEAD_KEEP_FREE = 0.25  # or, on these devices, at most this share of their free memory (Gemma 3 27B: a 2.8 GB head, about 3.4
HEAD_KEEP_FREE_DEVICES = ("cuda",)  # of its layers). Not on a CPU host: it streams to bound RSS, and a re-read there is a copy


@dataclass
class Pass:
    """One stream of hidden states through the layers.

    kwargs(i): the forward keywords of batch i (e.g. a cache, an evaluation context);
    context(): entered around every call of the model's code for this pass (attention implementation).
    """

    kwargs: Callable[[int], dict] = lambda i: {}
    context: Callable[[], ContextManager] = nullcontext
    inputs: Callable[[int], torch.Tensor] | None = None  # this pass's ids of batch i (default: the batch itself)
    last_only: bool = False  # the head forms the last position's logits only ([B, 1, V]: a prefill whose other positions are never read)
    last: Callable[[int], int] | None = None  # batch i: the head forms the last last(i) positions' logits only
    hidden: list = field(default_factory=list)
    layer_kwargs: list = field(default_factory=list)


class _Caught(Exception):
    def __init__(self, args, kwargs):
        self.args_, self.kwargs_ = args, kwargs


class LayerStreamer:
    """Runs a causal LM layer by layer from its checkpoint directory (see the module doc)."""

    def __init__(self, model, checkpoint: Checkpoint, dtype: torch.dtype, device: str | torch.device):
        for_model = getattr(checkpoint, "for_model", None)  # stored names converted to the modules' (transformers' mapping)
        self.model, self.ckpt, self.dtype, self.device = model, for_model(model) if for_model else checkpoint, dtype, torch.device(device)
        base = getattr(model, "model", None)
        self.layers = getattr(base, "layers", None)
        if self.layers is None or not hasattr(model, "lm_head"):
            raise UserError(f"streaming supports decoder-only models with model.layers and lm_head; {type(model).__name__} has not")
        self.embed_key = "model.embed_tokens.weight"
        self.head_key = "lm_head.weight" if "lm_head.weight" in checkpoint else self.embed_key  # tied embeddings
        if self.embed_key not in checkpoint:
            raise UserError(f"checkpoint {str(checkpoint.dir)!r} has no {self.embed_key}")
        # every parameter the layers need, before any work (a missing one was found mid-run, after the run directory was written)
        missing = [n for n, _ in model.named_parameters() if n != "lm_head.weight" and n not in self.ckpt]
        if missing:
            raise UserError(f"checkpoint {str(checkpoint.dir)!r} lacks {len(missing)} of the model's tensors, e.g. {missing[:3]}")
        self.vocab, self.hidden_size = checkpoint.shape(self.embed_key)
        esize = torch.empty(0, dtype=dtype).element_size()
        self.layer_bytes = max(sum(p.numel() for p in self.layers[0].parameters()) * esize, 1)
        self.chunk_rows = max(1, min(self.vocab, HEAD_CHUNK_BYTES // (self.hidden_size * esize)))
        self.head_bytes = self.vocab * self.hidden_size * esize
        self._head_cache: dict[tuple[int, int], torch.Tensor] = {}  # (lo, hi) -> lm_head rows kept by the head phase
        self._keep_head = False  # head_phase: rows read are kept
        self.scoring_head = StreamedHead(self)

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
        _trim_heap()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows of ids [B, T] -> [B, T, hidden], gathered chunk by chunk of the vocabulary."""
        out = torch.empty(*ids.shape, self.hidden_size, dtype=self.dtype, device=self.device)
        ids = ids.to(self.device)
        for lo in range(0, self.vocab, self.chunk_rows):
            hi = min(self.vocab, lo + self.chunk_rows)
            sel = (ids >= lo) & (ids < hi)
            if sel.any():
                out[sel] = self.ckpt.rows(self.embed_key, lo, hi, self.dtype, self.device)[ids[sel] - lo]
        scale = getattr(self.model.model.embed_tokens, "scalar_embed_scale", None)  # Gemma: rows times sqrt(hidden)
        return out if scale is None else out * torch.tensor(scale).to(self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head, vocabulary chunk by chunk: [B, T, hidden] -> [B, T, V] float32 (the final norm must
        be materialized: the head phase of run)."""
        return self.head(self.model.model.norm(hidden))

    def head(self, normed: torch.Tensor) -> torch.Tensor:
        """lm_head on final-normed hidden states [B, T, hidden] -> [B, T, V] float32, vocabulary chunk by chunk read
        from the checkpoint, as the model applies it (head_transform). Needs no materialized module: it serves after
        a run too (export's re-measurement scores against validate's kept baseline hidden states)."""
        h = normed.to(self.device)
        out = torch.empty(*h.shape[:-1], self.vocab, dtype=torch.float32, device=h.device)
        for lo in range(0, self.vocab, self.chunk_rows):
            hi = min(self.vocab, lo + self.chunk_rows)
            out[..., lo:hi] = self.scoring_head.rows(lo, hi)(h)  # head_transform is elementwise: per range as whole
        return out

    def head_rows(self, lo: int, hi: int) -> torch.Tensor:
        """lm_head's rows lo..hi on the device: read from the checkpoint, or from what the head phase keeps."""
        w = self._head_cache.get((lo, hi))
        if w is None:
            w = self.ckpt.rows(self.head_key, lo, hi, self.dtype, self.device)
            if self._keep_head:
                self._head_cache[(lo, hi)] = w
        return w

    @contextmanager
    def head_phase(self):
        """The final norm materialized for logits(); lm_head's rows are kept as they are read if the whole head
        takes at most HEAD_KEEP_LAYERS decoder layers' bytes (none is loaded by then: a 70B's head is 1.2 of its
        layers) or, on a GPU, HEAD_KEEP_FREE of its free memory, so a head applied a block of positions at a time reads
        each row once per phase, not once per block. A head that fits neither is scored a vocabulary range at a time
        where that reads less (metrics.by_vocabulary: twice per batch); applied whole, it is read once per call."""
        self._materialize(self.model.model.norm, "model.norm.")
        self._keep_head = (self.head_bytes <= max(HEAD_CHUNK_BYTES, HEAD_KEEP_LAYERS * self.layer_bytes)
                           or (self.device.type in HEAD_KEEP_FREE_DEVICES and self.head_bytes <= HEAD_KEEP_FREE * free_bytes(self.device)))
        try:
            yield
        finally:
            self._release(self.model.model.norm)
            self._keep_head = False
            self._head_cache.clear()

    # --- execution ---------------------------------------------------------------------------
    def _spill(self, batches: list[torch.Tensor], passes: list[Pass]) -> bool:
        """On a GPU, keep every pass's hidden states on the device if they take at most half of its
        free memory after a layer is loaded (two layers' worth kept aside); else they wait in pinned
        CPU memory between layers. On the CPU there is nothing to spill to."""
        if self.device.type != "cuda":
            return False
        tokens = sum(int((b if p.inputs is None else p.inputs(i)).numel()) for p in passes for i, b in enumerate(batches))
        need = tokens * self.hidden_size * self.dtype.itemsize
        free, _ = torch.cuda.mem_get_info(self.device)
        return need > 0.5 * (free - 2 * self.layer_bytes)

    def _catch(self, emb: torch.Tensor, p: Pass, i: int) -> tuple[torch.Tensor, list[dict]]:
        with p.context():
            return catch_layer_inputs(self.model, inputs_embeds=emb, **p.kwargs(i))

    @torch.no_grad()
    def run(self, batches: list[torch.Tensor], passes: list[Pass], head: Callable[[int, int, torch.Tensor], None] | None = None,
            before_batch: Callable[[int], None] | None = None, progress: bool = True, desc: str = "layers",
            after_layer: Callable[[int], None] | None = None, head_hidden: bool = False) -> None:
        """Push every batch (ids [B, T]) of every pass through all layers, then (if `head`) call
        head(pass index, batch index, logits [B, T, V] float32; [B, 1, V] for a last_only pass) batch by batch,
        passes in order; with head_hidden, head(pass index, batch index, final-normed hidden [B, T, hidden], the head
        as a StreamedHead) (run_calls_hidden)."""
        spill = self._spill(batches, passes)
        for p in passes:
            p.hidden, p.layer_kwargs = [], []
        for i, ids in enumerate(batches):
            emb = self.embed(ids)
            for p in passes:
                h, kws = self._catch(emb if p.inputs is None else self.embed(p.inputs(i)), p, i)
                p.hidden.append(h.pin_memory() if spill else h)
                p.layer_kwargs.append(kws)
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
                            out = layer(h, **p.layer_kwargs[i][li])
                            out = out[0] if isinstance(out, tuple) else out
                        p.hidden[i] = out.pin_memory() if spill else out
            finally:
                self._release(layer)
            if after_layer is not None:
                after_layer(li)
        if head is None:
            return
        with self.head_phase():
            for i in range(len(batches)):
                for pi, p in enumerate(passes):
                    h = (p.hidden[i][:, -1:] if p.last_only else p.hidden[i][:, -p.last(i):] if p.last else p.hidden[i]).to(self.device)
                    head(pi, i, self.model.model.norm(h), self.scoring_head) if head_hidden else head(pi, i, self.logits(h))
                    p.hidden[i] = None


class StreamedHead:
    """A LayerStreamer's head as the evaluation scores with it (run(head_hidden=True) passes it): called on final-normed
    hidden states it is LayerStreamer.head; rows(lo, hi) applies the rows lo..hi alone (read once, for every side that
    shares them), and `rereads` says whether each application reads the checkpoint again (outside a head phase that
    keeps the head): metrics.score_hidden then scores a vocabulary range at a time (metrics.vocab_stats)."""

    def __init__(self, streamer: LayerStreamer):
        self.s = streamer

    def __call__(self, normed: torch.Tensor) -> torch.Tensor:
        return self.s.head(normed)

    @property
    def rereads(self) -> bool:
        return not self.s._keep_head

    @property
    def chunk(self) -> int:
        return self.s.chunk_rows

    @property
    def device(self) -> torch.device:
        return self.s.device

    def rows(self, lo: int, hi: int) -> Callable[[torch.Tensor], torch.Tensor]:
        w = self.s.head_rows(lo, hi)
        return lambda normed: head_transform(self.s.model, torch.nn.functional.linear(normed.to(w.device), w).float())


def catch_layer_inputs(model, **forward_kwargs) -> tuple[torch.Tensor, list[dict]]:
    """The hidden states the model's forward passes to its first decoder layer, and the keywords it
    passes to each decoder layer: they differ by layer type in some models (Gemma 3's sliding and
    global layers get their own RoPE tables and masks), so every layer is run with its own. The
    layers are not run here: each stands in as the identity while the model walks its loop, which
    stops after the last one (a streamed model's head is never reached)."""
    layers = model.model.layers
    first: list[torch.Tensor] = []
    kws: list[dict] = []

    def stand_in(i: int):
        def forward(*args, **kwargs):
            h = args[0] if args else kwargs.pop("hidden_states")
            if len(args) > 1:
                raise RuntimeError(f"decoder layer {i} got {len(args)} positional arguments; kvcompress passes only the hidden states")
            if i == 0:
                first.append(h)
            kws.append(kwargs)
            if i == len(layers) - 1:
                raise _Caught((first[0],), kws)
            return h
        return forward

    own = [layer.__dict__.get("forward") for layer in layers]  # e.g. accelerate's device-map hooks
    for i, layer in enumerate(layers):
        layer.forward = stand_in(i)
    try:
        model(**{"use_cache": False, "logits_to_keep": 1, **forward_kwargs})
    except _Caught:
        return first[0], kws
    finally:
        for layer, f in zip(layers, own):
            if f is None:
                del layer.forward  # the class's forward again
            else:
                layer.forward = f
    raise RuntimeError("the model's forward never reached its last decoder layer")


def _trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc). Layer tensors of a few MB come from the heap
    once glibc's dynamic mmap threshold has risen; without a trim a streamed run's resident memory
    creeps up layer after layer although nothing is held."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim  # noqa: B018  (not glibc: AttributeError)
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC = None


def passes_for(model, calls: list[tuple[str | None, dict]]) -> list[Pass]:
    """One Pass per (attention implementation, forward keywords) evaluation call (no cache)."""
    from kvcompress.models.observe import attention_implementation

    return [Pass(kwargs=lambda i, kw=kw: {"use_cache": False, **kw},
                 context=lambda impl=impl: attention_implementation(model, impl)) for impl, kw in calls]


def final_logits(model, normed: torch.Tensor) -> torch.Tensor:
    """lm_head on final-normed hidden states (any block of positions) -> float32 logits, as the model's own forward
    computes them (head_transform)."""
    return head_transform(model, model.lm_head(normed).float())


def head_transform(model, logits: torch.Tensor) -> torch.Tensor:
    """What causal LMs of transformers do to lm_head's output: Cohere's logit_scale, Granite's logits_scaling,
    Gemma 2's tanh soft cap. A head not listed here fails validate's self-check in one line."""
    scale = getattr(model, "logit_scale", None)
    if scale is not None:
        logits = logits * scale
    div = getattr(model.config, "logits_scaling", None)
    if div:
        logits = logits / div
    cap = getattr(model.config, "final_logit_softcapping", None)
    return logits if not cap else torch.tanh(logits / cap) * cap


def run_passes(lm, batches: list[torch.Tensor], passes: list[Pass], head: Callable | None, progress: bool = False, desc: str = "layers",
               after_layer: Callable[[int], None] | None = None, after_batch: Callable[[int], None] | None = None, head_hidden: bool = False,
               before_batch: Callable[[int], None] | None = None) -> None:
    """head(pass index, batch index, float32 logits) for every pass of every batch: one protocol (Pass), two residencies.
    Streamed (lm.streamer): LayerStreamer.run, layer-major; after_layer(li) once every pass of every batch went through
    layer li. In memory: batch-major, the decoder (lm.model.model) once per pass with the pass's inputs, keywords and
    context, its final-normed hidden states (the last position for last_only, the last last(i) for last) through
    final_logits; after_batch(i) once batch i's passes are scored. head_hidden: head(pass index, batch index,
    final-normed hidden states, to_logits) instead (run_calls_hidden); head None: no head (profile: observers only).
    before_batch(i): before batch i's computation (streamed: before it enters each layer)."""
    if lm.streamer is not None:
        lm.streamer.run(batches, passes, head=head, before_batch=before_batch, progress=progress, desc=desc, after_layer=after_layer,
                        head_hidden=head_hidden)
        return
    model = lm.model
    dev = getattr(lm, "device", None) or next(model.parameters()).device  # a LoadedModel's input device (device maps: the embedding's)
    to_logits = lambda x: final_logits(model, x)  # noqa: E731
    for i, ids in enumerate(tqdm(batches, desc=desc, unit="batch", disable=not progress)):
        if before_batch is not None:
            before_batch(i)
        for pi, p in enumerate(passes):
            with p.context():
                h = model.model(input_ids=(ids if p.inputs is None else p.inputs(i)).to(dev), **p.kwargs(i)).last_hidden_state
            if head is None:
                continue
            h = h[:, -1:] if p.last_only else h[:, -p.last(i):] if p.last else h
            if head_hidden:
                head(pi, i, h, to_logits)
            else:
                head(pi, i, to_logits(h))
        if after_batch is not None:
            after_batch(i)


def run_calls_hidden(lm, batches: list[torch.Tensor], calls: list[tuple[str | None, dict]], head, progress: bool = False,
                     desc: str = "validate") -> None:
    """head(call index, batch index, hidden [B, T, hidden], to_logits) for every batch under each (attention
    implementation, forward keywords) call, calls in order per batch: hidden is the decoder's final-normed output and
    to_logits maps hidden[:, positions] to float32 logits [B, positions, V] (at any time, also after the run), so a
    consumer can form logits a block of positions at a time (a 262K vocabulary at 8K context is 8.6 GB of logits per
    window). In memory: the decoder without its head (the causal LM's `model`, final norm included) and final_logits
    (validate's self-check compares them with the model's own forward); streamed: the executor's final hidden states
    through the final norm and its vocabulary-chunked head (LayerStreamer.head)."""
    run_passes(lm, batches, passes_for(lm.model, calls), head, progress=progress, desc=desc, head_hidden=True)


def run_calls(lm, batches: list[torch.Tensor], calls: list[tuple[str | None, dict]], head, progress: bool = False, desc: str = "validate") -> None:
    """head(call index, batch index, logits [B, T, V] float32) for every batch under each call (run_calls_hidden with
    every position's logits at once): in memory batch by batch, or layer by layer when the model is streamed. The
    one way evaluations run a LoadedModel."""
    run_calls_hidden(lm, batches, calls, lambda pi, i, h, to_logits: head(pi, i, to_logits(h)), progress, desc)


def build_empty(model_dir: Path | None, dtype: torch.dtype, config=None):
    """The model's modules from its config.json (or `config`), parameters on the meta device
    (buffers real). A quantization_config in the file is dropped: the weights are read as values."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = config if config is not None else AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    if getattr(cfg, "quantization_config", None) is not None:
        cfg.quantization_config = None
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def weights_exceed_device(ckpt: Checkpoint, dtype: torch.dtype, device: str) -> bool:
    """model.streaming=auto: stream when the weights (in the compute dtype) exceed 80% of what the
    compute device has free (CPU: available RAM; CUDA: free device memory)."""
    key = "model.embed_tokens.weight"
    if key not in ckpt.entries:  # another naming: the first floating-point tensor stands for the stored width
        key = next((k for k, e in ckpt.entries.items() if ST_DTYPES.get(e[1]["dtype"], torch.int8).is_floating_point), None)
        if key is None:
            raise UserError(f"checkpoint {str(ckpt.dir)!r} holds no floating-point tensor (model.embed_tokens.weight or another)")
    stored = ckpt.stored_dtype(key).itemsize
    need = ckpt.nbytes() * dtype.itemsize / stored
    return need > 0.8 * free_bytes(device)


def free_bytes(device: str | torch.device) -> int:
    """What the compute device has free: CUDA, its free device memory; CPU, the available RAM."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def load_streamed(model_dir: Path, cfg, tokenizer, identity: dict):
    """A LoadedModel whose `model` is the empty skeleton and whose `streamer` runs it from disk."""
    from kvcompress.models.base import DTYPES, Geometry, LoadedModel

    from kvcompress.models.multimodal import text_config

    dtype = DTYPES[cfg.dtype]
    text = identity.get("text_decoder_of") is not None  # a multimodal checkpoint: its text decoder alone
    ckpt = Checkpoint(model_dir, text_decoder=text)
    model = build_empty(None if text else model_dir, dtype, config=text_config(model_dir, ckpt.entries) if text else None)
    device = "cuda:0" if cfg.device == "cuda" else cfg.device
    streamer = LayerStreamer(model, ckpt, dtype, device)
    ident = {**identity, "model_type": model.config.model_type, "name_or_path": getattr(model.config, "_name_or_path", None) or str(model_dir), "streamed": True}
    return LoadedModel(model, tokenizer, Geometry.from_hf_config(model.config), ident, streamer=streamer)


def should_stream(cfg, model_dir: Path, text_decoder: bool = False) -> bool:
    """Resolve model.streaming (auto|true|false) for a checkpoint directory (text_decoder: its text decoder's weights).
    FP8 weights are always streamed: the streaming reader dequantizes them with their stored scales (models.quantized);
    model.streaming=false is then a one-line error. MXFP4 experts (GPT-OSS) are streamed too (auto, true), dequantized
    by the reader (mxfp4_weights), or with model.streaming=false loaded in memory, transformers dequantizing them."""
    from kvcompress.models.base import DTYPES

    wq = weight_quantization(model_dir)
    if wq == "mxfp4" and (cfg.streaming is False or cfg.streaming == "false"):
        return False  # in memory: transformers dequantizes the experts (hf_dir)
    if wq:
        what = {"fp8": "FP8 weights", "int": "integer-quantized weights", "nvfp4": "NVFP4 weights"}.get(wq, "MXFP4 experts") + ", which kvcompress reads layer by layer"
        if cfg.device == "auto":
            raise UserError(f"model.device=auto: model.path={str(model_dir)!r} stores {what} on one device, dequantized with their stored "
                            "scales; allowed for it: model.device=cpu or cuda:N" + (" (or model.streaming=false: in memory)" if wq == "mxfp4" else ""))
        if cfg.streaming is False or cfg.streaming == "false":
            raise UserError(f"model.streaming=false: model.path={str(model_dir)!r} stores {what}, "
                            "dequantized with their stored scales; allowed for it: model.streaming=auto or true")
        return True
    if cfg.streaming == "auto":
        return cfg.device != "auto" and weights_exceed_device(Checkpoint(model_dir, text_decoder=text_decoder), DTYPES[cfg.dtype], cfg.device)
    return bool(cfg.streaming)
