"""The text decoder of a multimodal checkpoint (Gemma 3 4B-27B, Mistral 3.1 Small: `*ForConditionalGeneration`).

Only the text decoder keeps a KV cache of the kind kvcompress compresses, and text-only serving runs it alone. Such a
checkpoint stores the decoder under a prefix (`model.language_model.` since transformers 4.52, `language_model.model.`
before) beside a vision tower and a projector. kvcompress builds the text model class of its `text_config`
(transformers' `AutoModelForCausalLM` mapping: Gemma 3 -> Gemma3ForCausalLM) and reads the decoder's tensors under that
class's names (`decoder_name`); the vision tensors are never read. For text input the two models compute the same
logits (tested). The export then writes a text-only checkpoint of that class and says so in its manifest.
"""
from __future__ import annotations

import re

DECODER_KEYS = ((r"^model\.language_model\.", "model."), (r"^language_model\.model\.", "model."),
                (r"^language_model\.lm_head\.", "lm_head."), (r"^lm_head\.", "lm_head."))  # stored -> the text model's names


def text_config_dict(hf: dict) -> dict | None:
    """config.json's `text_config` when the file describes a multimodal wrapper (an architecture named
    *ForConditionalGeneration holding a text_config), else None."""
    archs = hf.get("architectures") or []
    text = hf.get("text_config")
    if isinstance(text, dict) and any(str(a).endswith("ForConditionalGeneration") for a in archs):
        return text
    return None


def decoder_name(stored: str) -> str | None:
    """The text model's name of a stored tensor, or None for a tensor outside the text decoder (vision tower, projector)."""
    for pattern, repl in DECODER_KEYS:
        if re.match(pattern, stored):
            return re.sub(pattern, repl, stored, count=1)
    return None


def text_config(model_dir, stored_names):
    """The transformers config of the text decoder of the multimodal checkpoint in `model_dir`. Its output head is tied
    to the embedding exactly when the checkpoint stores none (`stored_names`: the text model's names of the stored
    tensors): wrappers say so in their own config (Mistral 3.1: tie_word_embeddings true there, false in text_config),
    and a text model left untied would get a random head."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model_dir), local_files_only=True).text_config
    cfg.architectures = None  # the text class is chosen by its model_type (transformers' causal-LM mapping)
    cfg.tie_word_embeddings = "lm_head.weight" not in stored_names
    return cfg
