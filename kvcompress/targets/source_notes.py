"""The native checkpoints' word on a quantized or multimodal source: whether each keeps the source's NVFP4 or integer
weights or writes them dequantized, the caveat where a kept checkpoint's server also quantizes activations (which validate
ran unquantized), and that only a multimodal model's text decoder was written.
"""
from __future__ import annotations

import logging

from kvcompress.models import int_weights
from kvcompress.models.quantized import quantization_config, served_activations, weight_quantization

log = logging.getLogger("kvcompress")


def note_source_weights(lm, artifacts: dict, dtype: str) -> dict:
    """A source with NVFP4 or integer weights (models.nvfp4_weights, models.int_weights): each native checkpoint says whether
    it keeps them (hf_ckpt: NVFP4 and compressed-tensors' as stored, GPTQ's and AWQ's repacked as pack-quantized; trtllm_ckpt:
    Model Optimizer's NVFP4 MLPs) or writes them dequantized (`source_nvfp4_weights`, `source_int_weights`). Any quantized
    source whose server quantizes activations (models.quantized.served_activations: W4A4 NVFP4, W8A8 int8, FP8 W8A8): each
    checkpoint that keeps its weights gets `served_otherwise`, the caveat that it is served otherwise than validated. The
    run warns once for each."""
    src = lm.streamer.ckpt.dir if lm.streamer is not None else None
    if src is None:
        return artifacts
    if weight_quantization(src) == "nvfp4":
        ct = str((quantization_config(src) or {}).get("quant_method")) == "compressed-tensors"
        note = (f"the source's NVFP4 weights are written dequantized, e2m1 code x fp8 block scale {'/' if ct else 'x'} global scale in {dtype}, the values "
                "validate computed with, activations unquantized as validate ran them")
        kept = ("the source's NVFP4 weights kept as stored (codes, fp8 block scales, global and input scales; the attention projections the fold "
                f"changes in {dtype}, in {'its ignore list' if ct else 'exclude_modules'}); validate computed with the values they define")
        for a in artifacts.values():
            if a.get("tier") == "native":
                a["source_nvfp4_weights"] = kept if a.get("fp8_weights_kept") else note
    if weight_quantization(src) == "int":
        q = quantization_config(src) or {}
        why = int_weights.repack_obstacle(q) if int_weights.layout(q) != "pack-quantized" else None
        note = (f"the source's integer weights are written dequantized, (q - z) * s in {dtype}, the values validate computed with "
                "(re-quantize them where the server needs int weights)")
        kept = ("the source's compressed-tensors integer weights kept as stored (pack-quantized codes, or int-quantized int8 codes, with "
                f"their scales; the attention projections the fold changes in {dtype}, listed in its ignore list); validate computed with the "
                "values they define")
        if int_weights.layout(q) != "pack-quantized":
            kept = (f"the source's {q.get('quant_method')} integer weights written as compressed-tensors pack-quantized, the same codes, zero "
                    f"points and scales (checked to dequantize to the validated weights; the attention projections the fold changes in {dtype}, "
                    "listed in its ignore list)")
        hf_note = note + (f"; not written pack-quantized: {why}" if why else "")
        for name, a in artifacts.items():
            if a.get("tier") == "native":
                a["source_int_weights"] = kept if a.get("fp8_weights_kept") else hf_note if name == "hf_ckpt" else note
        if not (artifacts.get("hf_ckpt") or {}).get("fp8_weights_kept"):
            log.warning("export: %s", hf_note)
    served = served_activations(src)
    kept_by = [name for name, a in artifacts.items() if a.get("tier") == "native" and a.get("fp8_weights_kept")]
    if served and kept_by:
        caveat = activations_caveat(*served, artifacts)
        for name in kept_by:
            artifacts[name]["served_otherwise"] = caveat
        log.warning("export: %s: %s", " and ".join(kept_by), caveat)
    return artifacts


def activations_caveat(served: str, to: str, artifacts: dict) -> str:
    """The caveat for checkpoints that keep a source's quantized weights whose server also quantizes each kept layer's input
    (W4A4 NVFP4, W8A8 int8 or FP8); it names the artifacts that serve the activations unquantized, as validate ran them
    (those with the weights dequantized, and the custom tier's engine)."""
    plain = [n for n, a in artifacts.items() if a.get("tier") == "native" and not a.get("fp8_weights_kept")]
    plain += ["the custom tier"] if "plugin_bundle" in artifacts else []
    as_plain = f" (as {' and '.join(plain)} {'serves' if len(plain) == 1 else 'serve'} them)" if plain else ""
    return (f"served as {served}, each kept quantized layer also quantizes its input to {to}, which validate and the re-measurement ran "
            f"unquantized{as_plain}: the K/V its server caches differ from the validated ones by that noise from layer 1 on (not emulated "
            "here; export.fp8_weights=dequantize writes the weights dequantized, served as validated)")


def text_decoder_note(lm) -> dict:
    """The manifest's word on a multimodal source (models.multimodal): only its text decoder was compressed and written."""
    wrapper = lm.identity.get("text_decoder_of")
    if not wrapper:
        return {}
    return {"text_decoder_only": f"the source is a multimodal {wrapper}: its text decoder ({type(lm.model).__name__}) was profiled, validated and "
                                 "written; its vision tower and projector are not in this export (the checkpoints serve text)"}
