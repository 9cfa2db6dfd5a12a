"""Multimodal checkpoints read as their text decoder (kvcompress.models.multimodal): Gemma 3 4B-27B's
Gemma3ForConditionalGeneration (tensors under model.language_model.*, the head tied in the text config) and Mistral Small
3.1's Mistral3ForConditionalGeneration (under language_model.model.*, the head tied only in the wrapper's config), tiny
and random, built in code. The text model must compute the wrapper's logits on text, and every export route the text
model's class has must work from the multimodal directory."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvcompress.config import ModelConfig
from kvcompress.errors import UserError
from test_gemma3 import random_qk_norms


def gemma3_dir(tmp_path) -> Path:
    """A tiny Gemma3ForConditionalGeneration (Gemma 3 4B-27B's class: a vision tower, a projector and the text decoder
    under model.language_model) saved as a Hugging Face directory with a byte tokenizer; q/k norm weights not zero."""
    from transformers import AutoModelForCausalLM, Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    from kvcompress.models.synthetic import byte_tokenizer

    text = Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, sliding_window=16, max_position_embeddings=4096,
                            layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
    cfg = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4, image_token_index=299,
                       boi_token_index=297, eoi_token_index=298)
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    random_qk_norms(model.model.language_model.layers)
    d = tmp_path / "gemma3_mm"
    model.save_pretrained(str(d))
    byte_tokenizer().save_pretrained(str(d))
    return d


def test_a_multimodal_checkpoint_is_read_as_its_text_decoder(tmp_path):
    """Gemma 3 4B-27B ship as Gemma3ForConditionalGeneration: kvcompress loads the text decoder alone (Gemma3ForCausalLM,
    tensors renamed from model.language_model.*, the vision tower never read), in memory and streamed; on text it gives
    the multimodal model's logits. A wrapper whose text decoder transformers cannot build as a causal LM: one line."""
    from transformers import AutoModelForCausalLM

    from kvcompress.models.hf_dir import check_dir, load_hf_dir
    from kvcompress.models.checkpoint import Checkpoint

    d = gemma3_dir(tmp_path)
    cfg = ModelConfig(name="mm", source="hf_dir", path=str(d), dtype="float32", device="cpu", streaming=False)
    lm = load_hf_dir(cfg, tmp_path / "cache")
    assert type(lm.model).__name__ == "Gemma3ForCausalLM" and lm.identity["text_decoder_of"] == "Gemma3ForConditionalGeneration"
    assert lm.geometry.sliding_windows == (16, 16, 0) and lm.geometry.n_kv_heads == 2
    full = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    ids = torch.randint(0, 290, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(lm.model(input_ids=ids).logits, full(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    names = set(Checkpoint(d, text_decoder=True).entries)
    assert "model.layers.0.self_attn.k_norm.weight" in names and not any("vision" in n or "language_model" in n for n in names)
    streamed = load_hf_dir(cfg.model_copy(update={"streaming": True}), tmp_path / "cache")
    assert streamed.streamer is not None and type(streamed.model).__name__ == "Gemma3ForCausalLM"
    hf = json.loads((d / "config.json").read_text())
    hf["text_config"]["model_type"] = "no_such_text_model"
    (d / "config.json").write_text(json.dumps(hf))
    with pytest.raises(UserError, match="multimodal Gemma3ForConditionalGeneration whose text decoder .*'no_such_text_model'.* is not a causal LM"):
        check_dir(cfg)


def test_a_multimodal_gemma3_exports_its_text_decoder(tmp_path):
    """kv=native_fp8 on the multimodal checkpoint, in memory and streamed: the same validation, a text-only FP8 HF
    checkpoint (Gemma3ForCausalLM's names, no vision tensors) re-measured within tolerance, and the manifest says
    that only the text decoder was written."""
    from safetensors.torch import load_file

    from test_export import _dir_run

    d = gemma3_dir(tmp_path)
    kls = []
    for streaming in ("false", "true"):
        p, run = _dir_run(tmp_path, d, f"run_{streaming}", "kv=native_fp8", "export.dtype=bfloat16", f"model.streaming={streaming}")
        assert p.returncode == 0, p.stderr[-3000:]
        m = json.loads((run / "export" / "manifest.json").read_text())
        assert "Gemma3ForConditionalGeneration" in m["text_decoder_only"] and "vision tower" in m["text_decoder_only"]
        assert all(c["status"] == "passed" for c in m["checks"]), m["checks"]
        w = load_file(str(next((run / "export" / "hf_ckpt").glob("*.safetensors"))))
        assert "model.layers.0.self_attn.k_proj.k_scale" in w and not any("vision" in n or "language_model" in n for n in w)
        assert json.loads((run / "export" / "hf_ckpt" / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]
        assert "text decoder only" in (run / "report.md").read_text()
        kls.append(m["artifacts"]["hf_ckpt"]["remeasured"]["validated_kl"])
    assert kls[0] == kls[1]


def mistral3_dir(tmp_path) -> Path:
    """A tiny Mistral3ForConditionalGeneration (Mistral Small 3.1's class): a Llama-layer text decoder stored under
    language_model.model.*, no lm_head tensor, tie_word_embeddings true in the wrapper's config and false in text_config."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    from kvcompress.models.synthetic import byte_tokenizer

    text = MistralConfig(vocab_size=300, hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=6,
                         num_key_value_heads=2, head_dim=32, sliding_window=None, max_position_embeddings=4096)
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14, head_dim=16)
    cfg = Mistral3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_index=299)
    cfg.architectures = ["Mistral3ForConditionalGeneration"]
    torch.manual_seed(0)
    model = Mistral3ForConditionalGeneration(cfg)
    d = tmp_path / "mistral3_mm"
    model.save_pretrained(str(d))
    byte_tokenizer().save_pretrained(str(d))
    return d


def test_mistral3s_text_decoder_keeps_the_wrappers_tied_head(tmp_path):
    """The wrapper ties the head in its own config and stores no lm_head: the text model must tie it too (left untied,
    transformers would give it a random head, silently). Tensors the text decoder lacks: one line, never random."""
    from safetensors.torch import load_file, save_file
    from transformers import Mistral3ForConditionalGeneration

    from kvcompress.models.hf_dir import load_hf_dir

    d = mistral3_dir(tmp_path)
    cfg = ModelConfig(name="mm", source="hf_dir", path=str(d), dtype="float32", device="cpu", streaming=False)
    lm = load_hf_dir(cfg, tmp_path / "cache")
    assert type(lm.model).__name__ == "MistralForCausalLM" and lm.model.config.tie_word_embeddings
    full = Mistral3ForConditionalGeneration.from_pretrained(str(d), dtype=torch.float32)
    ids = torch.randint(0, 290, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(lm.model(input_ids=ids).logits, full(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    f = d / "model.safetensors"
    w = load_file(str(f))
    w.pop("language_model.model.layers.1.self_attn.o_proj.weight")
    save_file(w, str(f), metadata={"format": "pt"})
    with pytest.raises(UserError, match="the text decoder of this Mistral3ForConditionalGeneration lacks .*layers.1.self_attn.o_proj.weight"):
        load_hf_dir(cfg, tmp_path / "cache")


def test_mistral3s_text_decoder_exports_every_tier(tmp_path):
    """A Mistral3ForConditionalGeneration with the default kv: the custom tier (its network reads the multimodal
    directory's text decoder), the TensorRT-LLM checkpoint and the HF checkpoint, every check passed, text decoder only;
    streamed layer by layer, the same validation."""
    from test_export import _dir_run

    p, run = _dir_run(tmp_path, mistral3_dir(tmp_path), "run")
    assert p.returncode == 0, p.stderr[-3000:]
    m = json.loads((run / "export" / "manifest.json").read_text())
    assert set(m["artifacts"]) == {"plugin_bundle", "trtllm_ckpt", "hf_ckpt"} and "Mistral3ForConditionalGeneration" in m["text_decoder_only"]
    assert all(c["status"] == "passed" for c in m["checks"]), m["checks"]
    assert any("network graph" in c["check"] for c in m["checks"])
    p, runs = _dir_run(tmp_path, mistral3_dir(tmp_path), "run_streamed", "model.streaming=true")  # layer by layer: the same validation
    assert p.returncode == 0, p.stderr[-3000:]
    ms = json.loads((runs / "export" / "manifest.json").read_text())
    assert all(c["status"] == "passed" for c in ms["checks"] if "network graph" not in c["check"]), ms["checks"]
    assert ms["artifacts"]["hf_ckpt"]["remeasured"]["validated_kl"] == m["artifacts"]["hf_ckpt"]["remeasured"]["validated_kl"]



def test_a_multimodal_llama4_validates_and_exports_its_text_decoder(tmp_path):
    """Llama 4 ships as Llama4ForConditionalGeneration (decoder under language_model.model.*): its text decoder (chunked and
    global layers, a q/k norm after RoPE, so fit folds only the values) validates and exports as a text-only FP8 HF checkpoint,
    re-measured within tolerance; the ScaleBook says why the keys are not folded."""
    from safetensors.torch import load_file
    from transformers import Llama4Config, Llama4ForConditionalGeneration, Llama4TextConfig, Llama4VisionConfig

    from kvcompress.models.synthetic import byte_tokenizer
    from test_export import _dir_run

    text = Llama4TextConfig(vocab_size=300, hidden_size=64, intermediate_size=64, intermediate_size_mlp=128, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_local_experts=2, attention_chunk_size=16, max_position_embeddings=4096,
                            pad_token_id=0, rope_scaling=None)
    vision = Llama4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14,
                                vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    cfg = Llama4Config(text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_index=299, boi_token_index=297, eoi_token_index=298)
    cfg.architectures = ["Llama4ForConditionalGeneration"]
    torch.manual_seed(0)
    d = tmp_path / "llama4_mm"
    Llama4ForConditionalGeneration(cfg).save_pretrained(str(d))
    byte_tokenizer().save_pretrained(str(d))
    p, run = _dir_run(tmp_path, d, "run", "kv=native_fp8", "export.dtype=bfloat16", "model.dtype=float32")
    assert p.returncode == 0, p.stderr[-3000:]
    m = json.loads((run / "export" / "manifest.json").read_text())
    assert "Llama4ForConditionalGeneration" in m["text_decoder_only"] and all(c["status"] == "passed" for c in m["checks"]), m["checks"]
    assert json.loads((run / "export" / "hf_ckpt" / "config.json").read_text())["architectures"] == ["Llama4ForCausalLM"]
    w = load_file(str(next((run / "export" / "hf_ckpt").glob("*.safetensors"))))
    assert "model.layers.0.self_attn.k_proj.k_scale" in w and not any("vision" in n or "language_model" in n for n in w)
    fold = m["artifacts"]["hf_ckpt"]["fold"]
    assert "qk_norm" in fold["fold_keys_off"] and fold["fold_values_off"] is None and set(fold["fold_strength_keys"]) == {0.0}
    assert "- hf_ckpt: keys not folded (Llama4TextAttention.qk_norm" in (run / "report.md").read_text()
