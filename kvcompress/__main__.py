"""`python -m kvcompress ...`: Hydra glue only. Config -> RunConfig -> pipeline.run."""
from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kvcompress.errors import UserError
from kvcompress.paths import CONF_DIR, default_presets, preset_names

GROUPS = ("model", "kv", "calib", "eval", "export")


def fail(msg: str) -> None:
    print(f"kvcompress: error: {msg}", file=sys.stderr)
    sys.exit(2)


def check_overrides(argv: list[str]) -> None:
    """One clear line for unknown group options (`kv=int3`) and unknown keys (`kv.foo=1`).

    Hydra's own messages for these span several lines.
    """
    top = OmegaConf.load(CONF_DIR / "config.yaml")
    selected = default_presets()
    pairs = [a.partition("=") for a in argv if "=" in a and not a.startswith(("+", "~", "hydra", "-"))]
    for key, _, val in pairs:
        if key in GROUPS:
            allowed = preset_names(key)
            for option in val.split(","):
                if option not in allowed:
                    fail(f"{key}={option} is not a known {key} config; allowed: {', '.join(allowed)}")
            selected[key] = val.split(",")[0]
    for key, _, _val in pairs:
        group, _, rest = key.partition(".")
        if group in GROUPS and rest:
            node = OmegaConf.load(CONF_DIR / group / f"{selected[group]}.yaml")
            parent, _, leaf = rest.rpartition(".")
            sub = OmegaConf.select(node, parent) if parent else node
            if not OmegaConf.is_dict(sub) or leaf not in sub:
                known = ", ".join(sub.keys()) if OmegaConf.is_dict(sub) else "(none)"
                if schema_has(group, rest):  # a field the preset leaves at its default: Hydra adds a key only with +
                    fail(f"{key} is not set by the preset {group}={selected[group]} (it takes the default): add it with +{key}=...; "
                         f"the preset's keys here: {known}")
                fail(f"{key} is not a known key of {group}={selected[group]}; known keys here: {known}")
        elif group not in GROUPS and group not in top:
            fail(f"{key} is not a known key; known top-level keys: {', '.join(k for k in top if k != 'defaults')}, {', '.join(GROUPS)}")
        elif group not in GROUPS and rest and not (OmegaConf.is_dict(top[group]) and rest in top[group]):
            known = ", ".join(top[group].keys()) if OmegaConf.is_dict(top[group]) else "(none)"
            fail(f"{key} is not a known key of {group}; known keys here: {known}")


def schema_has(group: str, dotted: str) -> bool:
    """Whether RunConfig's section `group` has the (nested) field `dotted`, e.g. kv, "key.rotate"."""
    from pydantic import BaseModel

    from kvcompress.config import RunConfig

    model = RunConfig.model_fields[group].annotation
    for part in dotted.split("."):
        if not (isinstance(model, type) and issubclass(model, BaseModel) and part in model.model_fields):
            return False
        model = model.model_fields[part].annotation
    return True


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def hydra_main(cfg) -> None:
    from kvcompress.config import to_run_config
    from kvcompress.pipeline import run

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    overridden = {o.partition("=")[0].lstrip("+~") for o in OmegaConf.to_container(hc.overrides.task, resolve=False)}  # as typed
    try:
        try:
            data = OmegaConf.to_container(cfg, resolve=True)
        except OmegaConfBaseException as e:  # an interpolation that cannot resolve (`cache_dir=${oc.env:UNSET}`): Hydra printed 3 lines
            raise UserError(f"{getattr(e, 'full_key', None) or 'the config'}: {str(e).splitlines()[0]}") from None
        run(to_run_config(data, overridden), run_dir)
    except UserError as e:
        remove_if_empty(run_dir)
        fail(str(e))
    except KeyboardInterrupt:
        # stages write to temporary names and rename when complete: nothing half-written remains
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not turn the clean exit into a kill
        for tmp in run_dir.glob(".*.tmp"):  # a stage interrupted inside its own cleanup: finish it
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"kvcompress: interrupted; nothing partial was left in {run_dir}", file=sys.stderr)
        sys.exit(130)


def remove_if_empty(run_dir: Path) -> None:
    """A run that failed on user input leaves no directory behind (Hydra creates it first, and under ./runs/ its parents
    runs/<model>/<kv>/: those left empty go too; a directory outside ./runs/ that held the run, e.g. hydra.run.dir's
    parent, is the user's and stays)."""
    leftovers = [p for p in run_dir.iterdir() if p.name != ".hydra" and p.suffix != ".log"] if run_dir.is_dir() else [1]
    if not leftovers:
        shutil.rmtree(run_dir, ignore_errors=True)
        runs = Path.cwd().resolve() / "runs"
        for parent in run_dir.resolve().parents:
            if parent != runs and runs not in parent.parents:
                break
            try:
                parent.rmdir()  # only an empty directory
            except OSError:
                break


def _unraisable(u) -> None:
    """Ctrl-C landing while Python runs a finalizer (__del__) is "ignored" and printed with a
    traceback; deliver it again instead, so it interrupts the run like any other Ctrl-C."""
    if u.exc_type is not None and issubclass(u.exc_type, KeyboardInterrupt):
        # not from here: a signal raised inside this hook would interrupt the hook itself
        threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGINT)).start()
        return
    sys.__unraisablehook__(u)


def check_output_dir(argv: list[str]) -> None:
    """Hydra creates the run (or sweep) directory before the config reaches kvcompress: one it cannot create (under a
    file, or not writable) was a NotADirectoryError traceback from Hydra."""
    from kvcompress.paths import unusable_dir

    given = {k: v for k, _, v in (a.partition("=") for a in argv if a.startswith(("hydra.run.dir=", "hydra.sweep.dir=")))}
    for key, path in (given or {"the run directory (./runs/)": "runs"}).items():
        if "${" not in path and (why := unusable_dir(path)):
            fail(f"{key}={path}: {why}" if key.startswith("hydra") else f"{key}: {why}; give hydra.run.dir=<a writable directory>")


def check_sweep(argv: list[str]) -> None:
    """Hydra's messages for an override it cannot parse (`kv.window=[1,`) or several values without `-m` span several lines
    (exit 1): one line each. A sweep (`-m`) runs its jobs one after another, so a bad value in a later job
    (`eval.seq_len=1024,-5`) stopped the sweep only after the earlier jobs ran (hours on a real model): every job's config is
    composed and validated as its job would be (RunConfig), and checked against its model as its run would check it before
    profiling (pipeline.prepare: context, head_dim, export shapes, texts), before the first runs."""
    from itertools import product

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser, parsed = OverridesParser.create(), []
    for arg in (a for a in argv if "=" in a and not a.startswith(("-", "hydra.", "hydra/"))):
        try:
            parsed += parser.parse_overrides([arg])
        except HydraException as e:
            fail(f"{arg} cannot be parsed: {str(e).splitlines()[0]} (Hydra's override grammar: https://hydra.cc/docs/advanced/override_grammar/basic/)")
    multirun = bool({"-m", "--multirun"} & set(argv))
    for o in parsed:
        if o.is_sweep_override() and not multirun:
            fail(f"{o.input_line} gives several values: add -m to run one job per value, write a list as [a,b], or quote a string with commas")
        if o.is_sweep_override() and not o.is_discrete_sweep():
            fail(f"{o.input_line}: a sweep here takes values (a,b), range() or choice(); interval() needs an optimizing sweeper")
    try:  # each job's overrides as Hydra's basic sweeper forms them (quoting kept)
        choices = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override() else [o.input_line]
                   for o in parsed]
    except HydraException:
        return  # glob() of a key's values: Hydra's basic sweeper launches no job
    jobs = list(product(*choices))
    if len(jobs) < 2:
        return
    from hydra import compose, initialize_config_dir

    from kvcompress.config import to_run_config

    swept = [j for j, o in enumerate(parsed) if o.is_sweep_override()]

    def refuse(i: int, e: Exception) -> None:
        fail(f"sweep job {i} of {len(jobs)} ({' '.join(jobs[i - 1][j] for j in swept)}): {str(e).splitlines()[0] if str(e) else type(e).__name__}; no job was run")

    configs = []
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR), job_name="kvcompress"):
        for i, job in enumerate(jobs, 1):
            try:
                cfg = compose(config_name="config", overrides=list(job))
                configs.append(to_run_config(OmegaConf.to_container(cfg, resolve=True), {o.partition("=")[0].lstrip("+~") for o in job}))
            except (UserError, HydraException, OmegaConfBaseException) as e:
                refuse(i, e)
    # then what each job checks against its model before profiling (its context, head_dim, the export's shapes, the texts):
    # the jobs of one model together, each model loaded once and freed before the next; warnings are the job's to print
    import gc
    import logging

    import torch

    from kvcompress.hashing import memo_under
    from kvcompress.pipeline import model_key, prepare

    def free(models: dict) -> None:
        models.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    print(f"kvcompress: sweep of {len(jobs)} jobs: checking each job against its model before the first runs", flush=True)
    logger, models = logging.getLogger("kvcompress"), {}
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        for i in sorted(range(len(configs)), key=lambda i: model_key(configs[i])):
            if model_key(configs[i]) not in models:
                free(models)
            try:
                with memo_under(configs[i].cache_dir):
                    prepare(configs[i], None, progress=False, models=models)
            except UserError as e:
                refuse(i + 1, e)
    finally:
        logger.setLevel(level)
        free(models)  # the jobs load their own


def main() -> None:
    sys.unraisablehook = _unraisable
    check_overrides(sys.argv[1:])
    check_output_dir(sys.argv[1:])
    check_sweep(sys.argv[1:])
    hydra_main()


if __name__ == "__main__":
    main()
