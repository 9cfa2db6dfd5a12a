"""Where native_fp8's pair fold (kv.fold_pairs) wins, and what kv.pair_context changes.

    python scripts/pair_fold_anatomy.py [--model smollm2_135m] [--calib default] [--eval default] [--pair-context 8192]

Part 1, from the calibration profile: per quarter of the RoPE pairs (fast to slow), the share of the
key energy it holds and the fraction of its energy that is the sample mean (a near-constant component,
which FP8 rounds the same way at every token while RoPE does not turn it).

Part 2, on the held-out windows of --eval, each native_fp8 TensorRT-LLM checkpoint read back and scored
against one baseline (as scripts/compare_peers.py does): no pair fold, the default (pair angles and
shrinks chosen at the calibration positions), kv.pair_context=N, and the default with one quarter of
the pairs given the kv.pair_context=N choice. The quarter whose swap costs the most is where the
calibration-position fit earns its gain.
"""
from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

import torch
from _common import add_model_args, cache_dir, calib_config, eval_config, model_config, run

from kvcompress.data import load_texts, token_windows
from kvcompress.models import load_model
from kvcompress.spec import native_spec
from kvcompress.stages.fit import fit
from kvcompress.stages.profile import profile


def pair_energy(stats) -> list[tuple[int, int, float, float]]:
    """[(first pair, last pair, share of key energy, mean-energy fraction)] per quarter of the pairs."""
    k = stats["sample_k"].double()  # [L, N, H, D]
    P = k.shape[-1] // 2
    a, b = k[..., :P], k[..., P:]
    e2 = (a * a + b * b).mean(1)  # [L, H, P]
    m2 = a.mean(1) ** 2 + b.mean(1) ** 2
    share = e2 / e2.sum(-1, keepdim=True)
    out, q = [], max(1, P // 4)
    for lo in range(0, P, q):
        sl = slice(lo, min(P, lo + q))
        out.append((lo, sl.stop - 1, float(share[..., sl].sum(-1).mean()), float(m2[..., sl].sum() / e2[..., sl].sum())))
    return out


def with_pairs_from(book, other, pairs: list[int]):
    """book with the pair transforms (angles and shrinks) of `pairs` taken from other."""
    out = copy.deepcopy(book)
    idx = torch.tensor(pairs)
    P = book.tensors["fold_k_rot"].shape[-1]
    out.tensors["fold_k_rot"][:, :, idx] = other.tensors["fold_k_rot"][:, :, idx]
    for off in (0, P):
        out.tensors["fold_k"][:, :, idx + off] = other.tensors["fold_k"][:, :, idx + off]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    ap.add_argument("--calib", default="default")
    ap.add_argument("--eval", default="default", help="eval preset whose held-out windows part 2 scores")
    ap.add_argument("--pair-context", type=int, default=8192, help="the kv.pair_context compared with the default (> 0)")
    a = ap.parse_args()
    if a.pair_context <= 0:
        ap.error(f"--pair-context {a.pair_context}: allowed: a context > 0")
    mcfg, calib, ev = model_config(a.model, a.model_path), calib_config(a.calib), eval_config(a.eval)  # bad names fail before the model loads
    from compare_peers import kvcompress_checkpoint

    from kvcompress.targets.recheck import baseline, remeasure_trtllm

    lm = load_model(mcfg, cache_dir())
    stats = profile(lm, calib, load_texts(calib), progress=False)
    print(f"key energy by RoPE pair quarter (calibration sample, {stats['sample_k'].shape[1]} keys per layer and head; pair 0 turns fastest)")
    print(f"{'pairs':<10} {'share of key energy':>20} {'mean-energy fraction':>21}")
    for lo, hi, share, frac in pair_energy(stats):
        print(f"{lo:>3}-{hi:<6} {share:20.3f} {frac:21.3f}")
    base, far = fit(stats, native_spec("native_fp8")), fit(stats, native_spec("native_fp8").model_copy(update={"pair_context": a.pair_context}))
    books = {"default (pair_context=0)": base, "no pair fold": fit(stats, native_spec("native_fp8").model_copy(update={"fold_pairs": False})),
             f"pair_context={a.pair_context}": far}
    P = lm.geometry.head_dim // 2
    q = max(1, P // 4)
    for lo in range(0, P, q):
        books[f"default, pairs {lo}-{min(P, lo + q) - 1} as {a.pair_context}"] = with_pairs_from(base, far, list(range(lo, min(P, lo + q))))
    windows = token_windows(lm.tokenizer, load_texts(ev), ev.n_windows, ev.seq_len, seed=ev.seed)
    ref = baseline(lm, windows, 1)
    print(f"native_fp8 TensorRT-LLM checkpoints read back, {windows.shape[0]} x {windows.shape[1]} held-out tokens (eval={a.eval})")
    print(f"{'checkpoint':<36} {'ppl delta':>10} {'KL mean':>9} {'KL / default':>13}")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, book) in enumerate(books.items()):
            rows[name] = remeasure_trtllm(kvcompress_checkpoint(lm, book, Path(tmp) / f"ck{i}"), ref)
            r = rows[name]
            print(f"{name:<36} {100 * r['ppl_delta_rel']:+9.3f}% {r['kl_mean']:9.2e} {r['kl_mean'] / rows['default (pair_context=0)']['kl_mean']:12.2f}x", flush=True)


if __name__ == "__main__":
    run(main)
