"""The pipeline: run the selected stages over typed configs, writing artifacts into a run dir."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

from kvcompress.artifacts import atomic_write_json
from kvcompress.config import RunConfig
from kvcompress.data import load_texts
from kvcompress.hashing import obj_hash
from kvcompress.models import load_model, model_fingerprint
from kvcompress.provenance import base_provenance
from kvcompress.scalebook import ScaleBook
from kvcompress.stages.fit import fit
from kvcompress.stages.profile import profile
from kvcompress.stats import FORMAT_VERSION as STATS_VERSION
from kvcompress.stats import KVStats

log = logging.getLogger("kvcompress")

STATS_FILE = "kv_stats.safetensors"
SCALEBOOK_FILE = "scalebook.safetensors"


class Run:
    """Lazily loads what the stages need (the model only when a stage needs it)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, progress: bool = True):
        self.cfg, self.dir, self.progress = cfg, Path(run_dir), progress
        self._lm = None

    @property
    def lm(self):
        if self._lm is None:
            log.info("loading model %s", self.cfg.model.name)
            self._lm = load_model(self.cfg.model, self.cfg.cache_dir)
        return self._lm

    def stats_cache_path(self, texts) -> Path:
        c = self.cfg.calib
        key = obj_hash(
            {
                "format": STATS_VERSION,
                "model": model_fingerprint(self.cfg.model),
                "dtype": self.cfg.model.dtype,
                "text": texts.sha256,
                "calib": [c.n_samples, c.seq_len, c.seed, c.sample_tokens],
            }
        )
        return Path(self.cfg.cache_dir) / "stats" / f"{key[:32]}.safetensors"

    def profile(self) -> Path:
        out = self.dir / STATS_FILE
        texts = load_texts(self.cfg.calib)
        cached = self.stats_cache_path(texts)
        if cached.is_file():
            log.info("profile: reusing cached kv_stats %s (same model, calibration text and settings)", cached)
        else:
            self.cfg.kv.check_geometry(self.lm.geometry.head_dim)  # fail before profiling, not after
            stats = profile(self.lm, self.cfg.calib, texts, progress=self.progress)
            stats.save(cached)
        tmp = out.with_name(f".{out.name}.tmp")
        shutil.copyfile(cached, tmp)
        tmp.replace(out)
        log.info("profile: wrote %s", out)
        return out

    def fit(self, stats_path: Path) -> Path:
        stats = KVStats.load(stats_path)
        book = fit(stats, self.cfg.kv)
        out = self.dir / SCALEBOOK_FILE
        book.save(out)
        log.info("fit: wrote %s (%s)", out, book.fit_info.get("method"))
        return out

    def scalebook(self, path: Path) -> ScaleBook:
        return ScaleBook.load(path, self.lm.geometry.to_dict())


def needs_model(cfg: RunConfig) -> bool:
    return "validate" in cfg.stages or "export" in cfg.stages or ("profile" in cfg.stages and not cfg.stats)


def write_run_header(cfg: RunConfig, run_dir: Path) -> None:
    prov = base_provenance()
    if needs_model(cfg):
        prov["model_fingerprint"] = model_fingerprint(cfg.model)  # also validates model paths early
    atomic_write_json(run_dir / "config.json", cfg.model_dump(mode="json"))
    atomic_write_json(run_dir / "provenance.json", prov)


def run(cfg: RunConfig, run_dir: str | Path, progress: bool = True) -> dict[str, Path]:
    """Run cfg.stages in order; returns the artifact paths written."""
    run_dir = Path(run_dir)
    if "export" in cfg.stages:
        from kvcompress.stages.export import engine_status

        engine_status(cfg.export.build_engine)  # build_engine=always on a machine that cannot: fail first
    if needs_model(cfg):
        model_fingerprint(cfg.model)  # fail on a bad model path before anything is written
    run_dir.mkdir(parents=True, exist_ok=True)
    write_run_header(cfg, run_dir)
    r = Run(cfg, run_dir, progress)
    out: dict[str, Path] = {}
    stats_path = Path(cfg.stats) if cfg.stats else None
    if "profile" in cfg.stages and stats_path is None:
        stats_path = out["kv_stats"] = r.profile()
    if "fit" in cfg.stages:
        if stats_path is None:
            stats_path = r.dir / STATS_FILE
            if not stats_path.is_file():
                from kvcompress.errors import UserError

                raise UserError("stage fit needs kv_stats: add profile to stages or give stats=<path to kv_stats.safetensors>")
        out["scalebook"] = r.fit(stats_path)
    if "validate" in cfg.stages:
        from kvcompress.stages.validate import validate_run

        out |= validate_run(r, out.get("scalebook"))
    if "export" in cfg.stages:
        from kvcompress.stages.export import export_run

        out |= export_run(r, out.get("scalebook"), stats_path)
    return out
