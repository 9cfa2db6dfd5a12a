"""The predicted decode table of docs/kernels.md comes from scripts/predict_decode.py and the bytes model, and so do the
ratios docs/presets.md quotes."""
import json
import os
import sys

import pytest

from kvcompress.kernels import plan
from kvcompress.kernels.bytes_model import FORMATS, FP16, MODELS, DecodeShape, decode_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def _rows():
    return json.loads(open(os.path.join(ROOT, "docs", "bench", "predict_decode.json")).read())["rows"]


def test_every_predicted_row_recomputes_from_the_bytes_model():
    rows = _rows()
    assert {(r["model"], r["gpu"], r["context"], r["format"]) for r in rows} == {
        (m, g, c, f) for m in MODELS for g in ("H200", "H100") for c in (4096, 32768, 131072) for f in FORMATS}
    for r in rows:
        layers, hq, h, d = MODELS[r["model"]]
        f = FORMATS[r["format"]]
        shape = DecodeShape(1, hq, h, d, r["context"])
        # the split count the shipped launch uses (plan.CTAS_PER_SM's fill, as ops.decode_attention and the export), not the audit's residency
        splits = plan.choose_splits(1, h, r["context"] - f.n_sink - f.window, hq // h, d, f.token_bytes(d), r["block_t"], plan.SM_COUNT[r["gpu"]])
        assert splits == r["splits"]
        kvc = layers * sum(decode_bytes(shape, f, splits).values())
        fp16 = layers * sum(decode_bytes(shape, FP16, 1).values())
        bw = plan.PEAK_BANDWIDTH[r["gpu"]]
        assert r["kvc_us"] == pytest.approx(kvc / bw * 1e6) and r["fp16_us"] == pytest.approx(fp16 / bw * 1e6)
        assert r["payload_load_bits"] >= 64


def test_kernels_page_table_is_the_rendered_prediction():
    from predict_decode import BEGIN, DOC, END, table

    text = DOC.read_text()
    block = text[text.index(BEGIN) + len(BEGIN): text.index(END)]
    assert table(_rows()) in block and "not measured" in block


def test_presets_grouped_ratio_sentence_is_the_prediction():
    """The wf5/wf6 paragraph's predicted ratios to int8k_int4v (Llama-3.1-70B, 128K, H200) are the table's."""
    r = {(x["model"], x["gpu"], x["context"], x["format"]): x["kvc_us"] for x in _rows()}
    base = r[("llama3.1-70b", "H200", 131072, "int8k_int4v")]
    wf6, wf5 = (r[("llama3.1-70b", "H200", 131072, f)] / base for f in ("wf6", "wf5"))
    text = " ".join(open(os.path.join(ROOT, "docs", "presets.md")).read().split())
    assert f"The decode is predicted at {wf6:.2f}x (wf6) and {wf5:.2f}x (wf5) int8k_int4v's time per step at 128K on Llama-3.1-70B" in text


def test_presets_wf3_sentence_is_the_prediction():
    """The wf3 paragraph's predicted ratio to wf4 and speedup over fp16 (Llama-3.1-70B, 128K, H200) are the table's."""
    r = {(x["model"], x["gpu"], x["context"], x["format"]): x for x in _rows()}
    wf3, wf4 = (r[("llama3.1-70b", "H200", 131072, f)] for f in ("wf3", "wf4"))
    text = " ".join(open(os.path.join(ROOT, "docs", "presets.md")).read().split())
    assert (f"a decode step at {wf3['kvc_us'] / wf4['kvc_us']:.2f}x wf4's time at 128K on Llama-3.1-70B (H200), "
            f"{wf3['speedup']:.2f}x faster than an fp16 read") in text
