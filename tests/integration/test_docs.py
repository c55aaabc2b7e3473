"""Every code block of README.md and docs/*.md, run as written.

A ```python block runs as a script in an empty directory, in a fresh interpreter (this one,
with this checkout first on the path). An HTML comment on the line before a block changes how:

    <!-- test: torchrun N -->       run it on N gloo ranks: python -m torch.distributed.run
                                    --standalone --nproc-per-node N block.py
    <!-- test: skip REASON -->      not run; the page must say why (e.g. it needs a GPU). The
                                    skipped blocks are counted against EXPECTED_SKIPS.
    <!-- test: run -->              a ```sh block that is run (bash, set -e); `python` and
                                    `memfit` are this interpreter and this checkout
    <!-- test: walkthrough -->      the same for the train/resume/export walkthrough, whose
                                    output is checked line by line below

A ```sh block without a marker is shown, not run (installs, make targets, multi-node launches).
The design-notes page is checked against the `# [Note: ...]` blocks in the code.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import memfit

ROOT = Path(memfit.__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:^<!-- test: (?P<marker>[^>]*?) -->\n)?^```(?P<lang>\w*)\n(?P<code>.*?)^```$", re.S | re.M)
EXPECTED_SKIPS: dict[str, int] = {}  # page -> number of python blocks skipped by a marker
NOTE = re.compile(r"^\s*# \[Note: ([^\]]+)\]\s*$", re.M)


def _blocks():
    for page in PAGES:
        text = page.read_text()
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start("code"))  # the block's first line of code, 1-based
            yield page.relative_to(ROOT).as_posix(), line, m.group("lang"), m.group("marker") or "", m.group("code")


BLOCKS = list(_blocks())
PYTHON = [b for b in BLOCKS if b[2] == "python"]
SHELL = [b for b in BLOCKS if b[2] == "sh" and b[3] in ("run", "walkthrough")]


def _env(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, command in (("python", ""), ("memfit", " -m memfit")):  # scripts: a venv's python stays in it
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}"{command} "$@"\n')
        (bin_dir / name).chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }


def _run(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    proc = subprocess.run(
        argv, check=False, cwd=work, env=_env(tmp_path), capture_output=True, text=True, timeout=600,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.mark.parametrize(("page", "line", "lang", "marker", "code"), PYTHON, ids=[f"{b[0]}:{b[1]}" for b in PYTHON])
def test_python_block(page, line, lang, marker, code, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code)
    if marker.startswith("skip"):
        pytest.skip(f"{page}:{line}: {marker}")
    if marker.startswith("torchrun "):
        n = int(marker.split()[1])
        _run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", str(script)],
            tmp_path,
        )
    else:
        assert not marker, f"{page}:{line}: unknown marker {marker!r}"
        _run([sys.executable, str(script)], tmp_path)


@pytest.mark.parametrize(("page", "line", "lang", "marker", "code"), SHELL, ids=[f"{b[0]}:{b[1]}" for b in SHELL])
def test_shell_block(page, line, lang, marker, code, tmp_path):
    out = _run(["bash", "-c", "set -e\n" + code], tmp_path).stdout
    if marker == "walkthrough":
        work = tmp_path / "work"
        assert "saved checkpoint step 20 (ck/step-00000020)" in out
        assert "resumed from step 20 (ck/step-00000020)" in out
        assert "step 30/30" in out and "eval at step 30 | val loss" in out
        assert "exported safetensors to my-model-trained" in out
        assert sorted(os.listdir(work / "ck")) == ["step-00000020", "step-00000030"]  # --keep-last 2
        assert out.rstrip().splitlines()[-1].startswith("def")  # the exported model generated text


def test_markers_are_known_and_skips_counted():
    skips: dict[str, int] = {}
    for page, line, lang, marker, _ in BLOCKS:
        if lang == "python":
            assert marker == "" or marker.startswith(("torchrun ", "skip ")), f"{page}:{line}: {marker!r}"
            if marker.startswith("skip "):
                skips[page] = skips.get(page, 0) + 1
        else:
            assert marker in ("", "run", "walkthrough"), f"{page}:{line}: {marker!r} on a {lang or 'plain'} block"
    assert skips == EXPECTED_SKIPS
    assert sum(1 for b in BLOCKS if b[3] == "walkthrough") == 1


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines"
    first = next(i for i, s in enumerate(lines) if s.startswith("```python"))
    assert first < 40, f"the first python block starts at line {first + 1}"


def test_api_reference_lists_every_public_name():
    page = (ROOT / "docs" / "api.md").read_text()
    listed = set(re.findall(r"^::: memfit\.(\w+)$", page, re.M))
    missing = sorted(set(memfit.__all__) - listed)
    assert not missing, f"docs/api.md has no '::: memfit.NAME' for {missing}"


def test_design_notes_index_matches_the_code():
    in_code = {}
    for path in sorted((ROOT / "memfit").rglob("*.py")):
        for title in NOTE.findall(path.read_text()):
            in_code[title] = path.relative_to(ROOT).as_posix()
    page = (ROOT / "docs" / "design-notes.md").read_text()
    listed = dict(re.findall(r"^\| \[Note: ([^\]]+)\] \| `([^`]+)` \|", page, re.M))
    assert listed == in_code


def test_site_builds_strict(tmp_path):
    """`make docs` in one test: broken links, anchors and API references fail mkdocs' strict mode."""
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (make docs installs it)")
    pytest.importorskip("mkdocstrings")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        check=False, cwd=ROOT, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
