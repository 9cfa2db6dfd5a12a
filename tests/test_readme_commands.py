"""Every `python -m kvcompress ...` command the README and docs show passes the command-line check
(known presets, known keys of the chosen preset): what the README documents, the tool accepts. Its links resolve."""
import re
import shlex
from pathlib import Path

import pytest

import kvcompress.__main__ as cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "plugins" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def commands():
    out = []
    for doc in DOCS:
        for m in re.finditer(r"python -m kvcompress((?: [^\n`#]*)?)", doc.read_text()):
            # placeholders (<time>, ...) stand for a user's paths: keep the rest of the command
            args = [a for a in shlex.split(m.group(1)) if "=" in a and not any(p in a for p in ("<", ">", "..."))]
            out.append((doc.name, " ".join(args)))
    return sorted(set(out))


def test_the_docs_show_commands():
    assert len(commands()) >= 12


@pytest.mark.parametrize("doc,cmd", commands(), ids=[c for _, c in commands()])
def test_documented_command_is_accepted(doc, cmd, capsys):
    try:
        cli.check_overrides(cmd.split())
    except SystemExit:
        pytest.fail(f"{doc}: `python -m kvcompress {cmd}` is refused: {capsys.readouterr().err.strip()}")


def test_the_check_refuses_an_undocumented_key(capsys):
    with pytest.raises(SystemExit):
        cli.check_overrides(["kv=native_fp8", "kv.nope=1"])
    assert "kv.nope is not a known key" in capsys.readouterr().err


# mentions that look like config keys but are not: a report.json field and file names
NOT_KEYS = {"export.artifacts.plugin_bundle.network.check", "model.safetensors.index.json", "export.md"}


def documented_keys():
    text = "".join(d.read_text() for d in DOCS)
    found = set(re.findall(r"(?<![\w.+~/])((?:kv|eval|calib|model|export)\.[a-z_]+(?:\.[a-z_]+)*)(?=[=`\s,)])", text))
    return sorted(found - NOT_KEYS)


@pytest.mark.parametrize("key", documented_keys())
def test_documented_key_can_be_set_on_the_command_line(key, capsys):
    # a key the docs name (`kv.headroom`, `eval.compare`, ...) is settable with at least one preset of its group
    from kvcompress.paths import preset_names

    group = key.split(".")[0]
    for preset in preset_names(group):
        try:
            cli.check_overrides([f"{group}={preset}", f"{key}=1"])
            return
        except SystemExit:
            capsys.readouterr()
    pytest.fail(f"{key} is documented but no {group} preset accepts it on the command line")


def documented_flags():
    """{script path or -m module: flags the docs pass it}, for the project's own scripts and modules."""
    out: dict[str, set] = {}
    text = "".join(d.read_text() for d in DOCS)
    for m in re.finditer(r"python (-m kvcompress\.[a-z_.]+|(?:scripts|export)/[a-z_]+\.py)([^\n`#|]*)", text):
        out.setdefault(m.group(1), set()).update(re.findall(r"(?<!\S)(--[a-z][a-z0-9-]*)", m.group(2)))
    return {k: v for k, v in sorted(out.items()) if v}


def test_documented_flags_exist():
    import subprocess
    import sys

    flags = documented_flags()
    assert len(flags) >= 6
    for target, wanted in flags.items():
        p = subprocess.run([sys.executable, *target.split(), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, (target, p.stderr[-2000:])
        missing = [f for f in wanted if f not in p.stdout]
        assert not missing, f"python {target}: the docs pass {missing}, which its --help does not list"


def test_readme_lists_every_preset():
    from kvcompress.paths import CONF_DIR

    text = (ROOT / "README.md").read_text()
    i = text.index("Hydra groups in `conf/`:")
    listed = dict(re.findall(r"`(\w+)=([\w|]+)`", text[i : text.index("\n\n", i)]))
    assert {g: set(v.split("|")) for g, v in listed.items()} == \
        {g.name: {p.stem for p in g.glob("*.yaml")} for g in CONF_DIR.iterdir() if g.is_dir() and g.name in cli.GROUPS}


def _anchors(doc: Path):
    """GitHub's heading anchors of a markdown file: lower case, punctuation but '-' and '_' dropped, spaces as '-',
    a repeated heading suffixed -1, -2, ...; headings inside code blocks are not headings."""
    seen: dict[str, int] = {}
    for m in re.finditer(r"^#{1,6} (.+)$", re.sub(r"```.*?```", "", doc.read_text(), flags=re.S), re.M):
        s = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower().replace("`", "")).replace(" ", "-")
        seen[s] = seen.get(s, -1) + 1
        yield s if not seen[s] else f"{s}-{seen[s]}"


def test_doc_links_resolve():
    """Every relative link of the README and the docs names a file that exists and, with '#', a heading in it."""
    broken, n = [], 0
    for doc in [*DOCS, ROOT / "export" / "TRTLLM_API_CHECK.md"]:
        for m in re.finditer(r"\]\(([^)\s]+)\)", re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)):
            if re.match(r"[a-z]+:", m.group(1)):
                continue  # http(s):, mailto:
            n += 1
            file, _, frag = m.group(1).partition("#")
            target = (doc.parent / file) if file else doc
            if not target.exists() or (frag and target.suffix == ".md" and frag not in set(_anchors(target))):
                broken.append(f"{doc.relative_to(ROOT)}: {m.group(1)}")
    assert n >= 15 and not broken, broken
    assert {"quick-start", "pointing-it-at-a-real-model", "what-the-report-means"} <= set(_anchors(ROOT / "README.md"))
    assert {"per-model-tuning-kvauto", "per-model-keyvalue-split-kvrot_split"} <= set(_anchors(ROOT / "docs" / "tuning.md"))
