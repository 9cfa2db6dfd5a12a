"""kv=auto: per-layer formats (spec, fit, cache, bytes, one-pass), the sensitivity pass, the search."""
import json

import pytest
import torch

from conftest import SMOKE_CALIB, float64_model, run_cli, tiny_lm
from kvcompress import reference as ref
from kvcompress.cache import CompressedCache
from kvcompress.config import Gate, TuneConfig, EvalConfig, to_run_config
from kvcompress.data import load_texts, token_windows
from kvcompress.errors import UserError
from kvcompress.models.base import Geometry
from kvcompress.eval.attention import compressed_attention
from kvcompress.eval.sensitivity import layer_sensitivity
from kvcompress.scalebook import ScaleBook
from kvcompress.spec import KVSpec, LayerFormat, mixed_spec
from kvcompress.stages.fit import fit, uniform_spec
from kvcompress.stages.profile import profile
from kvcompress.stages.tune import budget_contexts, fill_budget, hull, tune
from kvcompress.stages.validate import evaluate_quality

K8 = LayerFormat(key_bits=8, value_bits=4, value_group=16)
K4 = LayerFormat(key_bits=4, value_bits=4, value_group=32, outlier_channels=2)
FP16 = LayerFormat(key_bits=16, value_bits=16)
BASE = KVSpec(name="t", window=8, sink_tokens=2)
# the per-token family (kv=rot8k_int4v's scheme at a test's sizes) and its split of 12 bits per element
ROT = KVSpec(name="r", window=8, sink_tokens=2, key={"bits": 8, "granularity": "token", "rotate": "hadamard", "clip": "minmax"},
             value={"bits": 4, "group_size": 16, "rotate": "hadamard", "min": "code"})
K7V5, K6V6 = LayerFormat(key_bits=7, value_bits=5, value_group=16), LayerFormat(key_bits=6, value_bits=6, value_group=16)


@pytest.fixture(scope="module")
def lm3():
    return tiny_lm("llama", layers=3, seed=3)


@pytest.fixture(scope="module")
def stats3(lm3):
    return profile(lm3, SMOKE_CALIB, load_texts(SMOKE_CALIB), progress=False)


def test_layer_format_and_mixed_spec_validate_and_round_trip():
    with pytest.raises(ValueError, match="fp16"):
        LayerFormat(key_bits=16, value_bits=4)
    s = mixed_spec(BASE, [K4, FP16, K8])
    assert s.is_mixed and not s.is_baseline and s.layer(0).key.bits == 4 and s.layer(0).outlier_channels == 2
    assert s.layer(1).is_baseline and s.layer(2).value.group_size == 16
    assert KVSpec.model_validate(json.loads(json.dumps(s.model_dump()))) == s
    assert mixed_spec(BASE, [FP16, FP16]).is_baseline
    with pytest.raises(ValueError, match="kv.layers"):
        KVSpec(name="n", format="native_int8", window=0, sink_tokens=0, layers=(K8,))
    with pytest.raises(UserError, match="3 formats but the model has 2"):
        s.layer_formats(2)


def test_mixed_fit_takes_each_layer_from_its_own_format_and_loads_back(stats3, tmp_path):
    s = mixed_spec(BASE, [K4, FP16, K8])
    book = fit(stats3, s)
    b4, b8 = fit(stats3, uniform_spec(BASE, K4)), fit(stats3, uniform_spec(BASE, K8))
    assert torch.equal(book.tensors["k_scale"][0], b4.tensors["k_scale"][0]) and torch.equal(book.tensors["k_scale"][2], b8.tensors["k_scale"][2])
    assert book.key_params(0).outlier_idx.shape[-1] == 2 and book.key_params(2).outlier_idx.shape[-1] == 0
    assert torch.equal(book.key_params(0).outlier_idx, b4.tensors["k_outliers"][0])
    book.save(tmp_path / "b.safetensors")
    back = ScaleBook.load(tmp_path / "b.safetensors", book.geometry)
    assert back.spec == s and back.fit_info["layers"] == ["k4v4o2", "fp16", "k8v4g16"]
    with pytest.raises(Exception, match="per-layer formats but the model has"):
        ScaleBook.load(tmp_path / "b.safetensors", {**book.geometry, "n_layers": 2})


@pytest.mark.parametrize("rotate", ["none", "hadamard", "split"])
def test_mixed_cache_decodes_like_the_one_pass_and_counts_its_bytes(lm3, stats3, rotate):
    """Per-layer formats through CompressedCache == the one-pass evaluation (with kv.value.rotate: every quantized
    layer's values rotated, the fp16 layer untouched; "split": the per-token family with a different key/value split
    of 12 bits per layer, as kv=rot_split chooses), and the bytes. float64 (conftest.float64_model): in float32 the
    two paths' summation orders (and the rotation's) flip the rounding of values on a midpoint."""
    base, formats = ((ROT, [K7V5, FP16, K6V6]) if rotate == "split" else
                     (BASE.model_copy(update={"value": BASE.value.model_copy(update={"rotate": rotate})}), [K4, FP16, K8]))
    s = mixed_spec(base, formats)
    book = fit(stats3, s)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    cache = CompressedCache(book)
    lm64 = tiny_lm("llama", layers=3, seed=3)  # lm3's weights, its own copy to move to float64
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        float64_model(lm64, mp)
        dec = torch.cat([lm64.model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(40)], 1)
        with compressed_attention(lm64.model, book) as kw:
            one = lm64.model(input_ids=ids, use_cache=False, **kw).logits
    torch.testing.assert_close(one, dec, atol=1e-6, rtol=1e-6)
    one = one.float()
    acc = ref.spec_cache_nbytes(s, lm3.geometry, 40)
    got = cache.nbytes_breakdown()
    assert sum(v for k, v in got.items() if k != "static") == sum(v for k, v in acc.items() if k != "static")
    # the mixed accounting is the sum of the three formats' own
    per = [ref.spec_cache_nbytes(uniform_spec(base, f), lm3.geometry, 40) for f in formats]
    assert sum(acc.values()) * 3 == sum(sum(p.values()) for p in per)
    # and a book with the first layer's format everywhere gives different logits from the mixed one (each layer reads its own format)
    with torch.no_grad(), compressed_attention(lm3.model, fit(stats3, uniform_spec(base, formats[0]))) as kw:
        assert (lm3.model(input_ids=ids, use_cache=False, **kw).logits - one).abs().max() > 1e-4


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_sensitivity_equals_compressing_only_that_layer(lm3, stats3, arch):
    """The layer-major shared-prefix schedule gives what a full pass with only layer l compressed gives
    (gemma3: every layer runs with its own RoPE tables and mask, sliding layers and the global one)."""
    if arch == "gemma3":
        lm3 = tiny_lm("gemma3", layers=3, seed=3)
        stats3 = profile(lm3, SMOKE_CALIB, load_texts(SMOKE_CALIB), progress=False)
    books = {f.label: fit(stats3, uniform_spec(BASE, f)) for f in (K4,)}
    w = token_windows(lm3.tokenizer, load_texts(SMOKE_CALIB), 2, 96, seed=4)
    sens = layer_sensitivity(lm3, w, books, progress=False, stride=1)
    for li in range(3):
        only = mixed_spec(BASE, [K4 if i == li else FP16 for i in range(3)], name=f"only{li}")
        q, _ = evaluate_quality(lm3, {only.name: fit(stats3, only)}, w, 1, progress=False)[0][only.name]
        got = sens["k4v4o2"][li]["kl_mean"]
        assert got > 0 and abs(got - q["kl_mean"]) <= 0.05 * q["kl_mean"] + 1e-7, (li, got, q["kl_mean"])


@pytest.mark.parametrize("states,groups", [(2, [(0, 1), (1, 2), (2, 3)]), (4, [(0, 2), (2, 3)]), (6, [(0, 3)])])
def test_sensitivity_in_groups_of_start_layers_equals_one_group(lm3, stats3, monkeypatch, states, groups):
    """Where the passes in flight (layers x candidates hidden states) would exceed SENSITIVITY_LIVE_BYTES, the start
    layers are taken in groups, each running the layers from its first start: the same numbers, to the bit."""
    import kvcompress.eval.sensitivity as sensitivity

    books = {f.label: fit(stats3, uniform_spec(BASE, f)) for f in (K4, K8)}
    w = token_windows(lm3.tokenizer, load_texts(SMOKE_CALIB), 2, 64, seed=4)
    whole = layer_sensitivity(lm3, w, books, progress=False)
    one = sensitivity._state_bytes(lm3, 64)
    assert sensitivity.start_groups(3, 2, one) == [(0, 3)]
    monkeypatch.setattr(sensitivity, "SENSITIVITY_LIVE_BYTES", states * one)
    assert sensitivity.start_groups(3, 2, one) == groups
    assert layer_sensitivity(lm3, w, books, progress=False) == whole and all(r["kl_mean"] > 0 for r in whole[K4.label])


def test_hull_is_ordered_from_compact_to_accurate():
    cost = [[10, 6, 3], [10, 6, 3], [10, 6, 3]]
    kl = [[0, 1, 5], [0, 0.1, 0.2], [0, 2, 9]]
    h = hull(cost, kl)
    b = [sum(cost[i][o] for i, o in enumerate(a)) for a in h]
    k = [sum(kl[i][o] for i, o in enumerate(a)) for a in h]
    assert h[0] == (2, 2, 2) and h[-1] == (0, 0, 0)
    assert all(x <= y for x, y in zip(b, b[1:])) and all(x >= y for x, y in zip(k, k[1:]))
    assert (2, 2, 2) in h and (0, 2, 0) in h  # the cheap-to-compress layer goes first


def _eval(max_kl):
    return EvalConfig(name="t", gates=[Gate(name="kl_mean", max=max_kl)])


def test_tune_picks_fewer_bytes_under_looser_gates(lm3, stats3):
    cfg = TuneConfig(menu=[K8, K4], n_windows=1, seq_len=96, max_checks=6)
    spec = KVSpec(name="auto", window=8, sink_tokens=2, layers="auto")
    loose_book, loose = tune(lm3, stats3, spec, cfg, _eval(10.0), SMOKE_CALIB, progress=False)
    tight_book, tight = tune(lm3, stats3, spec, cfg, _eval(1e-12), SMOKE_CALIB, progress=False)
    assert loose["chosen"]["layers"] == ["k4v4o2"] * 3  # anything passes: the most compact
    assert tight["chosen"]["layers"] == ["fp16"] * 3  # nothing compressed passes: fp16 everywhere
    assert loose_book.spec.is_mixed and loose_book.spec.name == "auto" and tight_book.spec.is_baseline
    assert loose["chosen"]["bytes_per_token"] < tight["chosen"]["bytes_per_token"]
    pts = loose["points"]
    assert any(p["kind"] == "uniform" for p in pts) and sum(p["chosen"] for p in pts) == 1
    assert all("measured" in p for p in pts) and loose["tuning_text"]["origin"].startswith("builtin:calib")


def test_kv_auto_config_adds_the_tune_stage_and_refuses_contradictions():
    from kvcompress.paths import load_preset

    base = {"model": load_preset("model", "tiny_llama"), "kv": load_preset("kv", "auto"), "calib": load_preset("calib", "smoke"),
            "eval": {**load_preset("eval", "smoke"), "gates": [{"name": "kl_mean", "max": 0.05}]}, "export": {"name": "none"}, "stages": None,
            "cache_dir": "/tmp/x"}
    assert to_run_config(base).stages == ["profile", "fit", "tune", "validate"]
    with pytest.raises(UserError, match="tune: eval.gates has none of ppl_delta_rel, kl_mean, kl_p99, top1_disagree"):  # eval=smoke's: none
        to_run_config({**base, "eval": load_preset("eval", "smoke")})
    with pytest.raises(UserError, match="add tune to stages"):
        to_run_config({**base, "stages": ["profile", "fit", "validate"]})
    with pytest.raises(UserError, match="fixed formats"):
        to_run_config({**base, "kv": load_preset("kv", "int8k_int4v"), "stages": ["profile", "fit", "tune"]})


@pytest.mark.parametrize("args,needle", [
    (["tune.foo=1"], "tune.foo is not a known key of tune"),
    (["tune.margin=0"], "tune.margin=0 is invalid"),
])
def test_bad_tune_input_one_line(tmp_path, args, needle):
    r = run_cli("model=tiny_llama", "kv=auto", "export=none", *args, f"hydra.run.dir={tmp_path}/run", cache_dir=tmp_path / "c")
    assert r.returncode != 0 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_kv_auto_end_to_end_on_the_tiny_model(tmp_path):
    run = tmp_path / "run"
    r = run_cli("model=tiny_llama", "kv=auto", "export=none", "calib=smoke", "eval=smoke", "tune.seq_len=160", "tune.margin=1.0",
                "eval.gates=[{name: kl_mean, max: 0.05}]", f"hydra.run.dir={run}", cache_dir=tmp_path / "c")
    assert r.returncode == 0, r.stderr[-3000:]
    t = json.loads((run / "tune.json").read_text())
    rep = json.loads((run / "report.json").read_text())
    assert rep["tune"]["chosen"] == t["chosen"] and rep["tune"]["held_out_verdict"] == rep["verdict"]
    book = ScaleBook.load(run / "scalebook.safetensors")
    assert book.spec.is_mixed and [f.label for f in book.spec.layers] == t["chosen"]["layers"]
    geom = Geometry(**rep["model"]["geometry"])
    want = sum(v for k, v in ref.spec_cache_nbytes(book.spec, geom, rep["memory"]["context"]).items() if k != "static")
    assert rep["memory"]["bytes_per_token_compressed"] * rep["memory"]["context"] == pytest.approx(want)
    page = (run / "report.html").read_text()
    assert "Pareto" in page and "per-layer format map" in page and "Tuning (kv.layers=auto)" in (run / "report.md").read_text()
    assert json.loads((run / "config.json").read_text())["tune"]["margin"] == 1.0


def test_kv_auto_report_renders_offline_in_headless_chromium(tmp_path):
    import os
    import shutil
    import subprocess

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing in CI: .ci/run must install Debian's chromium")
        pytest.skip("chromium not installed (Debian package chromium; .ci/run installs it)")
    run = tmp_path / "run"
    r = run_cli("model=tiny_llama", "kv=auto", "export=none", "calib=smoke", "eval=smoke", "tune.seq_len=160",
                "eval.gates=[{name: kl_mean, max: 0.05}]", f"hydra.run.dir={run}", cache_dir=tmp_path / "c")
    assert r.returncode == 0, r.stderr[-3000:]
    page = run / "report.html"
    head = page.read_text().split("<pre>")[0]
    assert "<script" not in head and "http" not in head and "src=" not in head
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([chromium, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "Tuning (kv.layers=auto)" in dom.stdout and "Pareto" in dom.stdout and "<circle" in dom.stdout and "per-layer format map" in dom.stdout
    assert "chosen" in dom.stdout and "release gate" in dom.stdout


def test_tune_searches_window_and_sinks_end_to_end(lm3, stats3):
    """tune.windows x tune.sinks: each alternative is measured on the chosen assignment; under a loose
    gate the smallest fp16 window and sinks win (fewest bytes at the tuning context)."""
    spec = KVSpec(name="auto", window=8, sink_tokens=2, layers="auto")
    cfg = TuneConfig(menu=[K8, K4], n_windows=1, seq_len=96, max_checks=4, windows=[8, 0], sinks=[2, 0], context=64)
    _, loose = tune(lm3, stats3, spec, cfg, _eval(10.0), SMOKE_CALIB, progress=False)
    alts = [p for p in loose["points"] if p["kind"] == "window/sinks"]
    assert len(alts) == 3 and all("measured" in p for p in alts)
    assert (loose["chosen"]["window"], loose["chosen"]["sink_tokens"]) == (0, 0) and loose["chosen"]["name"].endswith("+w0s0")
    assert sum(p["chosen"] for p in loose["points"]) == 1


def test_split_candidates_take_the_same_bytes_and_need_the_per_token_family():
    """kv.layers=split: the candidates split key.bits + value.bits with no fewer bits to keys, every one the same
    bytes per token; static per-channel keys (no 5..7-bit codes there) are refused with the reason, per layer too."""
    split = KVSpec.model_validate({**ROT.model_dump(), "layers": "split"})
    assert split.is_auto and split.is_split and not split.is_mixed
    assert [f.label for f in split.split_formats()] == ["k8v4g16", "k7v5g16", "k6v6g16"]
    geom = Geometry(n_layers=2, n_heads=6, n_kv_heads=2, head_dim=64, hidden_size=96, vocab_size=256, max_position=4096, rope_theta=1e4, architecture="LlamaForCausalLM")
    sizes = {f.label: ref.spec_cache_nbytes(uniform_spec(split, f), geom, 4096) for f in split.split_formats()}
    assert len({sum(v.values()) for v in sizes.values()}) == 1, sizes
    assert sizes["k7v5g16"]["key_payload"] == sizes["k8v4g16"]["key_payload"] * 7 // 8  # the split moves bytes, not adds them
    with pytest.raises(ValueError, match="kv.layers=split .* per-token family"):
        KVSpec(name="s", layers="split")
    with pytest.raises(ValueError, match=r"kv.layers\[0\]=k7v5: kv.key.bits=7, kv.value.bits=5: 5..7-bit codes are in the per-token family"):
        mixed_spec(BASE, [LayerFormat(key_bits=7, value_bits=5)])
    whole = [LayerFormat(key_bits=8, value_bits=4, value_group=0), LayerFormat(key_bits=7, value_bits=5, value_group=0)]
    with pytest.raises(UserError, match=r"kv.layers\[1\]=k7v5g0: 5..7-bit codes .* head_dim=36"):
        mixed_spec(ROT, whole).check_geometry(36)


def test_tune_split_gives_each_layer_its_least_kl_split_and_keeps_the_lowest_measured(lm3, stats3):
    """kv.layers=split on the tiny model: the searched point takes each layer's split of least sensitivity KL, every
    candidate is also measured uniformly, all at the same bytes, and the chosen one is the lowest measured KL."""
    spec = KVSpec.model_validate({**ROT.model_dump(), "name": "rs", "layers": "split"})
    book, rec = tune(lm3, stats3, spec, TuneConfig(n_windows=1, seq_len=96), _eval(10.0), SMOKE_CALIB, progress=False)
    assert rec["mode"] == "split" and rec["menu"] == ["k8v4g16", "k7v5g16", "k6v6g16"]
    sens = rec["sensitivity"]
    least = [min(rec["menu"], key=lambda m: sens[m][i]["kl_mean"]) for i in range(3)]
    pts = {p["name"]: p for p in rec["points"]}
    assert pts["split"]["layers"] == least and set(pts) == {"split", *(f"uniform:{m}" for m in rec["menu"])}
    assert len({p["bytes_per_token"] for p in pts.values()}) == 1
    kls = {n: p["measured"]["kl_mean"] for n, p in pts.items()}
    assert len({kls[f"uniform:{m}"] for m in rec["menu"]}) == 3  # the splits differ measurably on this model
    best = "split" if kls["split"] == min(kls.values()) else min(kls, key=kls.get)  # a tie goes to the per-layer pick
    assert [n for n, p in pts.items() if p["chosen"]] == [best] and rec["chosen"]["name"] == best
    assert book.spec.is_mixed and book.spec.name == "rs" and [f.label for f in book.spec.layers] == pts[best]["layers"]
    assert all(book.layer_spec(i).token_keys for i in range(3))


def test_kv_rot_split_end_to_end_on_the_tiny_model(tmp_path):
    """python -m kvcompress kv=rot_split: the tune stage runs by itself, the report shows the split search, and the
    validated ScaleBook holds the chosen splits."""
    run = tmp_path / "run"
    r = run_cli("model=tiny_llama", "kv=rot_split", "export=none", "calib=smoke", "eval=smoke", "tune.seq_len=160",
                f"hydra.run.dir={run}", cache_dir=tmp_path / "c")
    assert r.returncode == 0, r.stderr[-3000:]
    t = json.loads((run / "tune.json").read_text())
    assert t["mode"] == "split" and json.loads((run / "config.json").read_text())["stages"] == ["profile", "fit", "tune", "validate"]
    book = ScaleBook.load(run / "scalebook.safetensors")
    assert [f.label for f in book.spec.layers] == t["chosen"]["layers"] and {f.label for f in book.spec.layers} <= set(t["menu"])
    md = (run / "report.md").read_text()
    assert "Tuning (kv.layers=split)" in md and "the lowest KL at the same bytes" in md


# kv.layers=budget: the static family with asymmetric keys and rotated values (kv=int8k_budget's scheme at a test's sizes)
ASYM = KVSpec(name="b", window=8, sink_tokens=2, key={"bits": 8, "symmetric": False, "clip": "minmax"},
              value={"bits": 4, "group_size": 16, "rotate": "hadamard"}, layers="budget")


def test_budget_candidates_are_the_static_familys_value_formats():
    """kv.layers=budget: the spec's own format first, its value groups doubled and halved, 8-bit values; refused with
    the reason outside the static family. The preset names the same scheme."""
    from kvcompress.config import kv_preset

    assert ASYM.is_auto and ASYM.is_budget and not ASYM.is_split and not ASYM.is_mixed
    assert [f.label for f in ASYM.budget_formats()] == ["k8v4g16", "k8v4", "k8v4g8", "k8v8g16"]
    assert [f.label for f in kv_preset("int8k_budget").budget_formats()] == ["k8v4", "k8v4g64", "k8v4g16", "k8v8"]
    with pytest.raises(ValueError, match="kv.layers=budget spends the bytes of the static family's format .* got granularity=token"):
        KVSpec.model_validate({**ROT.model_dump(), "layers": "budget"})
    with pytest.raises(ValueError, match="kv.layers=budget .* got granularity=channel, key.bits=16, value.bits=16"):
        KVSpec(name="x", key={"bits": 16}, value={"bits": 16}, layers="budget")


def test_fill_budget_spends_what_is_left_on_the_most_kl_per_byte():
    """Within the budget, the single-layer change of most KL saved per byte is taken first, until none fits or helps;
    a change that saves KL at no cost is always taken."""
    cost = [[10, 12, 20], [10, 12, 20], [10, 10, 9]]
    kl = [[5.0, 4.0, 1.0], [5.0, 2.0, 1.5], [3.0, 2.0, 2.5]]
    # layer 2: option 1 is as cheap and better; then layer 1 -> 1 (1.5 per byte) beats layer 0 -> 1 (0.5 per byte)
    assert fill_budget([0, 0, 0], [cost], kl, [33]) == [0, 1, 1]
    assert fill_budget([0, 0, 0], [cost], kl, [36]) == [1, 1, 1]
    assert fill_budget([0, 0, 0], [cost], kl, [30]) == [0, 0, 1]
    assert fill_budget([0, 0, 0], [cost], kl, [100]) == [2, 2, 1]  # everything fits: the least KL of every layer
    # a second (shorter) context where layer 1's upgrade costs more: it no longer fits there, layer 0's does
    short = [[10, 12, 20], [10, 20, 20], [10, 10, 9]]
    assert fill_budget([0, 0, 0], [short, cost], kl, [33, 33]) == [1, 0, 1]


def test_budget_contexts_are_the_corners_of_the_byte_difference():
    geom = Geometry(n_layers=3, n_heads=4, n_kv_heads=1, head_dim=32, hidden_size=64, vocab_size=256, max_position=4096,
                    rope_theta=1e4, architecture="Gemma3ForCausalLM", sliding_windows=(512, 0, 1024))
    assert budget_contexts(geom, 4096) == [512, 1024, 4096] and budget_contexts(geom, 800) == [512, 800]
    assert budget_contexts(Geometry(**{**geom.__dict__, "sliding_windows": ()}), 4096) == [4096]


def test_tune_budget_keeps_the_uniform_bytes_and_the_lower_measured_kl(lm3, stats3):
    """kv.layers=budget on the tiny model: the searched assignment predicts no more KL than the uniform format within
    the same bytes per token, both are measured end to end, and the lower measured KL is chosen and fitted."""
    book, rec = tune(lm3, stats3, ASYM, TuneConfig(n_windows=1, seq_len=96, context=256), _eval(10.0), SMOKE_CALIB, progress=False)
    assert rec["mode"] == "budget" and rec["menu"] == ["k8v4g16", "k8v4", "k8v4g8", "k8v8g16"]
    sens, lb = rec["sensitivity"], rec["layer_bytes_per_token"]
    pts = {p["name"]: p for p in rec["points"]}
    assert set(pts) == {"budget", "uniform:k8v4g16"} and pts["uniform:k8v4g16"]["layers"] == ["k8v4g16"] * 3
    budget = rec["budget_bytes_per_token"]
    assert budget == pytest.approx(pts["uniform:k8v4g16"]["bytes_per_token"])
    assert pts["budget"]["bytes_per_token"] <= budget * (1 + 1e-9)
    assert sum(lb[f][i] for i, f in enumerate(pts["budget"]["layers"])) == pytest.approx(pts["budget"]["bytes_per_token"])
    pred = pts["budget"]["predicted"]["kl_mean"]
    assert pred == pytest.approx(sum(sens[f][i]["kl_mean"] for i, f in enumerate(pts["budget"]["layers"])))
    assert pred <= sum(sens["k8v4g16"][i]["kl_mean"] for i in range(3))
    # no single-layer change within the bytes left predicts less KL (fill_budget's end state)
    left = budget - pts["budget"]["bytes_per_token"]
    for i, f in enumerate(pts["budget"]["layers"]):
        for g in rec["menu"]:
            if lb[g][i] - lb[f][i] <= left + 1e-6:
                assert sens[g][i]["kl_mean"] >= sens[f][i]["kl_mean"], (i, f, g)
    kls = {n: p["measured"]["kl_mean"] for n, p in pts.items()}
    best = "budget" if kls["budget"] <= kls["uniform:k8v4g16"] else "uniform:k8v4g16"
    assert [n for n, p in pts.items() if p["chosen"]] == [best] and rec["chosen"]["name"] == best
    assert book.spec.is_mixed and book.spec.name == "b" and [f.label for f in book.spec.layers] == pts[best]["layers"]
    assert not book.spec.key.symmetric and book.spec.value.rotate == "hadamard"


def test_tune_budget_moves_bytes_to_the_sensitive_layer(lm3, stats3, monkeypatch):
    """With layer 0 far more sensitive than the others (a given sensitivity table), the budget search gives layer 0
    the finer value groups, paid for by coarser groups in layers 1 and 2, at exactly the uniform format's bytes."""
    import kvcompress.stages.tune as tune_mod

    table = {"k8v4g16": [1e-5, 1e-7, 1e-7], "k8v4": [2e-5, 2e-7, 2e-7], "k8v4g8": [2e-6, 9e-8, 9e-8], "k8v8g16": [1e-7, 5e-8, 5e-8]}
    monkeypatch.setattr(tune_mod, "layer_sensitivity", lambda lm, w, books, progress: {
        n: [{"kl_mean": k, "ppl_delta_rel": k} for k in table[n]] for n in books})
    book, rec = tune(lm3, stats3, ASYM, TuneConfig(n_windows=1, seq_len=96, context=256), _eval(10.0), SMOKE_CALIB, progress=False)
    pts = {p["name"]: p for p in rec["points"]}
    assert pts["budget"]["layers"] == ["k8v4g8", "k8v4", "k8v4"], rec["layer_bytes_per_token"]
    assert pts["budget"]["bytes_per_token"] == pytest.approx(rec["budget_bytes_per_token"])
    assert pts["budget"]["predicted"]["kl_mean"] == pytest.approx(2.4e-6)
    assert all("measured" in p for p in pts.values()) and sum(p["chosen"] for p in pts.values()) == 1


def test_kv_int8k_budget_end_to_end_on_the_tiny_model(tmp_path):
    """python -m kvcompress kv=int8k_budget: the tune stage runs by itself, the report shows the budget search, the
    validated ScaleBook holds the chosen formats, and the custom tier ships it."""
    run = tmp_path / "run"
    r = run_cli("model=tiny_llama", "kv=int8k_budget", "calib=smoke", "eval=smoke", "tune.seq_len=160",
                f"hydra.run.dir={run}", cache_dir=tmp_path / "c")
    assert r.returncode == 0, r.stderr[-3000:]
    t = json.loads((run / "tune.json").read_text())
    assert t["mode"] == "budget" and json.loads((run / "config.json").read_text())["stages"] == ["profile", "fit", "tune", "validate", "export"]
    book = ScaleBook.load(run / "scalebook.safetensors")
    assert [f.label for f in book.spec.layers] == t["chosen"]["layers"] and {f.label for f in book.spec.layers} <= set(t["menu"])
    md = (run / "report.md").read_text()
    assert "Tuning (kv.layers=budget)" in md and "the lowest KL within k8v4's bytes per token" in md
    man = json.loads((run / "export" / "manifest.json").read_text())
    assert not [c["check"] for c in man["checks"] if c["status"] == "failed"]


def test_tune_budget_with_sliding_layers_holds_the_bytes_at_every_context(monkeypatch):
    """Gemma 3 (sliding-window layers hold at most their window): a sensitivity table that makes the sliding layer's
    upgrade cheap at the serving context would, picked at that context alone, take more bytes than the uniform format
    at shorter ones. The search keeps the bytes within the uniform format's at every context up to the tuning one."""
    import kvcompress.stages.tune as tune_mod
    from kvcompress.stages.tune import spec_bytes

    lm = tiny_lm("gemma3", layers=3, heads=4, kv_heads=1, head_dim=32)
    stats = profile(lm, SMOKE_CALIB, load_texts(SMOKE_CALIB), progress=False)
    geom = lm.geometry
    assert any(geom.sliding_windows) and not all(geom.sliding_windows)
    slid = [i for i, w in enumerate(geom.sliding_windows) if w][0]
    table = {f.label: [1e-7] * 3 for f in ASYM.budget_formats()}
    table["k8v4g16"][slid], table["k8v8g16"][slid] = 1e-5, 1e-8  # the sliding layer's values matter most
    table["k8v4"] = [2e-7 if i != slid else 2e-5 for i in range(3)]
    monkeypatch.setattr(tune_mod, "layer_sensitivity", lambda lm, w, books, progress: {
        n: [{"kl_mean": k, "ppl_delta_rel": k} for k in table[n]] for n in books})
    context = 8 * max(geom.sliding_windows)
    _, rec = tune(lm, stats, ASYM, TuneConfig(n_windows=1, seq_len=96, context=context), _eval(10.0), SMOKE_CALIB, progress=False)
    pts = {p["name"]: p for p in rec["points"]}
    chosen = mixed_spec(ASYM, [LayerFormat.model_validate(_fmt(x)) for x in pts["budget"]["layers"]], name="c")
    uni = uniform_spec(ASYM, ASYM.budget_formats()[0])
    for c in (40, 64, max(geom.sliding_windows), max(geom.sliding_windows) + 37, context // 2, context):
        assert spec_bytes(chosen, geom, c) <= spec_bytes(uni, geom, c) * (1 + 1e-9), (c, pts["budget"]["layers"])
    assert set(rec["budget_checked_at"]) == {str(c) for c in budget_contexts(geom, context)}
    assert pts["budget"]["layers"][slid] != "k8v4g16"  # the sliding layer still got more than the uniform format


def _fmt(label: str) -> dict:
    """LayerFormat fields from a label like k8v4g16 (the tests' menu only)."""
    import re

    k, v, g = re.fullmatch(r"k(\d+)v(\d+)(?:g(\d+))?", label).groups()
    return {"key_bits": int(k), "value_bits": int(v), "value_group": int(g) if g else 32}
