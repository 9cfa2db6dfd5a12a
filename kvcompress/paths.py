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


def unusable_dir(path: str | Path) -> str | None:
    """Why kvcompress could not create and write a directory at `path` (None: it can): the nearest existing ancestor is a
    file, or a directory this process cannot write. Nothing is created."""
    p = Path(path).expanduser().absolute()
    for a in (p, *p.parents):
        if a.exists():
            if not a.is_dir():
                return f"{a} is a file, not a directory"
            if not os.access(a, os.W_OK | os.X_OK):
                return f"{a} is not writable"
            return None
    return None


def check_cache_dir(path: str | Path) -> None:
    """The per-machine cache (KVCOMPRESS_CACHE, or cache_dir=) must be a directory kvcompress can write: created here (it
    would be by the first write), one line if it cannot be (it was a NotADirectoryError traceback after config.json)."""
    from kvcompress.errors import UserError

    why = unusable_dir(path)
    if why is None:
        try:
            Path(path).expanduser().mkdir(parents=True, exist_ok=True)
        except OSError as e:
            why = e.strerror or type(e).__name__
    if why:
        raise UserError(f"cache_dir={str(path)!r} (KVCOMPRESS_CACHE, or cache_dir=) cannot hold the cache: {why}; point KVCOMPRESS_CACHE at a writable directory")
