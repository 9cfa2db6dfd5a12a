"""A local Hugging Face model directory (config.json + safetensors). Nothing is downloaded."""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

from kvcompress.errors import UserError, cause
from kvcompress.hashing import dir_fingerprint
from kvcompress.models import SOURCES
from kvcompress.models.base import DTYPES, Geometry, LoadedModel
from kvcompress.models.multimodal import DECODER_KEYS, text_config, text_config_dict
from kvcompress.models.quantized import weight_quantization
from kvcompress.models.checkpoint import Checkpoint
from kvcompress.models.streaming import load_streamed, should_stream
from kvcompress.models.tokenizer import HFTokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def check_safetensors(p: Path, given: str) -> None:
    """Every *.safetensors file of `p` has a readable header (read alone; no tensor is loaded)."""
    from safetensors import safe_open

    for f in sorted(p.glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt"):
                pass
        except Exception as e:  # SafetensorError (a bad header), OSError: one line naming the file
            raise UserError(f"model.path={given!r}: {f.name} is not a readable safetensors file ({cause(e, 120)})") from None


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

    text = text_config_dict(hf) if isinstance(hf, dict) else None
    if text is not None:  # a multimodal checkpoint: its text decoder (models.multimodal)
        tcls = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(text.get("model_type"), "")
        if not (isinstance(tcls, str) and tcls.endswith("ForCausalLM")):
            raise UserError(f"model.path={cfg.path!r} holds a multimodal {archs[0]} whose text decoder (text_config model_type="
                            f"{text.get('model_type')!r}) is not a causal LM transformers knows (e.g. gemma3_text, mistral)")
        model_type, archs = text.get("model_type"), [tcls]
    cls = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "")
    if not (isinstance(cls, str) and cls.endswith("ForCausalLM")) or (archs and not any(str(a).endswith("ForCausalLM") for a in archs)):
        raise UserError(f"model.path={cfg.path!r} holds a model_type={model_type!r} model" + (f" ({archs[0]})" if archs else "")
                        + ", which kvcompress does not take: it takes the decoder-only *ForCausalLM models transformers knows (e.g. llama, mistral, qwen2)")
    if not any(p.glob("*.safetensors")):
        raise UserError(f"model.path={cfg.path!r} has no *.safetensors weights (kvcompress reads safetensors only, never pickled .bin files)")
    check_safetensors(p, cfg.path)
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise UserError(f"model.path={cfg.path!r} has no tokenizer (one of {', '.join(TOKENIZER_FILES)}); copy the model's tokenizer files beside its weights")
    weight_quantization(p)  # weights stored in a format kvcompress cannot read: one line, before anything loads
    return p


@SOURCES.register("hf_dir")
def load_hf_dir(cfg, cache_dir) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = check_dir(cfg)
    try:
        tok = HFTokenizer(AutoTokenizer.from_pretrained(str(p), local_files_only=True))
    except (OSError, ValueError) as e:  # tokenizer files transformers cannot read
        raise UserError(f"model.path={cfg.path!r}: its tokenizer cannot be loaded ({cause(e)})") from None
    identity = {"name": cfg.name, "source": "hf_dir", "path": str(p.resolve()), "sha256": dir_fingerprint(p)}
    wrapper = multimodal_arch(p)
    if wrapper:
        identity["text_decoder_of"] = wrapper
    if should_stream(cfg, p, text_decoder=bool(wrapper)):
        return load_streamed(p, cfg, tok, identity)
    kwargs = {"dtype": DTYPES[cfg.dtype], "local_files_only": True}
    if weight_quantization(p) == "mxfp4":  # GPT-OSS's MXFP4 experts, dequantized by transformers on loading (models.quantized)
        from transformers import Mxfp4Config

        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    if cfg.device == "auto":
        kwargs["device_map"] = "auto"  # accelerate spreads layers over the visible GPUs (and CPU)
    if wrapper:  # the text decoder alone, its tensors renamed on loading; the vision tower's are not read into the model
        kwargs |= {"config": text_config(p, Checkpoint(p, text_decoder=True).entries), "key_mapping": dict(DECODER_KEYS), "output_loading_info": True}
        with quiet_transformers():  # it would list every vision tensor as "unexpected"
            model, info = AutoModelForCausalLM.from_pretrained(str(p), **kwargs)
        if info.get("missing_keys"):  # never a randomly initialised tensor
            raise UserError(f"model.path={cfg.path!r}: the text decoder of this {wrapper} lacks {sorted(info['missing_keys'])[:3]} "
                            f"(read from model.language_model.* or language_model.model.*)")
        forget_decoder_renaming(model)
    else:
        model, info = AutoModelForCausalLM.from_pretrained(str(p), output_loading_info=True, **kwargs)
        if info.get("missing_keys"):  # transformers would initialise them at random
            raise UserError(f"model.path={cfg.path!r}: the checkpoint lacks {len(info['missing_keys'])} of the model's tensors, e.g. "
                            f"{sorted(info['missing_keys'])[:3]}; a model with randomly initialised weights is refused")
    if cfg.device != "auto":
        model = model.to(cfg.device)
    identity |= {"model_type": model.config.model_type, "name_or_path": getattr(model.config, "_name_or_path", None)}
    return LoadedModel(model.eval(), tok, Geometry.from_hf_config(model.config), identity)


def multimodal_arch(p: Path) -> str | None:
    """The wrapper architecture (e.g. Gemma3ForConditionalGeneration) when `p` holds a multimodal checkpoint, else None."""
    hf = json.loads((p / "config.json").read_text())
    return (hf.get("architectures") or [None])[0] if text_config_dict(hf) is not None else None


@contextmanager
def quiet_transformers():
    """transformers' loading report at error level only, for the duration."""
    from transformers.utils import logging as hf_logging

    old = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(old)


def forget_decoder_renaming(model) -> None:
    """transformers records the key mapping a model was loaded with and reverts it when the model's tensors are saved
    (the HF export's revert_weight_conversion): the text decoder's own checkpoint keeps the text model's names."""
    from transformers.core_model_loading import WeightRenaming

    ours = {pattern for pattern, _ in DECODER_KEYS}
    conv = getattr(model, "_weight_conversions", None)
    if conv:
        model._weight_conversions = [c for c in conv if not (isinstance(c, WeightRenaming) and set(c.source_patterns) <= ours)]
