"""Profiling overhead: time of `profile` over a plain forward pass on the same calibration tokens.

    python scripts/bench_profile.py [--model smollm2_135m] [--calib default] [--repeats 2]

Both sides run the same windows in the same batches with logits for the last position only;
the plain side uses no cache. Prints both times and the ratio (target: <= 1.3x).
"""
from __future__ import annotations

import argparse
import time

import torch
from _common import add_model_args, cache_dir, calib_config, model_config, positive, run

from kvcompress.data import load_texts, token_windows
from kvcompress.models import load_model
from kvcompress.stages.profile import profile


@torch.no_grad()
def plain(lm, windows, batch):
    for lo in range(0, windows.shape[0], batch):
        lm.model(input_ids=windows[lo : lo + batch].to(lm.device), use_cache=False, logits_to_keep=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    ap.add_argument("--calib", default="default")
    ap.add_argument("--repeats", type=positive, default=2)
    a = ap.parse_args()
    mcfg, calib = model_config(a.model, a.model_path), calib_config(a.calib)  # bad names fail before the model loads
    lm = load_model(mcfg, cache_dir())
    texts = load_texts(calib)
    windows = token_windows(lm.tokenizer, texts, calib.n_samples, calib.seq_len, seed=calib.seed)
    plain(lm, windows[: calib.batch_size], calib.batch_size)  # warm-up
    t_plain, t_prof = [], []
    for _ in range(a.repeats):  # interleaved, best of N for both
        t0 = time.perf_counter()
        plain(lm, windows, calib.batch_size)
        t_plain.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        profile(lm, calib, texts, progress=False)
        t_prof.append(time.perf_counter() - t0)
    p, f = min(t_plain), min(t_prof)
    print(f"model={a.model} calib={a.calib} tokens={windows.numel()} threads={torch.get_num_threads()}")
    print(f"plain forward : {p:8.2f} s")
    print(f"profile       : {f:8.2f} s")
    print(f"ratio         : {f / p:8.2f}x   (target <= 1.30x)")


if __name__ == "__main__":
    run(main)
