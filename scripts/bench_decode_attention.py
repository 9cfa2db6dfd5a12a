"""Decode attention over the compressed cache vs fp16 attention over an fp16 cache, in one run.

    python scripts/bench_decode_attention.py [--out bench_decode.json]     # on a GPU host (< 5 min)
    TRITON_INTERPRET=1 python scripts/bench_decode_attention.py --smoke    # CPU: tiny shapes, logic only

1. Correctness on the device: the Triton kernels against the reference (mixed lengths, GQA 8,
   head dim 128, int8 keys / int4 values, sinks and window) -- append bit-exact, decode within
   the test tolerance.
2. Speed: the rows of `scripts/predict_decode.py` (Llama-3.1-70B and -8B shapes, batch 1, 4K/32K/128K
   context, each custom-tier format with a compiled head-dim-128 variant), measured: one layer's
   kvcompress decode attention (split + reduce kernels, the plan's tiles and split count) vs torch
   SDPA over an fp16 cache, times the layer count; same columns, so the prediction and the
   measurement compare line by line.
3. The launch's fill, side by side: the shipped split count fills plan.CTAS_PER_SM (2) CTAs per SM for every
   family, while the per-token and grouped kernels could hold 3 or 4 (the SASS audit). Each row is timed again
   with the split count that fills the compiled split kernel's own residency on this device (its registers, warps
   and shared memory against the device's per-SM limits): columns resident_ctas, splits_at_residency,
   kvc_us_at_residency and their ratio fill_gain (plan fill time / residency fill time; > 1: filling helps).
   Whether plan.CTAS_PER_SM should follow the residency is decided from these columns, on a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcompress.kernels import ops, plan  # noqa: E402
from kvcompress import reference as ref  # noqa: E402
from kvcompress.kernels.bytes_model import CONTEXTS, FORMATS, MODELS, ROW_COLUMNS  # noqa: E402
from kvcompress.kernels.layout import PackedKV  # noqa: E402
from kvcompress.reference import KeyParams  # noqa: E402

H, G, D = 8, 8, 128  # Llama-70B per layer (correctness check)


def _layout(name: str, fmt) -> dict:
    """PackedKV keywords of a format; the grouped family's (wf4, wf3) key widths are a water-filled table at the format's
    mean, as kv.key.alloc=waterfill fits one."""
    lay = dict(n_sink=fmt.n_sink, window=fmt.window, value_bits=fmt.value_bits, group=fmt.group, **fmt.family())
    if fmt.key_group_tokens:
        w = torch.rand(H, D, generator=torch.Generator().manual_seed(1)) ** 8 * 1e4
        lay.update(key_bits_table=ref.waterfill_bits(w, fmt.key_bits))
    return lay


CHECKED = ("int8k_int4v", "rot4", "rot8k_int4v", "wf4", "wf3")
CHECK_LENS = (1, 127, 128, 129, 1170, 4099)


def check_correctness(device: str, names: tuple[str, ...] = CHECKED, lens: tuple[int, ...] = CHECK_LENS, T: int = 300) -> dict:
    """Kernels vs reference on the device (the same checks as tests/test_kernels.py), for the
    static-scale family (int8k_int4v), the per-token family (rot4, rot8k_int4v) and the grouped family (wf4; wf3's 3-bit planes).
    lens: the decode's sequence lengths; T: tokens appended one by one (tests run it on CPU under the interpreter, shorter)."""
    out = {}
    for name in names:
        fmt = FORMATS[name]
        g = torch.Generator().manual_seed(0)
        lens = list(lens)
        ks = [torch.randn(H, n, D, generator=g) for n in lens]
        vs = [torch.randn(H, n, D, generator=g) for n in lens]
        scale = torch.stack([k.abs().amax(1) for k in ks]).amax(0) / 127
        p = KeyParams(fmt.key_bits, scale, torch.zeros(H, D), torch.zeros(H, 0, dtype=torch.long))
        lay = _layout(name, fmt)
        kv = PackedKV.from_reference(ks, vs, p, **lay)
        kv = PackedKV(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kv.__dict__.items()})
        pd = KeyParams(fmt.key_bits, p.scale.to(device), p.zero.to(device), p.outlier_idx.to(device))
        q = torch.randn(len(lens), H * G, D, generator=g).to(device)
        o = ops.decode_attention(q, kv, pd, D**-0.5)  # the plan's tiles and split count
        err = float((o - ops.decode_attention_reference(q, kv, pd, D**-0.5)).abs().max())
        # append: a fresh cache filled token by token must equal the reference bytes
        kk = torch.randn(2, H, T, D, generator=g)
        vv = torch.randn(2, H, T, D, generator=g)
        app = PackedKV.empty(2, H, D, T, n_out=0, key_bits=fmt.key_bits, device=device, **lay)
        for t in range(T):
            ops.append(app, kk[:, :, t].to(device), vv[:, :, t].to(device), pd)
        expect = PackedKV.from_reference(list(kk), list(vv), p, cap=T, **lay)
        names = ("k_payload", "k_scale", "k_gscale", "k_gmin", "v_payload", "v_scale", "v_min", "win_k", "sink_k")
        exact = all(torch.equal(getattr(app, n).cpu(), getattr(expect, n)) for n in names)
        out[name] = {"decode_max_abs_err": err, "decode_tol": 3e-3, "decode_ok": err <= 3e-3, "append_bit_exact": exact}
    return out


def random_cache(B: int, T: int, fmt, h: int, d: int, device: str) -> PackedKV:
    """A full compressed cache of T tokens per sequence with random codes (speed only)."""
    kv = PackedKV.empty(B, h, d, T, n_sink=fmt.n_sink, window=fmt.window, n_out=fmt.n_out, key_bits=fmt.key_bits, value_bits=fmt.value_bits,
                        group=fmt.group, device=device, **fmt.family())
    kv.k_scale.fill_(0.01)
    kv.k_gscale.fill_(0.01)
    kv.k_payload.copy_(torch.randint(-127, 128, kv.k_payload.shape, dtype=torch.int8, device=device).to(kv.k_payload.dtype))
    kv.v_payload.copy_(torch.randint(0, 256, kv.v_payload.shape, dtype=torch.uint8, device=device))
    kv.v_scale.fill_(0.01)
    kv.v_min.fill_(-0.08 if kv.v_min.is_floating_point() else 8)  # a coded min (kv.value.min=code): -8 * 0.01 / 16
    for t in (kv.sink_k, kv.sink_v, kv.win_k, kv.win_v, kv.k_outliers):
        t.normal_()
    kv.lens.fill_(T)
    return kv


def timeit(fn, device: str, reps: int) -> float:
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=5, rep=reps) * 1e-3
    fn()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


SMOKE_RESIDENCY = 3  # --smoke: the interpreter compiles nothing, so the residency columns use this stand-in (logic only)
FILL_COLUMNS = ("resident_ctas", "splits_at_residency", "kvc_us_at_residency", "fill_gain")


def device_limits() -> dict:
    """The current GPU's per-SM limits in audit.ARCH_LIMITS' form: the published sm_80 / sm_90 table, overridden by
    what the device reports (registers, threads and shared memory per SM) where torch exposes it."""
    from kvcompress.kernels.audit import ARCH_LIMITS

    props = torch.cuda.get_device_properties(0)
    lim = dict(ARCH_LIMITS["sm_90" if props.major >= 9 else "sm_80"])
    for key, attr, f in (("regs_per_sm", "regs_per_multiprocessor", 1), ("max_warps_per_sm", "max_threads_per_multi_processor", 1 / 32),
                         ("smem_per_sm", "shared_memory_per_multiprocessor", 1)):
        if getattr(props, attr, 0):
            lim[key] = int(getattr(props, attr) * f)
    return lim


def resident_ctas(handle, limits: dict | None) -> int:
    """CTAs of the launched split kernel one SM holds (audit.occupancy of its registers, warps and shared memory);
    SMOKE_RESIDENCY when nothing was compiled (the interpreter's launches return no kernel)."""
    if handle is None or limits is None:
        return SMOKE_RESIDENCY
    from kvcompress.kernels.audit import occupancy

    return occupancy(int(handle.n_regs), 32 * int(handle.metadata.num_warps), int(handle.metadata.shared), limits)["ctas_per_sm"]


def bench(device: str, models: dict, contexts, reps: int) -> list[dict]:
    """The rows of scripts/predict_decode.py, measured: one layer's decode attention at batch 1
    (kvcompress split + reduce kernels vs torch SDPA over an fp16 cache), times the layer count; each
    row again with the split count filling the compiled kernel's residency (FILL_COLUMNS, docstring step 3)."""
    rows = []
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    limits = device_limits() if device == "cuda" else None
    for model, (layers, hq, h, d) in models.items():
        for T in contexts:
            q = torch.randn(1, hq, d, device=device, dtype=torch.float16)
            kf = torch.randn(1, h, T, d, device=device, dtype=torch.float16)
            vf = torch.randn(1, h, T, d, device=device, dtype=torch.float16)
            t_fp16 = timeit(lambda q=q, kf=kf, vf=vf: torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), kf, vf, enable_gqa=True), device, reps)
            kf = vf = None  # free before the compressed caches are built
            for name, fmt in FORMATS.items():
                kv = random_cache(1, T, fmt, h, d, device)
                p = KeyParams(fmt.key_bits, torch.full((h, d), 0.05, device=device), torch.zeros(h, d, device=device),
                              torch.arange(fmt.n_out, device=device).repeat(h, 1))
                prep = ops.kernel_key_params(p, device)
                block = fmt.block_t(d)
                sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 132
                n_comp = max(0, T - fmt.n_sink - fmt.window)
                splits = plan.choose_splits(1, h, n_comp, hq // h, d, fmt.token_bytes(d), block, sms)

                def run(splits, launched=None, q=q, d=d, kv=kv, p=p, prep=prep):
                    return ops.decode_attention(q, kv, p, d**-0.5, splits=splits, prepared=prep, launched=launched)

                t_kvc = timeit(lambda s=splits: run(s), device, reps)
                launched = []
                run(splits, launched)
                res = resident_ctas(launched[0], limits)
                res_splits = plan.choose_splits(1, h, n_comp, hq // h, d, fmt.token_bytes(d), block, sms, ctas_per_sm=res)
                t_res = timeit(lambda s=res_splits: run(s), device, reps) if res_splits != splits else t_kvc
                kv = None
                rows.append({"model": model, "gpu": gpu, "context": T, "batch": 1, "format": name, "splits": splits,
                             "kvc_us": layers * t_kvc * 1e6, "fp16_us": layers * t_fp16 * 1e6, "speedup": t_fp16 / t_kvc,
                             "resident_ctas": res, "splits_at_residency": res_splits, "kvc_us_at_residency": layers * t_res * 1e6,
                             "fill_gain": t_kvc / t_res})
                print(" ".join(f"{rows[-1][c]:>12.2f}" if isinstance(rows[-1][c], float) else f"{rows[-1][c]:>12}" for c in ROW_COLUMNS + FILL_COLUMNS), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_decode.json")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU under TRITON_INTERPRET=1 (logic only, times meaningless)")
    ap.add_argument("--reps", type=int, default=50, help="do_bench rep time in ms per measurement")
    a = ap.parse_args()
    if a.reps < 1:
        print(f"kvcompress: error: --reps {a.reps}: allowed: an integer >= 1 (milliseconds of timing per measurement)", file=sys.stderr)
        return 2
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
        result["correctness"] = {"skipped": "smoke mode (tests/test_kernels.py covers correctness on CPU)"}
        print("MEASURED (smoke: tiny shapes on the CPU interpreter; times meaningless)")
        print(" ".join(f"{c:>12}" for c in ROW_COLUMNS + FILL_COLUMNS))
        result["rows"] = bench(device, {"tiny": (2, 16, 2, 128)}, [300], a.reps)
    else:
        result["correctness"] = check_correctness(device)
        print("correctness:", result["correctness"], flush=True)
        print("MEASURED on", result["device"], "(the rows of scripts/predict_decode.py: one layer timed, times the layer count; batch 1)")
        print(" ".join(f"{c:>12}" for c in ROW_COLUMNS + FILL_COLUMNS))
        result["rows"] = bench(device, MODELS, CONTEXTS, a.reps)
    result["wall_s"] = time.time() - t0
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {a.out} in {result['wall_s']:.0f} s")
    ok = a.smoke or all(c["decode_ok"] and c["append_bit_exact"] for c in result["correctness"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
