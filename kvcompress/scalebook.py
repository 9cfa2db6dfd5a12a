"""ScaleBook: the fitted, static parameters of a compressed KV cache (output of `fit`).

Tensors:
    k_scale      [L, H, D] float32  static per-channel post-RoPE key scale
    k_zero       [L, H, D] float32  per-channel key offset (all 0 when symmetric)
    k_outliers   [L, H, n_out] int64 key channels kept in fp16 (n_out = spec.outlier_channels; with
                 per-layer formats, the largest layer count: layer i uses its first n_i entries)
    k_clip       [L, H] float32     clipping ratio chosen by the fit (1 = raw range)
    k_range      [L, H, D] float32  the half-range the scales were fitted to (before clipping)
    k_bits       [L, H, D] int64    bits of each key channel (kv.key.alloc=waterfill only; token-grouped keys)
Values have no static parameters: their scales are per token, computed at write time.
A spec with per-layer formats (kv.layers) is stored in the header like any spec; version 2 of the
file format is the one that may carry it (version 1 files load unchanged).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvcompress.artifacts import load_artifact, save_artifact
from kvcompress.errors import ArtifactError
from kvcompress.reference import KeyParams
from kvcompress.spec import KVSpec

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
KIND = "scalebook"
GEOMETRY_KEYS = ("n_layers", "n_heads", "n_kv_heads", "head_dim")


@dataclass
class ScaleBook:
    spec: KVSpec
    geometry: dict
    tensors: dict[str, torch.Tensor]
    provenance: dict
    fit_info: dict

    def layer_spec(self, layer: int) -> KVSpec:
        """The uniform spec layer `layer` follows (the spec itself unless it is per-layer)."""
        return self.spec.layer(layer)

    def key_params(self, layer: int) -> KeyParams:
        s = self.layer_spec(layer)
        return KeyParams(
            bits=s.key.bits,
            scale=self.tensors["k_scale"][layer],
            zero=self.tensors["k_zero"][layer],
            outlier_idx=self.tensors["k_outliers"][layer][..., : s.outlier_channels],
        )

    def key_bits(self, layer: int) -> int | torch.Tensor:
        """Bits of the layer's key codes: an int, or per channel [H, D] int64 (kv.key.alloc=waterfill)."""
        return self.tensors["k_bits"][layer] if "k_bits" in self.tensors else self.layer_spec(layer).key.bits

    def value_group(self, layer: int) -> int:
        return self.layer_spec(layer).value_group(self.geometry["head_dim"])

    def profiled(self, what: str) -> dict:
        """The `what` record ("model", "calib") of the statistics this book was fitted from ({} if not recorded)."""
        return self.provenance.get("stats", {}).get(what) or {}

    def save(self, path: str | Path) -> None:
        header = {
            "kind": KIND,
            "format_version": FORMAT_VERSION,
            "spec": self.spec.model_dump(),
            "geometry": self.geometry,
            "provenance": self.provenance,
            "fit": self.fit_info,
        }
        save_artifact(path, self.tensors, header)

    @classmethod
    def load(cls, path: str | Path, geometry: dict | None = None) -> "ScaleBook":
        """Load; with `geometry` (a model's), refuse a ScaleBook fitted for another shape."""
        tensors, header = load_artifact(path, KIND, READABLE_VERSIONS)
        book = cls(KVSpec.model_validate(header["spec"]), header["geometry"], tensors, header["provenance"], header["fit"])
        if geometry is not None:
            book.check_geometry(geometry)
        return book

    def check_geometry(self, geometry: dict) -> None:
        if self.spec.is_mixed and len(self.spec.layers) != geometry.get("n_layers"):
            raise ArtifactError(f"scalebook has {len(self.spec.layers)} per-layer formats but the model has {geometry.get('n_layers')} layers")
        bad = {k: (self.geometry.get(k), geometry.get(k)) for k in GEOMETRY_KEYS if self.geometry.get(k) != geometry.get(k)}
        if bad:
            desc = ", ".join(f"{k}: scalebook {a} vs model {b}" for k, (a, b) in bad.items())
            raise ArtifactError(f"scalebook geometry does not match the model ({desc})")
