"""Serve-path check of export/hf_ckpt/ on a GPU host with vLLM: does the served checkpoint give validate's numbers?

    python export/check_hf_ckpt.py [--ckpt export/hf_ckpt] [--check export/hf_ckpt_check] [--rtol 0.02] [--atol 0.005]

The export writes, beside hf_ckpt/, the held-out token windows validate measured (hf_ckpt_check/windows.safetensors) and
what it measured on them (hf_ckpt_check/expected.json: the unquantized float32 perplexity and the perplexity with the
checkpoint's FP8 KV cache, simulated). This script runs those windows through vLLM twice, each in its own process: the
KV cache unquantized (--kv-cache-dtype auto) and FP8 with the stored k_scale/v_scale (fp8), and reads the
log-probability of every prompt token (prompt_logprobs=0; vLLM V1's FlashAttention backend reads the prompt's keys and
values from its paged cache, so prompt tokens see the quantized cache too, as read in its source; a backend that attended
to them unquantized would understate the FP8 change). It compares
  - the served unquantized perplexity with validate's float32 one: |ratio - 1| <= rtol (the server computes in bfloat16);
  - the served FP8 perplexity change (fp8 / auto - 1) with the validated change: |difference| <= atol.
Exit 0 when both hold, 1 when one does not, 2 when vLLM (or a file) is missing. Both tolerances are starting points,
not measured on a GPU. Not run where kvcompress is developed (no GPU, no vLLM); its logic is tested there against a
stand-in `vllm` module that scores with transformers and kvcompress's own FP8 simulation.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path


def perplexity(rows: list[list[int]], logprobs: list[list[float]]) -> float:
    """exp(mean negative log-probability) of every token after the first of each window (validate's positions)."""
    n, total = 0, 0.0
    for ids, lps in zip(rows, logprobs):
        if len(lps) != len(ids) - 1:
            raise ValueError(f"{len(lps)} log-probabilities for a window of {len(ids)} tokens (expected {len(ids) - 1})")
        total -= sum(lps)
        n += len(lps)
    return math.exp(total / n)


def vllm_logprobs(ckpt: Path, kv_cache_dtype: str, rows: list[list[int]]) -> list[list[float]]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(ckpt), kv_cache_dtype=kv_cache_dtype, max_model_len=max(len(r) for r in rows) + 1, enforce_eager=True,
              enable_prefix_caching=False)
    outs = llm.generate([{"prompt_token_ids": r} for r in rows], SamplingParams(max_tokens=1, prompt_logprobs=0))
    return [[pos[tok].logprob for tok, pos in zip(r[1:], o.prompt_logprobs[1:])] for r, o in zip(rows, outs)]


def read_windows(check: Path) -> list[list[int]]:
    from safetensors.torch import load_file

    return load_file(str(check / "windows.safetensors"))["ids"].tolist()


def compare(expected: dict, ppl_auto: float, ppl_fp8: float, rtol: float, atol: float) -> dict:
    served_delta = ppl_fp8 / ppl_auto - 1
    base_ratio = ppl_auto / expected["ppl_baseline"]
    return {"ppl_auto": ppl_auto, "ppl_fp8": ppl_fp8, "validated_ppl_baseline": expected["ppl_baseline"], "baseline_ratio": base_ratio,
            "served_delta": served_delta, "validated_delta": expected["ppl_delta_rel"],
            "baseline_ok": abs(base_ratio - 1) <= rtol, "delta_ok": abs(served_delta - expected["ppl_delta_rel"]) <= atol}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", type=Path, default=Path(__file__).resolve().parent / "hf_ckpt")
    ap.add_argument("--check", type=Path, default=Path(__file__).resolve().parent / "hf_ckpt_check")
    ap.add_argument("--rtol", type=float, default=0.02, help="served unquantized perplexity vs validate's float32 one")
    ap.add_argument("--atol", type=float, default=0.005, help="served FP8 perplexity change vs the validated change")
    ap.add_argument("--kv", choices=["auto", "fp8"], help=argparse.SUPPRESS)  # one vLLM instance per process (internal)
    a = ap.parse_args(argv)
    if not (a.rtol >= 0 and a.atol >= 0):
        print(f"check_hf_ckpt: --rtol {a.rtol} / --atol {a.atol}: tolerances must be numbers >= 0", file=sys.stderr)
        return 2
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("check_hf_ckpt: needs vLLM (pip install vllm) on a GPU host", file=sys.stderr)
        return 2
    for p in (a.ckpt / "config.json", a.check / "windows.safetensors", a.check / "expected.json"):
        if not p.is_file():
            print(f"check_hf_ckpt: {p} does not exist (point --ckpt / --check at an export's hf_ckpt/ and hf_ckpt_check/)", file=sys.stderr)
            return 2
    rows = read_windows(a.check)
    if a.kv:
        print(json.dumps({"ppl": perplexity(rows, vllm_logprobs(a.ckpt, a.kv, rows))}))
        return 0
    ppl = {}
    for kv in ("auto", "fp8"):
        p = subprocess.run([sys.executable, __file__, "--ckpt", str(a.ckpt), "--check", str(a.check), "--kv", kv], capture_output=True, text=True)
        if p.returncode != 0:
            print(f"check_hf_ckpt: vLLM with --kv-cache-dtype {kv} failed:\n{p.stderr[-3000:]}", file=sys.stderr)
            return 1
        ppl[kv] = json.loads(p.stdout.strip().splitlines()[-1])["ppl"]
    r = compare(json.loads((a.check / "expected.json").read_text()), ppl["auto"], ppl["fp8"], a.rtol, a.atol)
    print(f"served perplexity, KV unquantized: {r['ppl_auto']:.4f} (validate's float32: {r['validated_ppl_baseline']:.4f}, "
          f"ratio {r['baseline_ratio']:.4f}, tolerance {a.rtol}) {'PASS' if r['baseline_ok'] else 'FAIL'}")
    print(f"served FP8 KV: {r['ppl_fp8']:.4f}, change {100 * r['served_delta']:+.3f}% (validated {100 * r['validated_delta']:+.3f}%, "
          f"tolerance {100 * a.atol:.2f} points) {'PASS' if r['delta_ok'] else 'FAIL'}")
    return 0 if r["baseline_ok"] and r["delta_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
