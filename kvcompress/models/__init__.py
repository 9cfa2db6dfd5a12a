"""Model sources: one registry, one file per source (`gguf_package`, `hf_dir`, `tiny`)."""
from kvcompress.registry import Registry

SOURCES: Registry = Registry("model.source")

from kvcompress.models import gguf, hf_dir, tiny  # noqa: E402,F401  (register sources)
from kvcompress.models.base import Geometry, LoadedModel  # noqa: E402


def load_model(cfg, cache_dir) -> LoadedModel:
    """Load the model a ModelConfig describes (nothing is downloaded)."""
    if cfg.device.startswith("cuda"):
        import torch

        from kvcompress.errors import UserError

        n = torch.cuda.device_count()
        idx = int(cfg.device.partition(":")[2] or 0)
        if idx >= n:
            raise UserError(f"model.device={cfg.device} but this machine has {n} CUDA device(s); use model.device=cpu")
    return SOURCES.get(cfg.source)(cfg, cache_dir)


__all__ = ["SOURCES", "Geometry", "LoadedModel", "legacy_fingerprint", "load_model", "model_fingerprint"]


def model_fingerprint(cfg) -> str:
    """Content fingerprint of the model a ModelConfig names, without loading it (validates paths)."""
    from kvcompress.hashing import dir_fingerprint, file_fingerprint, obj_hash

    if cfg.source == "gguf_package" and cfg.parts and not cfg.path:
        gguf.part_paths(cfg)  # installed? (joined and checked against model.sha256 when loaded)
        return cfg.sha256
    if cfg.source == "gguf_package":
        p = gguf.gguf_path(cfg)
        gguf.check_gguf_file(p)
        return file_fingerprint(p)
    if cfg.source == "hf_dir":
        return dir_fingerprint(hf_dir.check_dir(cfg))
    return obj_hash(cfg.tiny.model_dump())


def legacy_fingerprint(cfg) -> str | None:
    """The fingerprint kvcompress gave this model before it hashed weight files whole (hashing.legacy_path_fingerprint),
    when it differs from model_fingerprint's (a weight file over 1 GiB); else None."""
    from kvcompress.hashing import legacy_path_fingerprint

    if cfg.source == "gguf_package" and not (cfg.parts and not cfg.path):
        return legacy_path_fingerprint(gguf.gguf_path(cfg))
    if cfg.source == "hf_dir":
        return legacy_path_fingerprint(hf_dir.check_dir(cfg))
    return None  # joined GGUF parts are fingerprinted by model.sha256, tiny models by their config: unchanged
