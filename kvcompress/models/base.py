"""What the pipeline needs to know about a loaded model."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Geometry:
    """KV geometry of a decoder-only model."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position: int
    rope_theta: float
    architecture: str
    # per layer: the sliding attention window in tokens, 0 = full attention (empty: all full). A
    # serving engine keeps a sliding layer's cache as a rolling buffer of that many tokens
    # (TensorRT-LLM's per-layer max_attention_window, transformers' sliding-window cache layers);
    # a chunked-attention layer (Llama 4) reads only its current chunk, so it holds at most attention_chunk_size.
    sliding_windows: tuple = ()

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "Geometry":
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rope = getattr(cfg, "rope_parameters", None) or {}
        if "full_attention" in rope and isinstance(rope["full_attention"], dict):  # per layer type (Gemma 3)
            rope = rope["full_attention"]
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        types = getattr(cfg, "layer_types", None) or ()
        # the most tokens a layer's cache holds: a sliding layer its window; a chunked layer (Llama 4) its current chunk
        bound = {"sliding_attention": getattr(cfg, "sliding_window", None) or 0, "chunked_attention": getattr(cfg, "attention_chunk_size", None) or 0}
        sliding = tuple(int(bound.get(t) or 0) for t in types) if any(bound.get(t) for t in types) else ()
        return cls(
            n_layers=cfg.num_hidden_layers,
            n_heads=cfg.num_attention_heads,
            n_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            max_position=getattr(cfg, "max_position_embeddings", 2048),
            rope_theta=float(theta),
            architecture=(getattr(cfg, "architectures", None) or [cfg.model_type])[0],
            sliding_windows=sliding,
        )

    def layer(self, i: int) -> "Geometry":
        """The one-layer geometry of layer i (its own sliding window), for per-layer accounting."""
        return replace(self, n_layers=1, sliding_windows=self.sliding_windows[i:i + 1])

    def stored_tokens(self, i: int, n_tokens: int) -> int:
        """Tokens layer i's cache holds at context n_tokens (a sliding layer: at most its window)."""
        w = self.sliding_windows[i] if self.sliding_windows else 0
        return min(n_tokens, w) if w else n_tokens

    def __post_init__(self):
        object.__setattr__(self, "sliding_windows", tuple(int(w) for w in self.sliding_windows))  # from JSON: a list

    def to_dict(self) -> dict:
        """JSON-shaped (a round trip through a file header gives the same dict)."""
        return {**asdict(self), "sliding_windows": list(self.sliding_windows)}

    def kv_fields(self) -> dict:
        """The fields an artifact must agree on to be usable with a model."""
        return {k: getattr(self, k) for k in ("n_layers", "n_heads", "n_kv_heads", "head_dim")}


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Tokenizer
    geometry: Geometry
    identity: dict = field(default_factory=dict)  # name, source, path, fingerprint: goes into provenance
    streamer: Any = None  # a LayerStreamer when the weights stay on disk (model holds meta parameters)

    @property
    def device(self) -> torch.device:
        return self.streamer.device if self.streamer is not None else next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype
