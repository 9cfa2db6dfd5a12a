"""Re-measure what was written: read an exported checkpoint back and score it like validate did.

* TensorRT-LLM checkpoint: the pure-PyTorch reader (kvcompress.targets.trtllm_reader) runs the
  checkpoint's own tensors (fp16/bf16 values, float32 math) and quantizes K/V with the
  kv_cache_quant_algo and per-layer kv_cache_scaling_factor stored in it, as TensorRT-LLM does.
* Hugging Face checkpoint: transformers builds the model from the written config.json and loads
  the written shards; the KV cache is quantized to FP8 with the k_scale/v_scale read from them.
Both are compared, on the same held-out windows, with the unquantized original model: validate's kept
metrics.Baseline (its final hidden states and head), logits formed a block of positions at a time.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from kvcompress.eval.attention import eval_call
from kvcompress.eval.metrics import Baseline, QualityAccumulator, score_hidden
from kvcompress.models.checkpoint import Checkpoint
from kvcompress.models.streaming import LayerStreamer, build_empty, final_logits, passes_for
from kvcompress.scalebook import ScaleBook
from kvcompress.spec import ALGO_FORMAT
from kvcompress.spec import native_spec
from kvcompress.targets import trtllm_reader
from kvcompress.targets.hf_ckpt import read_state

SCORED = ("tokens", "ppl_compressed", "ppl_delta_rel", "kl_mean", "kl_se", "kl_p99", "top1_agree")  # what a re-measurement reports
KL_SE_Z = 3.0  # compare(): KLs this many standard errors apart are still "the same"


def baseline(lm, windows: torch.Tensor, batch_size: int) -> Baseline:
    """The unquantized model's final hidden states of `windows` and its head (validate's kept baseline, computed alone),
    to re-measure checkpoints against."""
    from kvcompress.stages.validate import evaluate_quality

    return evaluate_quality(lm, {}, windows, batch_size, progress=False, keep=True)[1]


def _result(acc: QualityAccumulator) -> dict:
    r = acc.result()
    return {k: r[k] for k in SCORED}


@torch.no_grad()
def _score(hidden_of, base: Baseline) -> dict:
    """hidden_of(ids [B, T]) -> (final-normed hidden [B, T, hidden], head) of the re-measured model, scored batch by
    batch against validate's kept baseline a block of positions at a time (score_hidden)."""
    acc = QualityAccumulator()
    with base.phase():
        for i, ids in enumerate(base.batches()):
            h, head = hidden_of(ids)
            score_hidden(base.hidden[i], base.head, [(acc, h, head)], ids, base.vocab)
    return _result(acc)


@torch.no_grad()
def _score_streamed(streamer, book: ScaleBook, base: Baseline) -> dict:
    """_score through the layer-streamed executor: the checkpoint is never loaded whole."""
    acc = QualityAccumulator()
    batches = base.batches()
    with base.phase():  # the baseline's head is read as the re-measured model's head phase asks for it, then kept
        streamer.run(batches, passes_for(streamer.model, [eval_call(book)]), progress=False, head_hidden=True,
                     head=lambda pi, i, h, head: score_hidden(base.hidden[i], base.head, [(acc, h, head)], batches[i], base.vocab))
    return _result(acc)


def remeasure_trtllm_streamed(ckpt, hf_config, geometry: dict, base: Baseline, device="cpu") -> dict:
    """The TensorRT-LLM checkpoint read back layer by layer under HF names (trtllm_reader.TrtllmAsHF)
    into transformers' model of the source config (Llama, Mistral, Qwen2, Qwen3; float32 math on the stored values), K/V quantized with its stored
    kv_cache_quant_algo and per-layer scales."""
    src = trtllm_reader.TrtllmAsHF(ckpt)
    fmt = ALGO_FORMAT[src.cfg["quantization"]["kv_cache_quant_algo"]]
    streamer = LayerStreamer(build_empty(None, torch.float32, config=copy.deepcopy(hf_config)), src, torch.float32, device)
    return _score_streamed(streamer, native_book_from_scales(geometry, fmt, src.kv_scales()), base)


def remeasure_hf_streamed(ckpt, geometry: dict, base: Baseline, device="cpu") -> dict:
    """The HF checkpoint streamed from its written config.json and shards, FP8 KV from its k_scale/v_scale."""
    ck = Checkpoint(ckpt)
    L = geometry["n_layers"]
    k = torch.stack([ck.read(f"model.layers.{i}.self_attn.k_proj.k_scale").float() for i in range(L)])
    v = torch.stack([ck.read(f"model.layers.{i}.self_attn.v_proj.v_scale").float() for i in range(L)])
    if not torch.equal(k, v):
        raise ValueError("k_scale != v_scale: kvcompress writes one shared scale per layer")
    streamer = LayerStreamer(build_empty(Path(ckpt), torch.float32), ck, torch.float32, device)
    return _score_streamed(streamer, native_book_from_scales(geometry, "native_fp8", k.reshape(-1)), base)


def same_trtllm_tensors(a: Path, b: Path, n_layers: int) -> bool:
    """Two TensorRT-LLM checkpoints (any tp sizes) merge to exactly the same tensors, compared layer by layer."""
    ra, rb = trtllm_reader.TrtllmAsHF(a), trtllm_reader.TrtllmAsHF(b)
    if not torch.equal(ra.kv_scales(), rb.kv_scales()):
        return False
    vocab = ra.shape("model.embed_tokens.weight")[0]
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        for lo in range(0, vocab, 4096):
            hi = min(vocab, lo + 4096)
            if not torch.equal(ra.rows(key, lo, hi, torch.float32, "cpu"), rb.rows(key, lo, hi, torch.float32, "cpu")):
                return False
    for i in range(n_layers):
        keys = ra.layer_keys(i) + ["model.norm.weight"]
        if keys != rb.layer_keys(i) + ["model.norm.weight"]:
            return False
        la, lb = ra.load(keys, torch.float32, "cpu"), rb.load(keys, torch.float32, "cpu")
        if any(not torch.equal(la[k], lb[k]) for k in keys):
            return False
    return True


def remeasure_trtllm(ckpt, base: Baseline) -> dict:
    loaded = trtllm_reader.merge_shards(ckpt)
    return _score(lambda ids: (trtllm_reader.final_hidden(loaded, ids, simulate_kv_quant=True), lambda x: trtllm_reader.head(loaded, x)), base)


def native_book_from_scales(geometry: dict, fmt: str, scales: torch.Tensor) -> ScaleBook:
    """A native ScaleBook with no fold (the checkpoint's weights are already folded) and `scales` [L]."""
    L, H, D = geometry["n_layers"], geometry["n_kv_heads"], geometry["head_dim"]
    spec = native_spec(fmt).model_copy(update={"fold_keys": False, "fold_values": False})
    ones = torch.ones(L, H, D)
    t = {"fold_k": ones, "fold_v": ones, "native_scale": scales.float(), "k_scale": ones, "k_zero": torch.zeros(L, H, D),
         "k_clip": torch.ones(L, H), "k_outliers": torch.zeros(L, H, 0, dtype=torch.int64), "k_range": ones}
    return ScaleBook(spec, geometry, t, {}, {"method": "scales read back from an exported checkpoint"})


def load_hf_checkpoint(ckpt):
    """(model in float32 holding the checkpoint's values, per-layer FP8 scale [L]) via transformers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(ckpt))
    cfg.quantization_config = None
    state = read_state(ckpt)
    L = cfg.num_hidden_layers
    k = torch.tensor([float(state.pop(f"model.layers.{i}.self_attn.k_proj.k_scale")) for i in range(L)])
    v = torch.tensor([float(state.pop(f"model.layers.{i}.self_attn.v_proj.v_scale")) for i in range(L)])
    if not torch.equal(k, v):
        raise ValueError("k_scale != v_scale: kvcompress writes one shared scale per layer")
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    names = Checkpoint(ckpt).for_model(model)  # stored names -> the modules' (transformers' conversions: Mixtral's experts)
    if names.converted:
        used = {s for _, srcs in names.converted.values() for _, s in srcs}
        state = {n: t for n, t in state.items() if n not in used} | names.load(list(names.converted), torch.float32, "cpu")
    missing, unexpected = model.load_state_dict({n: t.float() for n, t in state.items()}, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"hf checkpoint does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model, k


def remeasure_hf(ckpt, geometry: dict, base: Baseline) -> dict:
    from kvcompress.eval.attention import compressed_attention

    model, scales = load_hf_checkpoint(ckpt)
    book = native_book_from_scales(geometry, "native_fp8", scales)

    def hidden_of(ids):
        with compressed_attention(model, book) as kw:
            return model.model(input_ids=ids, use_cache=False, **kw).last_hidden_state, lambda x: final_logits(model, x)

    return _score(hidden_of, base)


def compare(validated: dict, remeasured: dict, rel: float, abs_: float) -> dict:
    """The re-measured KL must equal the validated one within max(rel * KL, abs, KL_SE_Z standard
    errors of the per-token KL mean). The checkpoint holds fp16/bf16 weights where validate ran
    float32 ones; on a few hundred tokens that alone moves a heavy-tailed KL mean (FP8: 7.4e-3 vs
    8.2e-3 on eval=smoke's 318 tokens of SmolLM2) by more than 10%, while a broken scale or layout
    moves it by many standard errors. With thousands of tokens the standard error is small and the
    relative tolerance governs."""
    a, b = validated["kl_mean"], remeasured["kl_mean"]
    se = max(validated.get("kl_se", 0.0), remeasured.get("kl_se", 0.0))
    tol = max(rel * a, abs_, KL_SE_Z * se)
    return {"validated_kl": a, "remeasured_kl": b, "tolerance": tol, "kl_se": se, "passed": abs(a - b) <= tol,
            "validated_ppl_delta_rel": validated["ppl_delta_rel"], "remeasured_ppl_delta_rel": remeasured["ppl_delta_rel"],
            "remeasured": remeasured}
