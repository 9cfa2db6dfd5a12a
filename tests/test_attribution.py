"""Error attribution (eval.attribute): each format measured with only its keys, then only its values
compressed, on the same windows against the same baseline. Each side's pass must equal a full evaluation
of the format whose other side is left lossless (here: the reference's quantizer for it replaced by the
identity), and the report must carry both."""
import json

import pytest
import torch

from conftest import fitted_book, run_cli
from kvcompress import reference as ref
from kvcompress.eval.attention import eval_call
from kvcompress.stages.validate import attribution_of, evaluate_quality


def _windows():
    return torch.randint(0, 256, (2, 200), generator=torch.Generator().manual_seed(3))


_orig_rotated = ref.fake_quant_rotated


def _lossless_on(call: int):
    """fake_quant_rotated returning its input on the first (call=0: keys) or second (call=1: values) call of each
    layer: simulate_kv quantizes a layer's keys, then its values."""
    count = [0]

    def f(x, *a, **k):
        count[0] += 1
        return x if (count[0] - 1) % 2 == call else _orig_rotated(x, *a, **k)
    return f


@pytest.mark.parametrize("spec", [
    dict(name="k8v4", window=16, sink_tokens=2),  # the default's structure: static per-channel keys, per-token values
    dict(name="rot", window=16, sink_tokens=2, key={"bits": 8, "granularity": "token", "rotate": "hadamard"},
         value={"bits": 4, "group_size": 16, "rotate": "hadamard", "min": "code"}),  # both sides through fake_quant_rotated
])
def test_each_side_equals_the_format_with_the_other_side_lossless(tiny_llama, monkeypatch, spec):
    book = fitted_book(tiny_llama, **spec)
    name, rotated = book.spec.name, book.spec.token_keys
    attribution = {}
    measured, kept = evaluate_quality(tiny_llama, {name: book}, _windows(), 1, progress=False, keep=True, attribution=attribution)
    (full, _), = measured.values()
    assert not kept.hidden[0].requires_grad  # evaluated without autograd
    assert set(attribution) == {(name, "keys"), (name, "values")}
    lossless = lambda x, *a, **k: x  # noqa: E731
    with monkeypatch.context() as m:  # values left as the fp16 cache holds them
        m.setattr(ref, *(("fake_quant_rotated", _lossless_on(1)) if rotated else ("fake_quant_values", lossless)))
        (keys_alone, _), = evaluate_quality(tiny_llama, {name: book}, _windows(), 1, progress=False)[0].values()
    with monkeypatch.context() as m:  # keys left as the fp16 cache holds them
        m.setattr(ref, *(("fake_quant_rotated", _lossless_on(0)) if rotated else ("fake_quant_keys", lossless)))
        (values_alone, _), = evaluate_quality(tiny_llama, {name: book}, _windows(), 1, progress=False)[0].values()
    for side, want in (("keys", keys_alone), ("values", values_alone)):
        got = attribution[(name, side)]
        assert (got["kl_mean"], got["top1_agree"], got["ppl_delta_rel"]) == (want["kl_mean"], want["top1_agree"], want["ppl_delta_rel"]), side
        assert 0 < got["kl_mean"] < full["kl_mean"] * 10
    assert attribution[(name, "keys")]["kl_mean"] != attribution[(name, "values")]["kl_mean"]
    a = attribution_of(name, attribution)
    assert a.keys_only.kl_mean == keys_alone["kl_mean"] and a.values_only.kl_mean == values_alone["kl_mean"]
    assert attribution_of(name, None) is None and attribution_of("other", attribution) is None


def test_a_side_outside_keys_and_values_is_refused(tiny_llama):
    book = fitted_book(tiny_llama, name="k8v4", window=16)
    with pytest.raises(ValueError, match="only='scales': one of"):
        eval_call(book, only="scales")


def test_the_report_carries_the_attribution_of_every_format(tmp_path):
    run_dir = tmp_path / "run"
    r = run_cli("model=tiny_llama", "calib=smoke", "eval=smoke", "eval.attribute=true", "eval.tasks.names=[]", "export=none",
                "eval.compare=[native_fp8]", f"hydra.run.dir={run_dir}", cache_dir=tmp_path / "c")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads((run_dir / "report.json").read_text())
    assert rep["attribution"]["keys_only"]["kl_mean"] > 0 and rep["attribution"]["values_only"]["kl_mean"] > 0
    fp8 = next(f for f in rep["fallbacks"] if f["name"] == "native_fp8")
    assert fp8["attribution"]["keys_only"]["kl_mean"] > 0 and fp8["attribution"]["keys_only"] != rep["attribution"]["keys_only"]
    md = (run_dir / "report.md").read_text()
    assert "only the keys compressed: KL mean" in md and "only the values compressed: KL mean" in md
    assert "error attribution: KL with only the keys compressed" in r.stderr + r.stdout


def test_no_attribution_unless_asked(tmp_path):
    run_dir = tmp_path / "run"
    r = run_cli("model=tiny_llama", "calib=smoke", "eval=smoke", "eval.tasks.names=[]", "export=none", f"hydra.run.dir={run_dir}", cache_dir=tmp_path / "c")
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads((run_dir / "report.json").read_text())
    assert rep["attribution"] is None and all(f["attribution"] is None for f in rep["fallbacks"])
    assert "only the keys compressed" not in (run_dir / "report.md").read_text()
