"""Model fingerprints hash every byte of every weight file (stats=, ScaleBooks and the per-machine caches are keyed and
checked by them); a large file's hash is remembered per machine until the file changes."""
import hashlib
import logging
import os

import pytest

from kvcompress import hashing
from kvcompress.errors import UserError
from kvcompress.hashing import MEMO_MIN, dir_fingerprint, file_fingerprint, legacy_dir_fingerprint


def _big_model(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    big = model / "model-00001-of-00002.safetensors"
    with big.open("wb") as f:
        f.truncate(MEMO_MIN + 4096)  # sparse: no disk used
    (model / "model-00002-of-00002.safetensors").write_bytes(b"small")
    return model, big


def _rewrite_middle(big):
    with big.open("r+b") as f:  # a fine-tune merged into some projections of a shard: bytes far from both ends
        f.seek(MEMO_MIN // 2)
        f.write(b"merged")


def test_a_change_in_the_middle_of_a_large_weight_file_changes_the_fingerprint(tmp_path, monkeypatch):
    """Before, a file over 1 GiB was hashed by its size and first and last 16 MiB: a checkpoint rewritten in place with
    the change between them kept its fingerprint (cached kv_stats reused, old books accepted). Now the whole file."""
    monkeypatch.setenv("KVCOMPRESS_CACHE", str(tmp_path / "cache"))
    model, big = _big_model(tmp_path)
    fp, dfp, legacy = file_fingerprint(big), dir_fingerprint(model), legacy_dir_fingerprint(model)
    assert fp == hashlib.sha256(bytes(MEMO_MIN + 4096)).hexdigest()
    _rewrite_middle(big)
    assert legacy_dir_fingerprint(model) == legacy  # what the old hash could not see
    assert file_fingerprint(big) != fp and dir_fingerprint(model) != dfp
    small = model / "model-00002-of-00002.safetensors"
    assert file_fingerprint(small) == hashlib.sha256(b"small").hexdigest()


def test_a_large_file_is_hashed_once_per_machine_until_it_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMPRESS_CACHE", str(tmp_path / "cache"))
    _, big = _big_model(tmp_path)
    fp = file_fingerprint(big)
    assert len(list((tmp_path / "cache" / "hashes").iterdir())) == 1
    reads = []
    real = hashing._sha256
    monkeypatch.setattr(hashing, "_sha256", lambda p, size: reads.append(p) or real(p, size))
    assert file_fingerprint(big) == fp and reads == []  # remembered
    st = big.stat()
    _rewrite_middle(big)
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with its modification time put back (the change time moves)
    assert file_fingerprint(big) != fp and reads == [big]
    # a cache directory that cannot be written: hashed each time, no error
    monkeypatch.setenv("KVCOMPRESS_CACHE", str(big / "not_a_dir"))
    assert file_fingerprint(big) == file_fingerprint(big) and len(reads) == 3


def test_books_and_stats_fingerprinted_by_the_old_edge_hash_are_accepted_with_a_warning(tmp_path, monkeypatch, caplog):
    """ScaleBooks and kv_stats made before whole-file hashing carry the edge hash of a model with a file over 1 GiB: still
    accepted for that model (with a warning saying what that hash could not see); another model's are refused."""
    import kvcompress.pipeline as pipeline

    monkeypatch.setenv("KVCOMPRESS_CACHE", str(tmp_path / "cache"))
    model, _ = _big_model(tmp_path)
    monkeypatch.setattr(pipeline, "legacy_fingerprint", lambda cfg: legacy_dir_fingerprint(model))
    now = dir_fingerprint(model)
    with caplog.at_level(logging.WARNING, logger="kvcompress"):
        pipeline.check_profiled_on({"name": "m", "sha256": legacy_dir_fingerprint(model)}, now, "m", "scalebook b", model_cfg=object())
    assert "profiled by an older kvcompress" in caplog.text and "scalebook b" in caplog.text
    pipeline.check_profiled_on({"name": "m", "sha256": now}, now, "m", "scalebook b", model_cfg=object())
    with pytest.raises(UserError, match="was profiled on model other"):
        pipeline.check_profiled_on({"name": "other", "sha256": "0" * 64}, now, "m", "scalebook b", model_cfg=object())


def test_legacy_fingerprint_of_model_configs(tmp_path, monkeypatch):
    """models.legacy_fingerprint: None where the old and new fingerprints agree (no file over 1 GiB, tiny models)."""
    from types import SimpleNamespace

    from kvcompress.models import hf_dir, legacy_fingerprint

    monkeypatch.setenv("KVCOMPRESS_CACHE", str(tmp_path / "cache"))
    model, big = _big_model(tmp_path)
    monkeypatch.setattr(hf_dir, "check_dir", lambda cfg: cfg.path)
    assert legacy_fingerprint(SimpleNamespace(source="hf_dir", path=model)) == legacy_dir_fingerprint(model)
    big.unlink()
    assert legacy_fingerprint(SimpleNamespace(source="hf_dir", path=model)) is None
    assert legacy_fingerprint(SimpleNamespace(source="tiny")) is None


def test_a_run_remembers_hashes_under_its_cache_dir(tmp_path, monkeypatch):
    """cache_dir= moves the whole per-machine cache of a run, large files' hashes too (they went to the default cache
    directory, which may not be writable where cache_dir= was given for that reason); outside a run: the default."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from conftest import ROOT
    from kvcompress import pipeline
    from kvcompress.config import to_run_config

    monkeypatch.setenv("KVCOMPRESS_CACHE", str(tmp_path / "default"))
    monkeypatch.setattr(hashing, "MEMO_MIN", -1)  # every file hashed is remembered: the run's books and statistics
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["model=tiny_llama", "calib=smoke", "eval=smoke", "export=none", "stages=[profile,fit,validate]",
                                           "eval.tasks.names=[]", f"cache_dir={tmp_path / 'c'}"])
    pipeline.run(to_run_config(OmegaConf.to_container(cfg, resolve=True)), tmp_path / "run", progress=False)
    assert list((tmp_path / "c" / "hashes").iterdir()) and not (tmp_path / "default" / "hashes").exists()
    f = tmp_path / "f"
    f.write_bytes(b"x")
    hashing.file_fingerprint(f)
    assert len(list((tmp_path / "default" / "hashes").iterdir())) == 1
    with hashing.memo_under(tmp_path / "elsewhere"):
        hashing.file_fingerprint(f)
    assert (tmp_path / "elsewhere" / "hashes").is_dir()
