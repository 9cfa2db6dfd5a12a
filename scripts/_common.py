"""Helpers for the scripts: build typed configs from conf/ YAML without Hydra (scripts stay thin)."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvcompress.config import CalibConfig, EvalConfig, ModelConfig  # noqa: E402
from kvcompress.paths import load_preset  # noqa: E402
from kvcompress.spec import KVSpec  # noqa: E402

sys.path.insert(0, str(ROOT / "export"))
from build_engine import positive  # noqa: E402,F401  (argparse type for counts and lengths; the GPU-host script imports only the stdlib)


def positive_float(text: str) -> float:
    """argparse type: a number > 0 (counts and lengths: `positive`, from export/build_engine.py)."""
    import argparse

    try:
        if float(text) > 0:
            return float(text)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r} is not a number > 0")


def _load(group: str, name: str) -> dict:
    """conf/<group>/<name>.yaml; a name that is not a preset is a one-line error (exit 2), not a traceback."""
    from kvcompress.paths import preset_names

    if name not in preset_names(group):
        allowed = ", ".join(preset_names(group))
        print(f"{Path(sys.argv[0]).name}: error: {group} preset {name!r} does not exist; allowed: {allowed}", file=sys.stderr)
        sys.exit(2)
    return load_preset(group, name)


def add_model_args(ap, default: str = "smollm2_135m") -> None:
    """--model (a preset of conf/model) and --model-path (its model.path: the presets that read a local directory or file)."""
    ap.add_argument("--model", default=default, help="a model preset (conf/model)")
    ap.add_argument("--model-path", default=None, help="model.path for a preset that reads a local Hugging Face directory or GGUF file "
                                                     "(e.g. --model llama3_8b --model-path /models/Llama-3.1-8B)")


def model_config(name: str, path: str | None = None) -> ModelConfig:
    d = _load("model", name)
    if path is not None:
        d["path"] = path
    return ModelConfig.model_validate(d)


def run(main) -> None:
    """Run a script's main(): bad input found while it runs (a UserError: a model path, a text file, an artifact) is one line
    on stderr and exit 2, not a traceback; otherwise exit with main's return code (None: 0)."""
    from kvcompress.errors import UserError

    try:
        code = main()
    except UserError as e:
        print(f"{Path(sys.argv[0]).name}: error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(code or 0)


def kv_spec(name: str) -> KVSpec:
    return KVSpec.model_validate(_load("kv", name))


def calib_config(name: str) -> CalibConfig:
    return CalibConfig.model_validate(_load("calib", name))


def eval_config(name: str) -> EvalConfig:
    return EvalConfig.model_validate(_load("eval", name))


def cache_dir() -> str:
    from kvcompress.paths import default_cache_dir

    return str(default_cache_dir())
