"""Calibration and evaluation text from the user's files (calib.paths, eval.paths): which files are read, how, and
what a bad entry says."""
import json

import pytest

from kvcompress.config import CalibConfig, EvalConfig
from kvcompress.data import load_texts
from kvcompress.errors import UserError


def test_txt_jsonl_and_suffixless_files_are_read(tmp_path):
    (tmp_path / "a.txt").write_text("alpha text")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "beta"}) + "\n\n" + json.dumps({"text": "gamma"}) + "\n")
    (tmp_path / "LICENSE").write_text("delta terms")  # no suffix: plain text, as .txt
    paths = [str(tmp_path / n) for n in ("a.txt", "b.jsonl", "LICENSE")]
    ts = load_texts(CalibConfig(name="files", source="files", paths=paths))
    assert ts.texts == ["alpha text", "beta", "gamma", "delta terms"] and ts.group == "calib"
    ev = load_texts(EvalConfig(name="files", source="files", paths=paths[2:]), "eval")
    assert ev.texts == ["delta terms"] and ev.group == "eval" and ev.sha256 != ts.sha256


@pytest.mark.parametrize("name,needle", [("data.csv", "eval.paths entry '{p}' has suffix '.csv'; allowed: .txt, .jsonl, or none (plain text)"),
                                         ("missing.txt", "eval.paths entry '{p}' does not exist")])
def test_bad_entries_name_their_group_and_value(tmp_path, name, needle):
    p = tmp_path / name
    if name.endswith(".csv"):
        p.write_text("a,b\n")
    with pytest.raises(UserError) as e:
        load_texts(EvalConfig(name="files", source="files", paths=[str(p)]), "eval")
    assert str(e.value) == needle.format(p=p)


def test_overlap_note_says_when_windows_cannot_be_disjoint():
    from kvcompress.data import overlap_note

    assert overlap_note(320, 2, 160, "eval") is None
    note = overlap_note(319, 2, 160, "eval")
    assert note.startswith("eval: 2 windows of 160 tokens overlap (the text has 319 tokens, fewer than 320)")
