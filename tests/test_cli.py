"""`python -m kvcompress`: end-to-end on a tiny model, bad input, caching, fit without the model."""
import json

import pytest

from conftest import run_cli

TINY = ["model=tiny_llama", "calib=smoke", "eval=smoke"]

BAD = [
    (["kv.key.bits=3"], "kv.key.bits=3"),
    (["kv=int3"], "kv=int3"),
    (["kv.window=-1"], "kv.window=-1"),
    (["model=llama70b"], "model.path is required"),
    (["model=llama70b", "model.path=/does/not/exist"], "/does/not/exist"),
    (["calib=files", "calib.paths=[EMPTY]"], "has no text"),
    (["calib=files"], "calib.paths is empty"),
    (["kv.foo=1"], "kv.foo is not a known key"),
    (["stages=[fit]", "stats=/nope.safetensors"], "stats='/nope.safetensors'"),
    (["calib=files", "calib.paths=[data.csv]"], "allowed: .txt, .jsonl"),
]


@pytest.mark.parametrize("args,needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_one_line_nonzero_no_artifacts(tmp_path, args, needle):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    args = [a.replace("EMPTY", str(empty)) for a in args]
    run_dir = tmp_path / "run"
    p = run_cli(*TINY[:1], *args, f"hydra.run.dir={run_dir}", cache_dir=tmp_path / "cache")
    assert p.returncode != 0
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("kvcompress: error:") and needle in lines[0]
    assert "Traceback" not in p.stderr + p.stdout
    assert not run_dir.exists() or not any(run_dir.glob("*.safetensors"))


def test_tiny_end_to_end_then_cached_then_fit_without_model(tmp_path):
    cache = tmp_path / "cache"
    run1 = tmp_path / "r1"
    p = run_cli(*TINY, "kv=int8k_int4v", "stages=[profile,fit]", f"hydra.run.dir={run1}", cache_dir=cache, timeout=60)
    assert p.returncode == 0, p.stderr
    for f in ("kv_stats.safetensors", "scalebook.safetensors", "config.json", "provenance.json", ".hydra/config.yaml"):
        assert (run1 / f).is_file(), f
    cfg = json.loads((run1 / "config.json").read_text())
    assert cfg["kv"]["key"]["bits"] == 8 and cfg["kv"]["value"]["bits"] == 4 and cfg["kv"]["window"] == 128
    prov = json.loads((run1 / "provenance.json").read_text())
    assert prov["versions"]["torch"] and "git_sha" in prov
    assert "reusing cached" not in p.stderr + p.stdout

    run2 = tmp_path / "r2"
    p = run_cli(*TINY, "stages=[profile,fit]", f"hydra.run.dir={run2}", cache_dir=cache, timeout=60)
    assert p.returncode == 0 and "reusing cached kv_stats" in p.stderr + p.stdout
    assert (run2 / "kv_stats.safetensors").read_bytes() == (run1 / "kv_stats.safetensors").read_bytes()

    run3 = tmp_path / "r3"
    stats = run1 / "kv_stats.safetensors"
    # model=llama70b without a path: proves fit never touches the model
    p = run_cli("model=llama70b", "stages=[fit]", "kv=int4", f"stats={stats}", f"hydra.run.dir={run3}", cache_dir=cache)
    assert p.returncode == 0, p.stderr
    from kvcompress.scalebook import ScaleBook

    book = ScaleBook.load(run3 / "scalebook.safetensors")
    assert book.spec.name == "int4" and book.spec.key.bits == 4 and book.spec.outlier_channels == 2


def report(run_dir):
    return json.loads((run_dir / "report.json").read_text())


def test_validate_report_fields_and_sanity_on_the_path(tmp_path):
    cache = tmp_path / "cache"
    runs = {}
    for name, extra in {"fp16": ["kv=fp16"], "full_window": ["kv.window=100000"], "w0": ["kv.window=0"], "w128": ["kv.window=128"]}.items():
        runs[name] = tmp_path / name
        p = run_cli(*TINY, *extra, f"hydra.run.dir={runs[name]}", cache_dir=cache, timeout=120)
        assert p.returncode == 0, p.stderr
    r = report(runs["w128"])
    for key in ("ppl_baseline", "ppl_compressed", "ppl_delta_rel", "kl_mean", "top1_agree"):
        assert key in r["quality"]
    for key in ("bytes_per_token_fp16", "bytes_per_token_compressed", "compression_ratio", "breakdown_per_token"):
        assert key in r["memory"]
    assert r["memory"]["compression_ratio"] > 2.0
    fp16 = report(runs["fp16"])["quality"]
    assert fp16["ppl_delta"] == 0.0 and fp16["kl_mean"] == 0.0 and fp16["top1_agree"] == 1.0
    full = report(runs["full_window"])["quality"]
    w0 = report(runs["w0"])["quality"]
    w128 = r["quality"]
    # a window longer than the text: only the fp16 rounding of K/V remains (~0)
    assert abs(full["ppl_delta_rel"]) < 1e-4 and full["kl_mean"] < 0.5 * w128["kl_mean"]
    assert w0["kl_mean"] > 3 * w128["kl_mean"] > 0
    planner = r["planner"]["llama70b"]["rows"]
    row32k = next(x for x in planner if x["context"] == 32768)
    assert row32k["capacity_multiplier"] > 2.0


@pytest.mark.slow
def test_embedded_smollm2_end_to_end(tmp_path):
    """The real embedded model through profile, fit and validate (small calibration and eval sets)."""
    run = tmp_path / "run"
    p = run_cli("calib=smoke", "eval=smoke", f"hydra.run.dir={run}", timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    r = report(run)
    assert r["model"]["name"] == "smollm2_135m" and r["model"]["geometry"]["n_layers"] == 30
    assert r["model"]["geometry"]["n_kv_heads"] == 3 and r["model"]["geometry"]["head_dim"] == 64
    q = r["quality"]
    assert 1.0 < q["ppl_baseline"] < 100 and abs(q["ppl_delta_rel"]) < 0.05 and q["top1_agree"] > 0.9
    assert (run / "report.html").is_file() and (run / "scalebook.safetensors").is_file()
    assert r["provenance"]["scalebook"]["stats"]["model"]["sha256"]
