"""The text decoder of a multimodal checkpoint (Gemma 3 4B-27B, Mistral 3.1 Small: `*ForConditionalGeneration`).

Only the text decoder keeps a KV cache of the kind kvcompress compresses, and text-only serving runs it alone. Such a
checkpoint stores the decoder under a prefix (`model.language_model.` since transformers 4.52, `language_model.model.`
before) beside a vision tower and a projector. kvcompress builds the text model class of its `text_config`
(transformers' `AutoModelForCausalLM` mapping: Gemma 3 -> Gemma3ForCausalLM) and reads the decoder's tensors under that
class's names (`decoder_name`); the vision tensors are never read. For text input the two models compute the same
logits (tested). The export then writes a text-only checkpoint of that class and says so in its manifest.
"""
from __future__ import annotations

# stored -> the text model's names; the one mapping lives beside the custom-tier network, which runs alone on the GPU host
from kvcompress.targets.network_weights import TEXT_DECODER_KEYS as DECODER_KEYS  # noqa: F401 (hf_dir's key_mapping)
from kvcompress.targets.network_weights import text_decoder_name as decoder_name  # noqa: F401 (checkpoint.Checkpoint)


def text_config_dict(hf: dict) -> dict | None:
    """config.json's `text_config` when the file describes a multimodal wrapper (an architecture named
    *ForConditionalGeneration holding a text_config), else None."""
    archs = hf.get("architectures") or []
    text = hf.get("text_config")
    if isinstance(text, dict) and any(str(a).endswith("ForConditionalGeneration") for a in archs):
        return text
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
