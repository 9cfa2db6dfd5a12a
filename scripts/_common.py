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


def model_config(name: str) -> ModelConfig:
    return ModelConfig.model_validate(_load("model", name))


def kv_spec(name: str) -> KVSpec:
    return KVSpec.model_validate(_load("kv", name))


def calib_config(name: str) -> CalibConfig:
    return CalibConfig.model_validate(_load("calib", name))


def eval_config(name: str) -> EvalConfig:
    return EvalConfig.model_validate(_load("eval", name))


def cache_dir() -> str:
    from kvcompress.paths import default_cache_dir

    return str(default_cache_dir())
