"""kvcompress beside other stacks' quantized KV caches, same windows, same metric code.

    python scripts/compare_peers.py [--model smollm2_135m] [--windows 2] [--seq-len 1024] [--chunk 16] [--no-chunked]
                                    [--calib default] [--eval default] [--pair-context 0]

Part 1, the native tier against NVIDIA Model Optimizer (the tool TensorRT-LLM users calibrate
KV-cache scales with; `nvidia-modelopt`, a dev dependency): ModelOpt's KV-only FP8 and INT8
calibration (max calibration over the same calibration windows kvcompress profiles; weights and
activations untouched) exported as TensorRT-LLM checkpoints by ModelOpt's own exporter, and
kvcompress's native_fp8 / native_int8 ScaleBooks written as TensorRT-LLM checkpoints by kvcompress's
exporter; all four read back by the same independent reader (kvcompress.targets.trtllm_reader:
fp16 weights, KV quantized from the stored kv_cache_scaling_factor) and scored on the held-out
windows of `eval=default` against one baseline. What is compared is what each checkpoint encodes.

Part 2 (chunked decoding):

Every cache (fp16 DynamicCache baseline, kvcompress CompressedCache, transformers' QuantizedCache
with the quanto backend at 4 and 2 bits, axis_key 0 (its default) and -1) is driven by the same
chunked teacher-forced decoding loop: chunks of --chunk tokens, so the past each chunk attends to
comes out of the cache under test. The "one call" column feeds each window in a single call:
QuantizedCache then returns full-precision K/V for the whole window and its KL collapses to ~0,
which shows why a single-pass perplexity never measures it. Retrieval: passkey samples, prefilled
in chunks through the cache, then greedy generation. llama.cpp's KV types run when `llama_cpp` is
importable (otherwise the table says so). Bits per element include scales, zero points and the
fp16 residual/window amortised over --seq-len tokens.
"""
from __future__ import annotations

import argparse
import importlib.util
import random
from pathlib import Path

import torch
from _common import add_model_args, cache_dir, calib_config, eval_config, kv_spec, model_config, positive, run

from kvcompress import reference as ref
from kvcompress.cache import CompressedCache
from kvcompress.data import load_texts, text_ids, token_windows
from kvcompress.eval.metrics import QualityAccumulator
from kvcompress.eval.tasks import TASKS
from kvcompress.models import load_model
from kvcompress.stages.fit import fit
from kvcompress.stages.profile import profile


@torch.no_grad()
def chunked_logits(model, ids: torch.Tensor, cache, chunk: int) -> torch.Tensor:
    return torch.cat([model(input_ids=ids[:, i : i + chunk], cache=cache, use_cache=True).logits for i in range(0, ids.shape[1], chunk)], 1)


@torch.no_grad()
def passkey_accuracy(lm, make_cache, corpus, n: int, length: int, chunk: int, window: int) -> float:
    ok = 0
    for seed in range(n):
        s = TASKS.get("passkey")(lm.tokenizer, corpus, length, [0.1, 0.5, 0.9][seed % 3], seed, window)
        cache = make_cache()
        ids = torch.tensor([s.prompt])
        logits = chunked_logits(lm.model, ids, cache, chunk)
        out = []
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(len(s.answer)):
            out.append(int(nxt))
            nxt = lm.model(input_ids=nxt, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        ok += out == s.answer
    return ok / n


def quanto_bits(nbits: int, group: int, residual: int, T: int) -> float:
    quantized = max(0, T - residual)
    return (quantized * (nbits + 2 * 16 / group) + min(T, residual) * 16) / T


def modelopt_checkpoint(lm, fmt: str, calib_windows: torch.Tensor, out: Path) -> Path:
    """ModelOpt KV-only calibration (FP8: its FP8_KV_CFG preset; INT8: the same with 8-bit integer
    quantizers) on a copy of the model, exported by ModelOpt as a tp=1 TensorRT-LLM checkpoint."""
    import copy
    import json

    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    kv = copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
    if fmt == "INT8":
        for e in kv:
            e["cfg"] = {**e["cfg"], "num_bits": 8}
    cfg = {"quant_cfg": [{"quantizer_name": "*", "enable": False}] + kv, "algorithm": "max"}
    model = copy.deepcopy(lm.model)

    def loop(m):
        for i in range(calib_windows.shape[0]):
            m(calib_windows[i : i + 1])

    model = mtq.quantize(model, cfg, forward_loop=loop)
    export_tensorrt_llm_checkpoint(model, "llama", torch.float16, str(out), inference_tensor_parallel=1)
    # ModelOpt 0.47 reads rope_theta from the transformers 4.x config attribute; under transformers 5
    # (rope_parameters) its config.json has no rotary_base, and TensorRT-LLM would then use its
    # default 10000. Add the model's value so that the comparison measures the KV cache, not that gap.
    cfg_path = out / "config.json"
    c = json.loads(cfg_path.read_text())
    if "rotary_base" not in c:
        rp = getattr(lm.model.config, "rope_parameters", None) or {}
        c["rotary_base"] = float(rp.get("rope_theta", getattr(lm.model.config, "rope_theta", 10000.0)))
        c["kvcompress_note"] = "rotary_base added by scripts/compare_peers.py (absent from ModelOpt 0.47's export under transformers 5)"
        cfg_path.write_text(json.dumps(c, indent=2))
    return out


def kvcompress_checkpoint(lm, book, out: Path) -> Path:
    """kvcompress's exporter: the native ScaleBook folded and written as a tp=1 TensorRT-LLM checkpoint."""
    from kvcompress.config import ExportConfig
    from kvcompress.targets.native import write_native_checkpoints

    write_native_checkpoints(lm, lm.geometry, book, book, ExportConfig(), [out / "tp1"], out / "hf", progress=False)
    return out / "tp1"


@torch.no_grad()
def native_vs_modelopt(lm, calib_name: str = "default", eval_name: str = "default", pair_context: int = 0) -> None:
    import json
    import tempfile

    from kvcompress.spec import native_spec
    from kvcompress.targets.recheck import baseline, remeasure_trtllm

    if importlib.util.find_spec("modelopt") is None:
        print("nvidia-modelopt not installed (pip install -e .[dev]): the Model Optimizer rows are skipped")
        return
    calib, ev = calib_config(calib_name), eval_config(eval_name)
    cw = token_windows(lm.tokenizer, load_texts(calib), calib.n_samples, calib.seq_len, seed=calib.seed)
    windows = token_windows(lm.tokenizer, load_texts(ev), ev.n_windows, ev.seq_len, seed=ev.seed)
    base = baseline(lm, windows, 1)
    stats = profile(lm, calib, load_texts(calib), progress=False)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for algo in ("FP8", "INT8"):
            ck = modelopt_checkpoint(lm, algo, cw, Path(tmp) / f"modelopt_{algo}")
            rows[f"Model Optimizer {algo}"] = (ck, remeasure_trtllm(ck, base))
        specs = {f"kvcompress {fmt}": native_spec(fmt) for fmt in ("native_fp8", "native_int8")}
        if pair_context:
            specs[f"native_fp8 pair_context={pair_context}"] = native_spec("native_fp8").model_copy(update={"pair_context": pair_context})
        for i, (name, spec) in enumerate(specs.items()):
            ck = kvcompress_checkpoint(lm, fit(stats, spec), Path(tmp) / f"kvcompress_{i}")
            rows[name] = (ck, remeasure_trtllm(ck, base))
        ref_kl = rows["Model Optimizer FP8"][1]["kl_mean"]
        print(f"native tier: TensorRT-LLM checkpoints read back and scored on {windows.shape[0]} x {windows.shape[1]} held-out tokens "
              f"(eval={eval_name}); calibration {cw.shape[0]} x {cw.shape[1]} tokens")
        print(f"{'checkpoint':<28} {'kv algo':>7} {'KV scale range':>17} {'ppl delta':>10} {'KL mean':>9} {'KL p99':>9} {'top-1':>7} {'KL / ModelOpt FP8':>18}")
        for name, (ck, r) in rows.items():
            cfg = json.loads((Path(ck) / "config.json").read_text())
            from safetensors import safe_open

            with safe_open(str(Path(ck) / "rank0.safetensors"), "pt") as f:
                sc = torch.stack([f.get_tensor(k).float().flatten()[0] for k in f.keys() if k.endswith("attention.kv_cache_scaling_factor")])
            print(f"{name:<28} {cfg['quantization']['kv_cache_quant_algo']:>7} {float(sc.min()):8.3g}-{float(sc.max()):<8.3g} "
                  f"{100 * r['ppl_delta_rel']:+9.3f}% {r['kl_mean']:9.2e} {r['kl_p99']:9.2e} {100 * r['top1_agree']:6.2f}% {r['kl_mean'] / ref_kl:17.2f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    ap.add_argument("--windows", type=positive, default=2)
    ap.add_argument("--seq-len", type=positive, default=1024)
    ap.add_argument("--chunk", type=positive, default=16)
    ap.add_argument("--passkeys", type=positive, default=6)
    ap.add_argument("--passkey-len", type=positive, default=1024)
    ap.add_argument("--no-chunked", action="store_true", help="only part 1 (the native tier vs Model Optimizer)")
    ap.add_argument("--calib", default="default", help="calib preset of part 1")
    ap.add_argument("--eval", default="default", help="eval preset of part 1 (its held-out windows)")
    ap.add_argument("--pair-context", type=int, default=0, help="part 1 also scores native_fp8 with kv.pair_context set to this (0: not)")
    a = ap.parse_args()
    if a.pair_context < 0:
        ap.error(f"--pair-context {a.pair_context}: allowed: 0 (no extra row) or a context > 0")
    mcfg = model_config(a.model, a.model_path)
    calib_config(a.calib), eval_config(a.eval)  # bad names fail before the model loads
    lm = load_model(mcfg, cache_dir())
    native_vs_modelopt(lm, a.calib, a.eval, a.pair_context)
    if a.no_chunked:
        return
    cfg = lm.model.config
    calib = calib_config("default")
    stats = profile(lm, calib, load_texts(calib), progress=False)
    book = fit(stats, kv_spec("int8k_int4v"))
    ev = eval_config("default")
    texts = load_texts(ev)
    windows = token_windows(lm.tokenizer, texts, a.windows, a.seq_len, seed=ev.seed)
    corpus = text_ids(lm.tokenizer, texts)
    g = lm.geometry
    kvc_bits = sum(v for k, v in ref.spec_cache_nbytes(book.spec, g, a.seq_len).items() if k != "static") * 8 / (2 * g.n_layers * g.n_kv_heads * g.head_dim * a.seq_len)
    peers = {"kvcompress int8k_int4v": (lambda: CompressedCache(book), kvc_bits)}
    if importlib.util.find_spec("optimum") and importlib.util.find_spec("optimum.quanto"):
        from transformers import QuantizedCache

        qg = min(64, g.head_dim)
        for nbits in (4, 2):
            for axis in (0, -1):
                peers[f"quanto {nbits}-bit axis_key={axis}"] = (
                    lambda nbits=nbits, axis=axis: QuantizedCache(backend="quanto", config=cfg, nbits=nbits, axis_key=axis, axis_value=0, q_group_size=qg, residual_length=128),
                    quanto_bits(nbits, qg, 128, a.seq_len),
                )
    else:
        print("optimum-quanto not installed: pip install optimum-quanto (QuantizedCache rows skipped)")
    llama_note = "llama.cpp rows: not run (llama_cpp not importable here)" if importlib.util.find_spec("llama_cpp") is None else "llama.cpp rows: not implemented in this script yet"
    from transformers import DynamicCache

    base = [chunked_logits(lm.model, windows[i : i + 1], DynamicCache(config=cfg), a.chunk) for i in range(windows.shape[0])]
    base_pk = passkey_accuracy(lm, lambda: DynamicCache(config=cfg), corpus, a.passkeys, a.passkey_len, a.chunk, 128)
    print(f"model={a.model} windows={windows.shape[0]}x{a.seq_len} chunk={a.chunk}; fp16 passkey accuracy {base_pk:.2f}")
    print(f"{'config':<28} {'bits/el':>7} {'ppl delta':>10} {'KL mean':>9} {'top-1':>7} {'passkey':>7} {'KL one call':>11}")
    for name, (make, bits) in peers.items():
        acc, one = QualityAccumulator(), QualityAccumulator()
        try:
            for i in range(windows.shape[0]):
                ids = windows[i : i + 1]
                acc.update(base[i], chunked_logits(lm.model, ids, make(), a.chunk), ids)
                one.update(base[i], chunked_logits(lm.model, ids, make(), ids.shape[1]), ids)
            r, o = acc.result(), one.result()
            pk = passkey_accuracy(lm, make, corpus, a.passkeys, a.passkey_len, a.chunk, 128)
        except ValueError as e:  # quanto's grouping rejects some shapes; say so instead of dropping the row
            print(f"{name:<28} {bits:7.2f}  failed: {str(e)[:80]}")
            continue
        print(f"{name:<28} {bits:7.2f} {100 * r['ppl_delta_rel']:+9.3f}% {r['kl_mean']:9.2e} {100 * r['top1_agree']:6.2f}% {pk:7.2f} {o['kl_mean']:11.2e}", flush=True)
    print(llama_note)


if __name__ == "__main__":
    random.seed(0)
    run(main)
