"""The pipeline: run the selected stages over typed configs, writing artifacts into a run dir."""
from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

from kvcompress.artifacts import atomic_write_json
from kvcompress.config import RunConfig
from kvcompress.data import EVAL_IS_CALIB, load_texts, text_ids, token_windows
from kvcompress.errors import UserError
from kvcompress.eval.attention import check_supported
from kvcompress.eval.tasks.base import FACT_GAP
from kvcompress.hashing import fingerprint_match, memo_under, obj_hash, warn_legacy
from kvcompress.models import legacy_fingerprint, load_model, model_fingerprint
from kvcompress.paths import check_cache_dir
from kvcompress.provenance import base_provenance
from kvcompress.scalebook import ScaleBook
from kvcompress.stages.fit import fit
from kvcompress.stages.profile import profile
from kvcompress.stats import FORMAT_VERSION as STATS_VERSION
from kvcompress.stats import KVStats

log = logging.getLogger("kvcompress")

STATS_FILE = "kv_stats.safetensors"
SCALEBOOK_FILE = "scalebook.safetensors"
TUNE_FILE = "tune.json"


class Run:
    """Lazily loads what the stages need (the model only when a stage needs it)."""

    def __init__(self, cfg: RunConfig, run_dir: Path | None, progress: bool = True):  # None: a sweep's job checked ahead (prepare)
        self.cfg, self.dir, self.progress = cfg, (Path(run_dir) if run_dir is not None else None), progress
        self._lm = None
        self.baseline = None  # metrics.Baseline kept by validate for export's re-measurement

    @property
    def lm(self):
        if self._lm is None:
            log.info("loading model %s", self.cfg.model.name)
            lm = load_model(self.cfg.model, self.cfg.cache_dir)
            check_supported(lm.model, self.cfg.model.name)  # before any work on a model whose cache or attention cannot be simulated
            self._lm = lm
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
        link_or_copy(cached, out)
        log.info("profile: %s -> %s (the per-machine statistics cache)", out, cached)
        return out

    def book_paths(self) -> dict[str, Path]:
        """{role: path} of the ScaleBooks of this run: the kv format and the native fallbacks."""
        return {role: self.dir / (SCALEBOOK_FILE if role == "primary" else f"scalebook.{spec.name}.safetensors")
                for role, spec in self.cfg.validated_specs().items()}

    def fit(self, stats_path: Path) -> dict[str, Path]:
        from kvcompress.stages.validate import REPORT_FILE

        stats = KVStats.load(stats_path)
        paths = self.book_paths()
        if (self.dir / REPORT_FILE).is_file() and "validate" not in self.cfg.stages:  # export then refuses them (check_validated)
            log.warning("fit: %s in %s measured the ScaleBooks fit now rewrites: run validate again before reading it or exporting",
                        REPORT_FILE, self.dir)
        for role, spec in self.cfg.validated_specs().items():
            if spec.is_auto:
                continue  # kv=auto: the tune stage chooses and fits the per-layer formats
            book = fit(stats, spec)
            book.save(paths[role])
            log.info("fit: wrote %s (%s, %s)", paths[role], spec.name, book.fit_info.get("method"))
        return paths

    def tune(self, stats_path: Path) -> dict[str, Path]:
        from kvcompress.stages.tune import tune

        book, record = tune(self.lm, KVStats.load(stats_path), self.cfg.kv, self.cfg.tune, self.cfg.eval, self.cfg.calib, self.progress)
        path = self.book_paths()["primary"]
        book.save(path)
        atomic_write_json(self.dir / TUNE_FILE, record)
        log.info("tune: wrote %s and %s", path, self.dir / TUNE_FILE)
        return {"scalebook": path, "tune": self.dir / TUNE_FILE}

    def scalebook(self, path: Path) -> ScaleBook:
        book = ScaleBook.load(path, self.lm.geometry.to_dict())
        check_profiled_on(book.profiled("model"), self.lm.identity.get("sha256"), self.cfg.model.name, f"scalebook {path}", self.cfg.model)
        return book


def check_profiled_on(profiled: dict | None, fingerprint: str | None, name: str, what: str, model_cfg=None) -> None:
    """Refuse statistics (or a ScaleBook fitted from them) profiled on another model than the run's: its scales would be
    validated and shipped for a model they were never measured on (a geometry check passes between models of one shape).
    `profiled`: the model record of their provenance (profile's lm.identity); `fingerprint`: the run's model's. Files
    profiled before weight files were hashed whole carry the legacy fingerprint of a model with a file over 1 GiB
    (models.legacy_fingerprint of `model_cfg`): accepted with a warning, as that hash saw only each file's edges."""
    theirs = (profiled or {}).get("sha256")
    if not (theirs and fingerprint):
        return
    match = fingerprint_match(theirs, fingerprint, None if model_cfg is None else lambda: legacy_fingerprint(model_cfg))
    if match == "legacy":
        warn_legacy(what, f"this run's model {name}")
    if not match:
        raise UserError(f"{what} was profiled on model {profiled.get('name', '?')} (fingerprint {theirs[:12]}), not on this run's model {name} "
                        f"(fingerprint {fingerprint[:12]}): profile this model (drop stats= / add profile and fit to stages)")


def note_stats_calib(cfg: RunConfig) -> None:
    """stats= replaces profiling, so the run's calib settings are not used (config.json still records them): warned when they
    differ from those the statistics were profiled with (their provenance, which the report carries)."""
    theirs = KVStats.load(cfg.stats).header.get("provenance", {}).get("calib") or {}
    mine = {"n_samples": cfg.calib.n_samples, "seq_len": cfg.calib.seq_len, "seed": cfg.calib.seed}
    diff = [f"calib.{k}={v} (profiled with {theirs[k]})" for k, v in mine.items() if k in theirs and theirs[k] != v]
    try:
        texts = load_texts(cfg.calib)
    except UserError:
        texts = None  # files this run would not read anyway
    if texts is not None and theirs.get("sha256") and texts.sha256 != theirs["sha256"]:
        diff.append(f"calibration text {texts.origin} (profiled on {theirs.get('origin', 'other text')})")
    if diff:
        log.warning("stats=%s replaces profiling, so this run's calibration settings are not used: %s", cfg.stats, "; ".join(diff))


def check_books_are_the_config(cfg: RunConfig, book_paths: dict[str, Path]) -> None:
    """Validate or export without fit reads the run directory's ScaleBooks: each must hold the format the config names for its
    role, or the run validates and ships one format while its config.json records another (stages=[validate] kv=int4 in a
    directory fitted for int8k_asym_rotv validated int8k_asym_rotv and rewrote config.json to int4). A format tune chooses
    (kv=auto, rot_split, int8k_budget) is not compared field by field: its book must hold a per-layer choice tune made for it."""
    for role, spec in cfg.validated_specs().items():
        path = book_paths[role]
        if not path.is_file():
            continue
        theirs = ScaleBook.load(path).spec
        if spec.is_auto:
            if not (theirs.is_mixed and theirs.name == spec.name):
                raise UserError(f"{path} holds kv={theirs.name}" + (" (per-layer)" if theirs.is_mixed else "") + f", not the per-layer formats the "
                                f"tune stage chooses for this run's kv={spec.name}: add fit and tune to stages")
            continue
        if theirs != spec:
            mine, old = _flat(spec.model_dump(mode="json")), _flat(theirs.model_dump(mode="json"))
            diff = [f"{k}: {old.get(k)!r} there, {mine.get(k)!r} here" for k in sorted(mine.keys() | old.keys()) if mine.get(k) != old.get(k) and k != "kv.name"]
            which = f"kv={spec.name}" if role == "primary" else f"{spec.name} ({role})"
            held = f"holds kv={theirs.name}, not this run's {which}" if theirs.name != spec.name else f"was fitted with other settings than this run's {which}"
            raise UserError(f"{path} {held} ({'; '.join(diff[:3])}{'; ...' if len(diff) > 3 else ''}): add fit to stages to refit it, "
                            "or give the settings it was fitted with")


def _flat(d: dict, prefix: str = "kv") -> dict:
    """A nested dict as {"kv.key.bits": 8, ...}."""
    out = {}
    for k, v in d.items():
        out |= _flat(v, f"{prefix}.{k}") if isinstance(v, dict) else {f"{prefix}.{k}": v}
    return out


def link_or_copy(src: Path, dst: Path) -> None:
    """Put `src` at `dst` without duplicating its bytes: a hard link (survives the cache being
    cleared), else a symbolic link, else a copy; atomically (temp name, then rename)."""
    tmp = dst.with_name(f".{dst.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        tmp.hardlink_to(src)
    except OSError:
        try:
            tmp.symlink_to(Path(src).resolve())
        except OSError:
            shutil.copyfile(src, tmp)
    tmp.replace(dst)
    tmp.unlink(missing_ok=True)  # dst already a hard link of src (a rerun in the same directory): rename(2) does nothing then


def needs_model(cfg: RunConfig) -> bool:
    return any(s in cfg.stages for s in ("validate", "export", "tune")) or ("profile" in cfg.stages and not cfg.stats)


def check_formats(cfg: RunConfig, lm) -> None:
    """Every format the run fits (the kv format, its native fallbacks, eval.compare) applies to the model's head_dim, and a
    fold the user forced (kv.fold_*=true) is one the model can take: what profile and fit would refuse, before profiling
    and before the run directory exists."""
    for role, spec in cfg.validated_specs().items():
        try:
            spec.check_geometry(lm.geometry.head_dim)
        except UserError as e:
            raise (e if role == "primary" else UserError(f"{spec.name} (validated beside kv={cfg.kv.name}: {role}): {e}")) from None
    if cfg.kv.is_native and True in (cfg.kv.fold_keys, cfg.kv.fold_values, cfg.kv.fold_pairs):
        from kvcompress.stages.fit import check_fold_flags
        from kvcompress.stages.profile import fold_obstacles, key_norm, rope_pairs_of

        check_fold_flags(cfg.kv, fold_obstacles(lm.model), rope_pairs_of(lm.model, lm.geometry), key_norm(lm.model, lm.geometry))


def check_context(cfg: RunConfig, max_position: int) -> None:
    """Refuse, before profiling, a sequence the run would feed the model past its context (max_position_embeddings):
    positions it was not trained or configured for, and past where asymmetric static keys' ranges hold
    (kv.key.max_position, the model's by default). A task sample of eval.tasks.lengths feeds that many tokens, its answer
    included (eval.tasks.base.assemble), so a task at the full context scores nothing past it. Validation windows and task prompts past
    a validated format's kv.key.max_position (positions its asymmetric key ranges were fitted for) are refused as well."""
    lengths = []
    if "profile" in cfg.stages and not cfg.stats:
        lengths.append(("calib.seq_len", cfg.calib.seq_len))
    if "tune" in cfg.stages:
        lengths.append(("tune.seq_len", cfg.tune.seq_len))
    if {"validate", "export"} & set(cfg.stages):
        lengths.append(("eval.seq_len", cfg.eval.seq_len))
    if "validate" in cfg.stages and cfg.eval.tasks.names:
        lengths += [("eval.tasks.lengths", n) for n in cfg.eval.tasks.lengths]
    for key, n in lengths:
        if n > max_position:
            raise UserError(f"{_past(key, n)} model {cfg.model.name}'s context "
                            f"(max_position_embeddings={max_position}): use at most {max_position}")
    for spec in cfg.validated_specs().values():  # a format whose asymmetric key ranges hold at fewer positions (kv.key.max_position)
        limit = spec.key.max_position
        if limit and limit > max_position:  # allowed (a context extended past the config's, e.g. by RoPE scaling), but it costs precision
            log.warning("kv.key.max_position=%d (%s) is past model %s's context (max_position_embeddings=%d): its asymmetric key ranges "
                        "cover positions the model is not configured for, wider than they need be", limit, spec.name, cfg.model.name, max_position)
        for key, n in lengths if limit and limit < max_position else ():
            if key.startswith("eval") and n > limit:
                raise UserError(f"{_past(key, n)} kv.key.max_position={limit}, "
                                f"the positions {spec.name}'s asymmetric key ranges hold at: validate at most {limit} or raise kv.key.max_position")


def _past(key: str, n: int) -> str:
    """The start of check_context's refusal: "eval.tasks.lengths contains 9000, past" / "eval.seq_len=9000 is past"."""
    return f"{key} contains {n}, past" if key.endswith("lengths") else f"{key}={n} is past"


def check_texts(cfg: RunConfig, tokenizer, held_out) -> None:
    """Before profiling, what validate would find wrong with the held-out text `held_out` (None: no validate or export):
    too few tokens for one window (token_windows' error), or a task length too short for its prompt's facts to sit before
    every fp16 window (eval.tasks.base.assemble's error; the estimate before the model loads lets some through).
    Tokenizing the text is cheap beside profiling."""
    if held_out is None:
        return
    ids = text_ids(tokenizer, held_out)
    token_windows(tokenizer, held_out, 1, cfg.eval.seq_len, ids=ids)
    if "validate" in cfg.stages and cfg.eval.tasks.names:
        from kvcompress.eval.retrieval import task_samples

        task_samples(tokenizer, ids, cfg.eval.tasks, cfg.task_window())


def write_run_header(cfg: RunConfig, run_dir: Path) -> None:
    prov = base_provenance()
    if needs_model(cfg):
        prov["model_fingerprint"] = model_fingerprint(cfg.model)  # also validates model paths early
    atomic_write_json(run_dir / "config.json", cfg.model_dump(mode="json"))
    atomic_write_json(run_dir / "provenance.json", prov)


def model_key(cfg: RunConfig) -> str:
    """Runs with the same key load the same model (prepare's `models`)."""
    return json.dumps([cfg.model.model_dump(mode="json"), str(cfg.cache_dir)], sort_keys=True)


def prepare(cfg: RunConfig, run_dir: Path | None, progress: bool = True, models: dict | None = None) -> Run:
    """Everything run() checks before the run directory exists (and before profiling): bad paths, text, model, formats,
    context, export. `run_dir` None: a sweep's job checked before the sweep's first job runs (kvcompress.__main__.check_sweep;
    the job's directory is Hydra's to make), the checks of an earlier run's directory left to the job. `models`: loaded
    models by model config, shared by the jobs of a sweep that use one model."""
    if needs_model(cfg) or "profile" in cfg.stages:  # converted weights and statistics are cached there
        check_cache_dir(cfg.cache_dir)
    if "export" in cfg.stages:
        from kvcompress.targets.route import engine_status

        engine_status(cfg.export.build_engine)  # build_engine=always on a machine that cannot: fail first
    if cfg.stats:
        note_stats_calib(cfg)
    if needs_model(cfg):
        fingerprint = model_fingerprint(cfg.model)  # fail on a bad model path before anything is written
        if cfg.stats:  # and on statistics of another model, before it loads
            check_profiled_on(KVStats.load(cfg.stats).header.get("provenance", {}).get("model"), fingerprint, cfg.model.name, f"stats={cfg.stats}", cfg.model)
    calib = load_texts(cfg.calib) if "profile" in cfg.stages and not cfg.stats else None  # and on bad text files, before the model loads
    held_out = load_texts(cfg.eval, "eval") if {"validate", "export"} & set(cfg.stages) else None
    if calib is not None and held_out is not None and calib.sha256 == held_out.sha256:  # validate's check (stages.validate), before profiling
        raise UserError(EVAL_IS_CALIB)
    if "validate" in cfg.stages and cfg.eval.tasks.names:  # the exact minimum depends on the tokenizer (eval.tasks.base.assemble)
        need = (window := cfg.task_window()) + FACT_GAP
        short = [n for n in cfg.eval.tasks.lengths if n <= need]
        if short:
            which = " (the largest kv=auto may choose from tune.windows)" if cfg.tunes_layout and window in cfg.tune.windows else ""
            raise UserError(f"eval.tasks.lengths contains {short[0]}: task prompts must be longer than the fp16 window{which} + {FACT_GAP} "
                            f"({need} tokens) so their facts are read from the compressed store; give longer lengths or eval.tasks.names=[]")
    r = Run(cfg, run_dir, progress)
    if run_dir is not None and needs_model(cfg) and not {"fit", "tune"} & set(cfg.stages):  # validate or export an earlier run's books: of this model and this config?
        missing = [path.name for path in r.book_paths().values() if not path.is_file()]
        if missing and "validate" in cfg.stages:  # was found after profiling (hours on a large model)
            raise UserError(f"stage validate needs the run's ScaleBooks and {run_dir} has no {', '.join(missing)}: add "
                            f"{'fit and tune' if cfg.tunes_layout else 'fit'} to stages, or give hydra.run.dir=<the run directory that fitted them>")
        for path in r.book_paths().values():
            if path.is_file():
                check_profiled_on(ScaleBook.load(path).profiled("model"), fingerprint, cfg.model.name, f"scalebook {path}", cfg.model)
        check_books_are_the_config(cfg, r.book_paths())
    if run_dir is not None and "export" in cfg.stages and "validate" not in cfg.stages:  # export into an earlier run's directory: its report and books, before the model loads
        from kvcompress.stages.export import check_validated

        check_validated(run_dir, {} if "fit" in cfg.stages else r.book_paths())
    if needs_model(cfg):
        key = model_key(cfg)
        if models is not None and key in models:
            r._lm = models[key]
        _ = r.lm  # loaded (and checked: eval.attention.check_supported) before the run directory exists
        if models is not None:
            models[key] = r.lm
        check_formats(cfg, r.lm)  # what each format itself refuses, before what the export cannot carry
    if "export" in cfg.stages:
        from kvcompress.targets.route import check_exportable, disk_warning, hf_only, tp_advice
        from kvcompress.targets.trtllm_ckpt import check_tp

        check_exportable(r.lm.model, cfg.kv, cfg.export.dtype)  # before anything is written; the model is needed by validate and export anyway
        for tp in ([] if hf_only(r.lm.model) else cfg.export.tp_sizes):  # and the tensor-parallel sizes the model's shapes allow
            check_tp(r.lm.geometry, tp, r.lm.model.config)
        # and, before hours of profiling, whether each GPU can hold its share of the weights and the disk the checkpoints
        n_params = sum(p.numel() for p in r.lm.model.parameters())  # a streamed model's skeleton counts as well
        if not hf_only(r.lm.model) and (advice := tp_advice(2 * n_params, cfg.export.tp_sizes, cfg.export.gpu_memory_gb, r.lm.geometry, r.lm.model.config)):
            log.warning("export: %s (estimated at 2 bytes a parameter; FP8 weights kept as stored take half)", advice)
        if run_dir is not None and (disk := disk_warning(run_dir, n_params, cfg.export.tp_sizes, hf_only(r.lm.model))):
            log.warning("export: %s", disk)
    if needs_model(cfg):
        check_context(cfg, r.lm.geometry.max_position)
        if cfg.tunes_layout:  # kv=auto's menu at this head_dim (the tune stage's check)
            from kvcompress.stages.tune import applicable_menu

            applicable_menu(cfg.kv, cfg.tune.menu, r.lm.geometry.head_dim, warn=False)
        check_texts(cfg, r.lm.tokenizer, held_out)
    if "validate" in cfg.stages:  # what validate will note, said before profiling (the run goes on: the verdict still holds, on few positions)
        from kvcompress.stages.validate import few_compressed_positions

        for spec in cfg.validated_specs().values():
            if not (spec is cfg.kv and cfg.tunes_layout) and (few := few_compressed_positions(spec, cfg.eval.seq_len)):
                log.warning("%s: %s", "ahead of validate" if cfg.stats or "profile" not in cfg.stages else "before profiling", few)
    return r


def run(cfg: RunConfig, run_dir: str | Path, progress: bool = True) -> dict[str, Path]:
    """Run cfg.stages in order; returns the artifact paths written. Ends with a console summary. Large files' hashes are
    remembered under the run's cache_dir (hashing.memo_under)."""
    with memo_under(cfg.cache_dir):
        return _run(cfg, Path(run_dir), progress)


def _run(cfg: RunConfig, run_dir: Path, progress: bool) -> dict[str, Path]:
    r = prepare(cfg, run_dir, progress)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_run_header(cfg, run_dir)
    out: dict[str, Path] = {}
    times: dict[str, float] = {}
    stats_path = Path(cfg.stats) if cfg.stats else None

    def timed(stage, fn):
        t0 = time.time()
        res = fn()
        times[stage] = round(time.time() - t0, 1)
        log.info("%s: %.1f s", stage, times[stage])
        return res

    if "profile" in cfg.stages and stats_path is None:
        stats_path = out["kv_stats"] = timed("profile", r.profile)
    if "fit" in cfg.stages:
        if stats_path is None:
            stats_path = r.dir / STATS_FILE
            if not stats_path.is_file():
                raise UserError("stage fit needs kv_stats: add profile to stages or give stats=<path to kv_stats.safetensors>")
        out |= timed("fit", lambda: {"scalebook": r.fit(stats_path).get("primary")})
    if "tune" in cfg.stages:
        if stats_path is None:
            stats_path = r.dir / STATS_FILE
        if not stats_path.is_file():
            raise UserError("stage tune needs kv_stats: add profile to stages or give stats=<path to kv_stats.safetensors>")
        out |= timed("tune", lambda: r.tune(stats_path))
    if "validate" in cfg.stages:
        from kvcompress.stages.validate import validate_run

        out |= timed("validate", lambda: validate_run(r, r.book_paths()))
    if "export" in cfg.stages:
        from kvcompress.stages.export import export_run

        out |= timed("export", lambda: export_run(r, r.book_paths()))
    finish(r, times)
    return out


def finish(r: Run, times: dict[str, float]) -> None:
    """Record the stage times in report.json (re-rendering the report) and print the closing summary."""
    report = r.dir / "report.json"
    data = json.loads(report.read_text()) if report.is_file() else None
    if data is not None:
        from kvcompress.report_schema import Report
        from kvcompress.stages.report import export_notes, gpu_memory_lines, write_report_files

        data["stage_times_s"] = times
        atomic_write_json(report, data)
        stats = r.dir / STATS_FILE
        write_report_files(Report.model_validate(data), r.dir, stats if stats.is_file() else None)
    lines = ["", "=" * 78, f"kvcompress run {r.dir}"]
    lines.append("stage times: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()) + f" (total {sum(times.values()):.0f} s)")
    if data is not None:
        lines.append(f"verdict {data['kv']['name']} (primary, {data['verdict_basis'] and ', '.join(data['verdict_basis']) or 'no gates'}): {data['verdict'].upper()}")
        for fb in data.get("fallbacks", []):
            what = "compared, not shipped" if fb["role"].startswith("compare:") else f"{fb['tier']} fallback for {fb['role']}_ckpt"
            lines.append(f"verdict {fb['name']} ({what}): {fb['verdict'].upper()}")
        ex = data.get("export")
        if ex:
            lines.append(f"exported to {r.dir / 'export'}:")
            for name, art in ex.get("artifacts", {}).items():
                lines.append(f"  {name}: {art['what']}")
            lines += [f"  NOTE {head}: {text}" for head, text, loud in export_notes(ex) if loud]  # served otherwise than validated
            lines += [f"  {line}" for line in gpu_memory_lines(ex)]  # what each GPU must hold
            for name, why in ex.get("not_written", {}).items():
                lines.append(f"  {name}: not written ({why})")
            if ex.get("text_decoder_only"):
                lines.append(f"  text decoder only: {ex['text_decoder_only']}")
            if ex.get("next_step_custom_tier_on_gpu_host"):  # the run's own format, validated as primary
                lines.append(f"custom tier ({data['kv']['name']}) on a GPU host: {ex['next_step_custom_tier_on_gpu_host']}")
            lines.append(f"on a GPU host: {ex.get('next_step_on_gpu_host')}")
            if ex.get("check_on_gpu_host"):
                lines.append(f"serve-path check on a GPU host: {ex['check_on_gpu_host']}")
            lines.append(f"operator fallback (fp16 KV, same weights): {ex.get('fallback_fp16_kv')}")
        lines.append(f"report: {r.dir / 'report.html'}")
    lines.append("=" * 78)
    for line in lines:
        log.info(line)
