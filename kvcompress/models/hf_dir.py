"""A local Hugging Face model directory (config.json + safetensors). Nothing is downloaded."""
from __future__ import annotations

import json
from pathlib import Path

from kvcompress.errors import UserError
from kvcompress.hashing import dir_fingerprint
from kvcompress.models import SOURCES
from kvcompress.models.base import DTYPES, Geometry, LoadedModel
from kvcompress.models.streaming import load_streamed, should_stream
from kvcompress.models.tokenizer import HFTokenizer

def check_dir(cfg) -> Path:
    if not cfg.path:
        raise UserError(
            f"model.path is required for model={cfg.name} (a local Hugging Face safetensors directory); "
            f"add model.path=/path/to/{cfg.name}"
        )
    p = Path(cfg.path)
    if not p.is_dir():
        raise UserError(f"model.path={cfg.path!r} does not exist or is not a directory")
    if not (p / "config.json").is_file():
        raise UserError(f"model.path={cfg.path!r} has no config.json (expected a Hugging Face model directory)")
    try:
        hf = json.loads((p / "config.json").read_text())
        model_type, archs = hf.get("model_type"), hf.get("architectures") or []
    except (json.JSONDecodeError, AttributeError):
        raise UserError(f"model.path={cfg.path!r}: config.json is not a JSON object") from None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "")
    if not (isinstance(cls, str) and cls.endswith("ForCausalLM")) or (archs and not any(str(a).endswith("ForCausalLM") for a in archs)):
        raise UserError(f"model.path={cfg.path!r} holds a model_type={model_type!r} model, not a decoder-only causal LM "
                        "transformers knows (e.g. llama, mistral, qwen2)")
    if not any(p.glob("*.safetensors")):
        raise UserError(f"model.path={cfg.path!r} has no *.safetensors weights (kvcompress reads safetensors only, never pickled .bin files)")
    return p


@SOURCES.register("hf_dir")
def load_hf_dir(cfg, cache_dir) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = check_dir(cfg)
    tok = HFTokenizer(AutoTokenizer.from_pretrained(str(p), local_files_only=True))
    identity = {"name": cfg.name, "source": "hf_dir", "path": str(p.resolve()), "sha256": dir_fingerprint(p)}
    if should_stream(cfg, p):
        return load_streamed(p, cfg, tok, identity)
    kwargs = {"dtype": DTYPES[cfg.dtype], "local_files_only": True}
    if cfg.device == "auto":
        kwargs["device_map"] = "auto"  # accelerate spreads layers over the visible GPUs (and CPU)
    model = AutoModelForCausalLM.from_pretrained(str(p), **kwargs)
    if cfg.device != "auto":
        model = model.to(cfg.device)
    identity |= {"model_type": model.config.model_type, "name_or_path": getattr(model.config, "_name_or_path", None)}
    return LoadedModel(model.eval(), tok, Geometry.from_hf_config(model.config), identity)
