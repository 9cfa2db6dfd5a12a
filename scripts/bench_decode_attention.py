"""Decode attention over the compressed cache vs fp16 attention over an fp16 cache, in one run.

    python scripts/bench_decode_attention.py [--out bench_decode.json]     # on a GPU host (< 5 min)
    TRITON_INTERPRET=1 python scripts/bench_decode_attention.py --smoke    # CPU: tiny shapes, logic only

1. Correctness on the device: the Triton kernels against the reference (mixed lengths, GQA 8,
   head dim 128, int8 keys / int4 values, sinks and window) -- append bit-exact, decode within
   the test tolerance.
2. Speed at Llama-70B shapes (8 kv heads, head dim 128, GQA 8), contexts 4K/16K/32K/128K,
   batch 1/8/32: the kvcompress decode kernel (split-K + reduce) vs torch SDPA over an fp16
   cache. Bandwidth is computed on the bytes each side actually reads (reference byte
   accounting for the compressed cache: payload, metadata, sinks and window).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcompress import reference as ref  # noqa: E402
from kvcompress.kernels import ops  # noqa: E402
from kvcompress.kernels.layout import PackedKV  # noqa: E402
from kvcompress.reference import KeyParams  # noqa: E402

H200_PEAK_BPS = 4.8e12
H, G, D = 8, 8, 128  # Llama-70B per layer
SPEC = dict(key_bits=8, value_bits=4, group=32, n_sink=4, window=128, n_out=0)


def key_params(device) -> KeyParams:
    return KeyParams(8, torch.full((H, D), 0.05, device=device), torch.zeros(H, D, device=device), torch.zeros(H, 0, dtype=torch.long, device=device))


def check_correctness(device: str) -> dict:
    """Kernels vs reference on the device (the same checks as tests/test_kernels.py)."""
    g = torch.Generator().manual_seed(0)
    lens = [1, 127, 128, 129, 1170, 4099]
    ks = [torch.randn(H, n, D, generator=g) for n in lens]
    vs = [torch.randn(H, n, D, generator=g) for n in lens]
    p = KeyParams(8, torch.stack([k.abs().amax(1) for k in ks]).amax(0) / 127, torch.zeros(H, D), torch.zeros(H, 0, dtype=torch.long))
    kv = PackedKV.from_reference(ks, vs, p, n_sink=4, window=128, value_bits=4, group=32)
    kv = PackedKV(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kv.__dict__.items()})
    pd = KeyParams(8, p.scale.to(device), p.zero.to(device), p.outlier_idx.to(device))
    q = torch.randn(len(lens), H * G, D, generator=g).to(device)
    out = ops.decode_attention(q, kv, pd, D**-0.5, splits=8, block_t=32)
    err = float((out - ops.decode_attention_reference(q, kv, pd, D**-0.5)).abs().max())
    # append: a fresh cache filled token by token must equal the reference bytes
    T = 300
    kk = torch.randn(2, H, T, D, generator=g)
    vv = torch.randn(2, H, T, D, generator=g)
    app = PackedKV.empty(2, H, D, T, n_sink=4, window=128, n_out=0, key_bits=8, value_bits=4, group=32, device=device)
    for t in range(T):
        ops.append(app, kk[:, :, t].to(device), vv[:, :, t].to(device), pd)
    expect = PackedKV.from_reference(list(kk), list(vv), p, n_sink=4, window=128, value_bits=4, group=32, cap=T)
    exact = all(torch.equal(getattr(app, n).cpu(), getattr(expect, n)) for n in ("k_payload", "v_payload", "v_scale", "v_min", "win_k", "sink_k"))
    return {"decode_max_abs_err": err, "decode_tol": 3e-3, "decode_ok": err <= 3e-3, "append_bit_exact": exact}


def random_cache(B: int, T: int, device: str) -> PackedKV:
    """A full compressed cache of T tokens per sequence with random codes (speed only)."""
    kv = PackedKV.empty(B, H, D, T, n_sink=SPEC["n_sink"], window=SPEC["window"], n_out=0, key_bits=8, value_bits=4, group=32, device=device)
    kv.k_payload.copy_(torch.randint(-127, 128, kv.k_payload.shape, dtype=torch.int8, device=device))
    kv.v_payload.copy_(torch.randint(0, 256, kv.v_payload.shape, dtype=torch.uint8, device=device))
    kv.v_scale.fill_(0.01)
    kv.v_min.fill_(-0.08)
    for t in (kv.sink_k, kv.sink_v, kv.win_k, kv.win_v):
        t.normal_()
    kv.lens.fill_(T)
    return kv


def bytes_read_compressed(B: int, T: int) -> int:
    b = ref.cache_nbytes(n_layers=1, n_kv_heads=H, head_dim=D, key_bits=8, value_bits=4, value_group=32, outlier_channels=0, sink_tokens=SPEC["n_sink"], window=SPEC["window"], n_tokens=T, batch=B)
    return sum(v for k, v in b.items() if k != "static") + b["static"] + B * H * G * D * 2


def splits_for(B: int, T: int) -> int:
    """Enough programs to fill ~2 waves of 132 SMs, with >= 512 tokens per split."""
    return max(1, min(64, math.ceil(264 / (B * H)), max(1, T // 512)))


def timeit(fn, device: str, reps: int) -> float:
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=5, rep=reps) * 1e-3
    fn()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench(device: str, contexts: list[int], batches: list[int], reps: int) -> list[dict]:
    rows = []
    p = key_params(device)
    for T in contexts:
        for B in batches:
            kv = random_cache(B, T, device)
            q = torch.randn(B, H * G, D, device=device, dtype=torch.float16)
            splits = splits_for(B, T)
            prep = ops.kernel_key_params(p, device)
            t_kvc = timeit(lambda: ops.decode_attention(q, kv, p, D**-0.5, splits=splits, block_t=32, prepared=prep), device, reps)
            del kv
            kf = torch.randn(B, H, T, D, device=device, dtype=torch.float16)
            vf = torch.randn(B, H, T, D, device=device, dtype=torch.float16)
            q4 = q.unsqueeze(2)  # [B, HQ, 1, D]
            t_fp16 = timeit(lambda: torch.nn.functional.scaled_dot_product_attention(q4, kf, vf, enable_gqa=True), device, reps)
            del kf, vf
            b_kvc, b_fp16 = bytes_read_compressed(B, T), 2 * B * H * T * D * 2 + B * H * G * D * 2
            rows.append(
                {
                    "context": T, "batch": B, "splits": splits,
                    "kvc_s": t_kvc, "fp16_s": t_fp16, "speedup": t_fp16 / t_kvc,
                    "kvc_bytes": b_kvc, "fp16_bytes": b_fp16,
                    "kvc_TBps": b_kvc / t_kvc / 1e12, "fp16_TBps": b_fp16 / t_fp16 / 1e12,
                    "kvc_pct_peak": 100 * b_kvc / t_kvc / H200_PEAK_BPS, "fp16_pct_peak": 100 * b_fp16 / t_fp16 / H200_PEAK_BPS,
                }
            )
            print(f"T={T:>6} B={B:>2} splits={splits:>2} | kvc {t_kvc * 1e6:9.1f} us {rows[-1]['kvc_TBps']:5.2f} TB/s ({rows[-1]['kvc_pct_peak']:4.1f}%) | "
                  f"fp16 {t_fp16 * 1e6:9.1f} us {rows[-1]['fp16_TBps']:5.2f} TB/s ({rows[-1]['fp16_pct_peak']:4.1f}%) | speed-up {rows[-1]['speedup']:4.2f}x", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_decode.json")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU under TRITON_INTERPRET=1 (logic only, times meaningless)")
    ap.add_argument("--reps", type=int, default=50, help="do_bench rep time in ms per measurement")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not a.smoke:
        print("kvcompress: error: no CUDA device; run on a GPU host, or pass --smoke (with TRITON_INTERPRET=1) to check the logic on CPU", file=sys.stderr)
        return 2
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("kvcompress: error: --smoke on CPU needs TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    t0 = time.time()
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
    if a.smoke:
        global H, G
        H, G = 2, 8
        result["correctness"] = {"skipped": "smoke mode (tests/test_kernels.py covers correctness on CPU)"}
        result["rows"] = bench(device, [300], [1, 2], a.reps)
    else:
        result["correctness"] = check_correctness(device)
        print("correctness:", result["correctness"], flush=True)
        result["rows"] = bench(device, [4096, 16384, 32768, 131072], [1, 8, 32], a.reps)
    result["wall_s"] = time.time() - t0
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {a.out} in {result['wall_s']:.0f} s")
    ok = a.smoke or (result["correctness"]["decode_ok"] and result["correctness"]["append_bit_exact"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
