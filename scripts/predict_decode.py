"""Predicted decode-attention time per decode step, from the compiled kernels and the bytes model.

    python scripts/predict_decode.py [--json docs/bench/predict_decode.json] [--render]

PREDICTED, NOT MEASURED. For Llama-3.1-70B and -8B shapes (batch 1) at 4K, 32K and 128K context
on H200 (4.8 TB/s) and H100 (3.35 TB/s): the bytes one decode step's attention moves through HBM
(kvcompress.kernels.bytes_model, all layers: the compressed cache with its metadata, sinks and
window, queries, split partials, outputs) divided by the GPU's peak bandwidth, beside an fp16 cache
read (K, V, query, output) at the same bandwidth, and their ratio. Decode attention is memory-
bound, so bytes / bandwidth is a first-order model; it is only as good as the kernel's loads, so
the script first compiles each format's kernel for sm_90 and audits its SASS (payload read through
loads >= 64 bits wide, no spills; else it refuses to predict). Not modelled: launch latency, the
split reduction's second kernel launch, imperfect bandwidth. A GPU owner measures the same rows
with `python scripts/bench_decode_attention.py` (same columns) to compare line by line.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvcompress.kernels import plan  # noqa: E402
from kvcompress.kernels.aot import Variant, compile_all  # noqa: E402
from kvcompress.kernels.bytes_model import CONTEXTS, FORMATS, FP16, MODELS, ROW_COLUMNS, DecodeShape, decode_bytes  # noqa: E402

BEGIN, END = "<!-- predict_decode:begin -->", "<!-- predict_decode:end -->"
DOC = ROOT / "docs" / "kernels.md"  # the page the table is rendered into
GPUS = ("H200", "H100")


def audit_formats(arch: str = "sm_90") -> dict[tuple[str, int], dict]:
    """{(format, gqa): main-loop audit of its compiled decode_split kernel} for the models' GQA ratios."""
    from kvcompress.kernels.audit import SPLIT_KERNELS, audit_dir

    gqas = sorted({hq // h for _, hq, h, _ in MODELS.values()})
    variants = [Variant(f"d128_g{g}_{n}", 128, g, f.key_bits, f.value_bits, f.group, f.n_sink, f.window, f.n_out, **f.family())
                for n, f in FORMATS.items() for g in gqas]
    with tempfile.TemporaryDirectory() as tmp:
        compile_all(arch, Path(tmp), variants)
        res = audit_dir(Path(tmp))
    out = {}
    for k in res["kernels"]:
        if k["kernel"] not in SPLIT_KERNELS:
            continue
        v = next(x for x in variants if k["name"] == f"{k['kernel']}_{x.name}")
        ml = k["main_loop"]
        if k["spills"] or ml["narrowest_payload_bits"] < 64:
            raise SystemExit(f"kvcompress: error: {k['name']} fails the audit (spills={k['spills']}, payload loads {ml['narrowest_payload_bits']} bits): no prediction")
        out[(v.name.split("_", 2)[2], v.gqa)] = {"block_t": v.block_t, "ctas_per_sm": k["occupancy"][arch]["ctas_per_sm"],
                                                   "payload_load_bits": ml["narrowest_payload_bits"], "registers": k["registers"]}
    return out


def predict(audits: dict) -> list[dict]:
    rows = []
    for model, (layers, hq, h, d) in MODELS.items():
        for gpu in GPUS:
            bw = plan.PEAK_BANDWIDTH[gpu]
            for ctx in CONTEXTS:
                shape = DecodeShape(1, hq, h, d, ctx)
                fp16 = layers * sum(decode_bytes(shape, FP16, 1).values())
                for name, fmt in FORMATS.items():
                    a = audits[(name, hq // h)]
                    n_comp = max(0, ctx - fmt.n_sink - fmt.window)
                    # the split count the shipped launch uses (ops.decode_attention, the export's network.json, the bench):
                    # the plan's fill of CTAS_PER_SM per SM; ctas_per_sm (the audit's residency) is reported beside it
                    splits = plan.choose_splits(1, h, n_comp, hq // h, d, fmt.token_bytes(d), a["block_t"], plan.SM_COUNT[gpu])
                    kvc = layers * sum(decode_bytes(shape, fmt, splits).values())
                    rows.append({"model": model, "gpu": gpu, "context": ctx, "batch": 1, "format": name, "splits": splits,
                                 "kvc_us": kvc / bw * 1e6, "fp16_us": fp16 / bw * 1e6, "speedup": fp16 / kvc,
                                 "kvc_bytes": kvc, "fp16_bytes": fp16, "payload_load_bits": a["payload_load_bits"],
                                 "block_t": a["block_t"], "ctas_per_sm": a["ctas_per_sm"], "bandwidth": bw, "layers": layers})
    return rows


def table(rows: list[dict]) -> str:
    head = "| model | GPU | context | format | splits | predicted kvcompress (µs) | fp16 read (µs) | ratio |\n|---|---|---:|---|---:|---:|---:|---:|\n"
    return head + "".join(f"| {r['model']} | {r['gpu']} | {r['context'] // 1024}K | {r['format']} | {r['splits']} | {r['kvc_us']:.1f} | "
                          f"{r['fp16_us']:.1f} | {r['speedup']:.2f}x |\n" for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=ROOT / "docs" / "bench" / "predict_decode.json")
    ap.add_argument("--render", action="store_true", help="render the table into docs/kernels.md between its markers")
    a = ap.parse_args()
    rows = predict(audit_formats())
    print("PREDICTED from the compiled code (bytes moved / peak HBM bandwidth), NOT measured; batch 1, all layers of one decode step")
    print(" ".join(f"{c:>12}" for c in ROW_COLUMNS))
    for r in rows:
        print(" ".join(f"{r[c]:>12.2f}" if isinstance(r[c], float) else f"{r[c]:>12}" for c in ROW_COLUMNS))
    a.json.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.json.with_suffix(".tmp")
    tmp.write_text(json.dumps({"columns": ROW_COLUMNS, "rows": rows, "command": "python scripts/predict_decode.py --render",
                               "assumptions": "memory-bound: time = bytes / peak HBM bandwidth; launch latency and the reduce kernel's launch not modelled"}, indent=2))
    tmp.replace(a.json)
    if a.render:
        text = DOC.read_text()
        i, j = text.index(BEGIN) + len(BEGIN), text.index(END)
        block = ("\n**Predicted from the compiled code, not measured** (`python scripts/predict_decode.py --render`; bytes moved per decode "
                 "step over peak HBM bandwidth, batch 1, all layers; each kernel's SASS audited first: payload via 128-bit loads for int8k_int4v, no spills). "
                 "A GPU owner measures the same rows with `python scripts/bench_decode_attention.py`.\n\n" + table(rows))
        DOC.write_text(text[:i] + block + text[j:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
