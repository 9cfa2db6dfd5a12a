"""Where kvcompress keeps per-machine caches (converted weights, kv_stats) and its config presets."""
from __future__ import annotations

import os
from pathlib import Path


CONF_DIR = Path(__file__).resolve().parents[1] / "conf"  # the Hydra config groups (model, kv, calib, eval, export)


def preset_names(group: str) -> list[str]:
    """The presets of a config group: the stems of conf/<group>/*.yaml, sorted."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def default_presets() -> dict[str, str]:
    """The preset each config group takes when the command line names none (conf/config.yaml's defaults list)."""
    from omegaconf import OmegaConf

    top = OmegaConf.load(CONF_DIR / "config.yaml")
    return {k: v for d in top.defaults if OmegaConf.is_dict(d) for k, v in d.items()}


def load_preset(group: str, name: str) -> dict:
    """conf/<group>/<name>.yaml as a plain dict (interpolations resolved), without its Hydra defaults list (what a preset
    changes in other groups when the CLI composes it, e.g. model=llama3_8b's calib=long: not a field of the group)."""
    from omegaconf import OmegaConf

    d = OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{name}.yaml"), resolve=True)
    d.pop("defaults", None)
    return d


def default_cache_dir() -> Path:
    """$KVCOMPRESS_CACHE, else ~/.cache/kvcompress (the same rule as conf/config.yaml)."""
    return Path(os.environ.get("KVCOMPRESS_CACHE") or Path.home() / ".cache" / "kvcompress")
