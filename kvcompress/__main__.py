"""`python -m kvcompress ...`: Hydra glue only. Config -> RunConfig -> pipeline.run."""
from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from kvcompress.errors import UserError

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ("model", "kv", "calib", "eval", "export")


def fail(msg: str) -> None:
    print(f"kvcompress: error: {msg}", file=sys.stderr)
    sys.exit(2)


def check_group_overrides(argv: list[str]) -> None:
    """`kv=int3` -> one clear line naming the allowed options (Hydra's own message is long)."""
    for arg in argv:
        key, sep, val = arg.lstrip("+~").partition("=")
        if not sep or key not in GROUPS:
            continue
        allowed = sorted(p.stem for p in (CONF_DIR / key).glob("*.yaml"))
        for option in val.split(","):
            if option and option not in allowed:
                fail(f"{key}={option} is not a known {key} config; allowed: {', '.join(allowed)}")


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def hydra_main(cfg) -> None:
    from kvcompress.config import to_run_config
    from kvcompress.pipeline import run

    try:
        run_cfg = to_run_config(OmegaConf.to_container(cfg, resolve=True))
        run(run_cfg, HydraConfig.get().runtime.output_dir)
    except UserError as e:
        fail(str(e))


def main() -> None:
    check_group_overrides(sys.argv[1:])
    hydra_main()


if __name__ == "__main__":
    main()
