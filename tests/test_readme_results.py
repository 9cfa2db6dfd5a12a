"""Every number in the results block of docs/results.md comes from docs/results/*.json (rendered by
scripts/make_results.py); this fails when the page and the committed results disagree. The same for the benchmark
blocks of docs/models.md and docs/tuning.md."""
import importlib.util
import json

import pytest

from conftest import ROOT


def _make_results():
    spec = importlib.util.spec_from_file_location("make_results", ROOT / "scripts" / "make_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_results_block_is_rendered_from_the_committed_results():
    mr = _make_results()
    results = mr.load_results()
    assert results, "docs/results/ holds no results files"
    readme = mr.DOC.read_text()
    block = readme[readme.index(mr.BEGIN) : readme.index(mr.END) + len(mr.END)]
    assert block == mr.render(results)
    for name, r in results.items():
        assert r["command"] == mr.COMMANDS[name] and f"`{r['command']}`" in readme
        assert r["provenance"]["git_sha"] and r["model"]["sha256"] and r["eval"]["sha256"]


def test_only_the_default_run_leaves_kv_to_the_default_preset():
    """A results file whose run left kv= to the default preset of its time names it now (kv=int8k_int4v) and keeps the
    command as run (`ran_as`, rendered in its header): the first format it measured is that preset, and the explicit
    command is the one as run with kv= written out. Only `default` (python -m kvcompress) follows today's default."""
    mr = _make_results()
    results = mr.load_results()
    assert [n for n, r in results.items() if "kv=" not in r["command"]] == ["default"]
    assert results["default"]["formats"][0]["name"] == "int8k_asym_rotv"
    assert "  - kv: int8k_asym_rotv " in (ROOT / "conf" / "config.yaml").read_text()  # the committed default run is today's default
    ran_as = {n: r for n, r in results.items() if r.get("ran_as")}
    assert {"long8k_attr"} <= set(ran_as) and "long8k_all" not in ran_as  # the 8K table names its kv= (the default, rerun)
    for n, r in ran_as.items():
        a = r["ran_as"]
        assert "kv=" not in a["command"] and r["formats"][0]["name"] == a["default_kv"]
        assert r["command"] == a["command"].replace("python -m kvcompress ", f"python -m kvcompress kv={a['default_kv']} ", 1)
        assert f"ran as `{a['command']}` when {a['default_kv']} was the default" in mr.render({n: r})


def test_results_files_are_data_with_provenance():
    for p in (ROOT / "docs" / "results").glob("*.json"):
        r = json.loads(p.read_text())
        assert {"command", "ran", "model", "eval", "provenance", "formats", "stage_times_s"} <= set(r)
        assert r["formats"][0]["role"] == "primary"


def test_streaming_block_is_rendered_from_the_committed_benchmark():
    spec = importlib.util.spec_from_file_location("bench_streaming", ROOT / "scripts" / "bench_streaming.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = json.loads(mod.RESULT.read_text())
    readme = mod.DOC.read_text()
    assert readme[readme.index(mod.BEGIN) : readme.index(mod.END) + len(mod.END)] == mod.render(r)
    assert r["command"] in readme and r["git_sha"] and r["synthetic"]["exported"]


@pytest.mark.parametrize("model", ["smollm2_135m", "gemma3_270m"])
def test_tune_block_is_rendered_from_the_committed_benchmark(model):
    spec = importlib.util.spec_from_file_location("bench_tune", ROOT / "scripts" / "bench_tune.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = json.loads(mod.result_path(model).read_text())
    begin, end = mod.markers(model)
    readme = mod.DOC.read_text()
    assert readme[readme.index(begin) : readme.index(end) + len(end)] == mod.render(r)
    assert r["model"] == model and r["git_sha"] and "python scripts/bench_tune.py" in readme
    # kv=auto beside the default preset of today (conf/config.yaml), named in the results
    assert r["baseline"] == mod.default_kv() == "int8k_asym_rotv" and set(r["runs"]) == {r["baseline"], "auto"}
    assert f"| `kv={r['baseline']}` |" in readme


def test_an_attributed_format_renders_its_two_sides():
    """eval.attribute's numbers, where a results file has them, are rendered under its table."""
    mr = _make_results()
    name, r = next(iter(mr.load_results().items()))
    r = json.loads(json.dumps(r))
    side = lambda kl: {"kl_mean": kl, "kl_se": 0.0, "kl_p99": kl, "ppl_delta_rel": 0.0, "top1_agree": 1.0}  # noqa: E731
    r["formats"][0]["attribution"] = {"keys_only": side(1.25e-4), "values_only": side(3.5e-4)}
    out = mr.render({name: r})
    assert f"(eval.attribute): {r['formats'][0]['name']} 1.25e-04 / 3.50e-04." in out
    plain = {n: q for n, q in mr.load_results().items() if not any(f.get("attribution") for f in q["formats"])}  # e.g. not long8k_attr
    assert plain and all("eval.attribute" not in mr.render({n: q}) for n, q in plain.items())
    assert "eval.attribute" in mr.render({"long8k_attr": mr.load_results()["long8k_attr"]})  # the committed attributed file renders its sides


def test_task_columns_name_the_prompt_semantics_each_format_used():
    """A results file made with eval.tasks.prompt=auto (custom formats decode-equivalent, native context-phase) says so
    under its table (the committed default run); files made before (no "prompt" recorded) keep their context-phase header."""
    mr = _make_results()
    results = mr.load_results()
    assert "Task prompts (eval.tasks.prompt): int8k_asym_rotv decode-equivalent prompt; native_int8 context-phase" in mr.render({"default": results["default"]})
    name, r = next((n, q) for n, q in results.items() if sum(1 for f in q["formats"] if f["tasks"]) >= 2
                   and all("prompt" not in f["tasks"] for f in q["formats"] if f["tasks"]))
    assert "retrieval (context-phase) | exact copy (context-phase)" in mr.render({name: r}) and "Task prompts" not in mr.render({name: r})
    r = json.loads(json.dumps(r))
    with_tasks = [f for f in r["formats"] if f["tasks"]]
    with_tasks[0]["tasks"]["prompt"] = "decode"
    out = mr.render({name: r})
    assert "retrieval (prompt as deployed, below)" in out and f"Task prompts (eval.tasks.prompt): {with_tasks[0]['name']} decode-equivalent prompt; " in out
    for f in with_tasks:
        f["tasks"]["prompt"] = "decode"
    assert "retrieval (decode-equivalent prompt) | exact copy (decode-equivalent prompt)" in mr.render({name: r})


def test_make_results_measures_only_committed_code():
    """A rerun refuses a checkout with uncommitted changes outside the results files (its files name the commit they
    ran at); results files an earlier rerun wrote into the same checkout are allowed and recorded."""
    mr = _make_results()
    mr.check_checkout("abc", [])
    mr.check_checkout("abc", ["docs/results.md", "docs/results/long8k_wf.json"])
    mr.check_checkout(None, [])  # not a git checkout: the results record no commit
    with pytest.raises(SystemExit, match=r"uncommitted changes outside docs/results \(kvcompress/reference.py\); .*clean clone"):
        mr.check_checkout("abc", ["docs/results.md", "kvcompress/reference.py"])
    with pytest.raises(SystemExit, match=r"\(a0, a1, a2, a3, a4 and 2 more\)"):
        mr.check_checkout("abc", [f"a{i}" for i in range(7)])


def test_recorded_results_ran_on_committed_code():
    """A results file that records its checkout's changes (git_changes) ran on committed code: changes, if any, are
    earlier results files only (make_results refuses any other)."""
    mr = _make_results()
    for name, r in mr.load_results().items():
        changes = r["provenance"].get("git_changes")
        if changes is not None:
            assert all(mr._is_results_path(c) for c in changes), (name, changes)
            assert str(r["provenance"]["git_sha"]).endswith("-dirty") == bool(changes), name


def test_results_headers_say_what_a_dirty_checkout_held():
    """The header of a table names its commit and, when its checkout had uncommitted changes, whether they were only
    earlier results files (recorded in git_changes) or unknown."""
    mr = _make_results()
    name, r = next(iter(mr.load_results().items()))
    r = json.loads(json.dumps(r))
    prov = r["provenance"]
    prov["git_sha"], prov["git_changes"] = "0123456789abcdef", []
    assert ", git 0123456789ab; file" in mr.render({name: r})
    prov["git_sha"], prov["git_changes"] = "0123456789abcdef-dirty", ["docs/results/default.json", "docs/results.md"]
    assert ", git 0123456789ab (uncommitted: only earlier results files); file" in mr.render({name: r})
    prov["git_changes"] = ["docs/results.md", "kvcompress/cache.py"]
    assert ", git 0123456789ab with uncommitted changes; file" in mr.render({name: r})
    del prov["git_changes"]  # files made before git_changes was recorded
    assert ", git 0123456789ab with uncommitted changes; file" in mr.render({name: r})
