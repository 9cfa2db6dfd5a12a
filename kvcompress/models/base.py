"""What the pipeline needs to know about a loaded model."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
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

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "Geometry":
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
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
        )

    def to_dict(self) -> dict:
        return asdict(self)

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
