"""One-pass decode-equivalent evaluation vs token-by-token decoding through CompressedCache.

    python scripts/bench_onepass_vs_decode.py [--scalebook runs/.../scalebook.safetensors] [--windows 2] [--seq-len 1024]

Same held-out windows, same ScaleBook. Prints the time of each path, the speed-up (target
>= 10x) and the largest logit difference between them (they must agree). Without
--scalebook, profiles the built-in calibration text and fits kv=int8k_int4v first.
"""
from __future__ import annotations

import argparse
import math
import time

import torch
from _common import add_model_args, cache_dir, calib_config, eval_config, kv_spec, model_config, positive, run

from kvcompress.cache import CompressedCache
from kvcompress.data import load_texts, token_windows
from kvcompress.eval.attention import compressed_attention
from kvcompress.models import load_model
from kvcompress.scalebook import ScaleBook
from kvcompress.stages.fit import fit
from kvcompress.stages.profile import profile


@torch.no_grad()
def onepass(model, book, ids):
    with compressed_attention(model, book) as kw:
        return model(input_ids=ids, use_cache=False, **kw).logits


@torch.no_grad()
def decode(model, book, ids):
    cache = CompressedCache(book)
    return torch.cat([model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(ids.shape[1])], 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    ap.add_argument("--kv", default="int8k_int4v")
    ap.add_argument("--scalebook", default=None)
    ap.add_argument("--windows", type=positive, default=2)
    ap.add_argument("--seq-len", type=positive, default=1024)
    a = ap.parse_args()
    mcfg, spec = model_config(a.model, a.model_path), kv_spec(a.kv)  # bad names fail before the model loads
    lm = load_model(mcfg, cache_dir())
    if a.scalebook:
        book = ScaleBook.load(a.scalebook, lm.geometry.to_dict())
    else:
        calib = calib_config("default")
        book = fit(profile(lm, calib, load_texts(calib)), spec)
    ev = eval_config("default")
    windows = token_windows(lm.tokenizer, load_texts(ev, "eval"), a.windows, a.seq_len, seed=ev.seed)
    t_one = t_dec = 0.0
    max_diff = 0.0
    nll = {"one-pass": 0.0, "decode": 0.0}
    for i in range(windows.shape[0]):
        ids = windows[i : i + 1]
        t0 = time.perf_counter()
        lo = onepass(lm.model, book, ids)
        t_one += time.perf_counter() - t0
        t0 = time.perf_counter()
        ld = decode(lm.model, book, ids)
        t_dec += time.perf_counter() - t0
        max_diff = max(max_diff, float((lo - ld).abs().max()))
        for name, lg in (("one-pass", lo), ("decode", ld)):
            nll[name] += float(torch.nn.functional.cross_entropy(lg[0, :-1].float(), ids[0, 1:], reduction="sum"))
    print(f"model={a.model} kv={book.spec.name} windows={windows.shape[0]}x{a.seq_len} threads={torch.get_num_threads()}")
    print(f"one-pass (decode-equivalent) : {t_one:8.2f} s")
    print(f"token-by-token decode        : {t_dec:8.2f} s")
    print(f"speed-up                     : {t_dec / t_one:8.1f}x   (target >= 10x)")
    n = windows.shape[0] * (a.seq_len - 1)
    print(f"perplexity one-pass / decode : {math.exp(nll['one-pass'] / n):.4f} / {math.exp(nll['decode'] / n):.4f}")
    print(f"max |logit difference|       : {max_diff:.2e}  ({lm.model.dtype})")
    if lm.model.dtype == torch.float32:
        print("  (float32 noise flips a few quantization roundings between the two paths; in float64 they agree to 1e-8:")
        print("   tests/test_eval_equivalence.py::test_smollm2_onepass_equals_decode_float64)")


if __name__ == "__main__":
    run(main)
