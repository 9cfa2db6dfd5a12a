"""Independent check of a report: the real CompressedCache in a plain decoding loop.

    python scripts/check_cache_eval.py runs/<model>/<kv>/<time>  [--windows 4] [--seq-len 512] [--seed 7]

Decodes other held-out windows (a different seed than the report's) token by token, once
through transformers' DynamicCache (fp16 baseline) and once through CompressedCache with the
run's ScaleBook, and prints perplexity delta, mean KL and top-1 agreement beside report.json.
This path shares no code with the one-pass evaluation except the model and the reference
numerics the cache stores with.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from _common import cache_dir, eval_config, positive, run
from transformers import DynamicCache

from kvcompress.cache import CompressedCache
from kvcompress.config import ModelConfig
from kvcompress.data import load_texts, token_windows
from kvcompress.errors import UserError
from kvcompress.models import load_model
from kvcompress.scalebook import ScaleBook


@torch.no_grad()
def decode(model, ids, cache):
    return torch.cat([model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(ids.shape[1])], 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--windows", type=positive, default=4)
    ap.add_argument("--seq-len", type=positive, default=512)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    missing = [f for f in ("report.json", "config.json", "scalebook.safetensors") if not (a.run_dir / f).is_file()]
    if missing:
        raise UserError(f"{str(a.run_dir)!r} is not a validated run directory (missing {', '.join(missing)})")
    report = json.loads((a.run_dir / "report.json").read_text())
    cfg = json.loads((a.run_dir / "config.json").read_text())
    lm = load_model(ModelConfig.model_validate(cfg["model"]), cache_dir())  # the run's own model (its model.path, dtype, device)
    book = ScaleBook.load(a.run_dir / "scalebook.safetensors", lm.geometry.to_dict())
    windows = token_windows(lm.tokenizer, load_texts(eval_config("default")), a.windows, a.seq_len, seed=a.seed)
    nll_b = nll_c = kl = agree = n = 0.0
    for i in range(windows.shape[0]):
        ids = windows[i : i + 1]
        lb = torch.log_softmax(decode(lm.model, ids, DynamicCache(config=lm.model.config))[0, :-1].float(), -1)
        lc = torch.log_softmax(decode(lm.model, ids, CompressedCache(book))[0, :-1].float(), -1)
        tgt = ids[0, 1:, None]
        nll_b += float(-lb.gather(-1, tgt).sum())
        nll_c += float(-lc.gather(-1, tgt).sum())
        kl += float((lb.exp() * (lb - lc)).sum())
        agree += float((lb.argmax(-1) == lc.argmax(-1)).sum())
        n += tgt.numel()
        print(f"window {i + 1}/{windows.shape[0]} done", flush=True)
    ppl_b, ppl_c = math.exp(nll_b / n), math.exp(nll_c / n)
    q = report["quality"]
    print(f"{'':28} {'report (one-pass)':>18} {'cache decode loop':>18}")
    print(f"{'ppl delta (relative)':28} {100 * q['ppl_delta_rel']:>17.3f}% {100 * (ppl_c - ppl_b) / ppl_b:>17.3f}%")
    print(f"{'KL mean (nats)':28} {q['kl_mean']:>18.2e} {kl / n:>18.2e}")
    print(f"{'top-1 agreement':28} {100 * q['top1_agree']:>17.2f}% {100 * agree / n:>17.2f}%")
    print(f"tokens: report {q['tokens']}, this loop {int(n)} (different held-out windows, seed {a.seed})")


if __name__ == "__main__":
    run(main)
