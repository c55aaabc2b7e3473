"""The README's walkthrough, run as written: text -> tokenizer.json -> config.json -> train ->
resume -> export -> from_pretrained. `python` and `memfit` are this interpreter and this checkout."""

import os
import re
import subprocess
import sys
from pathlib import Path

import memfit

ROOT = Path(memfit.__file__).parents[1]
BLOCK = re.compile(r"<!-- walkthrough:begin -->\n```sh\n(.*?)```\n<!-- walkthrough:end -->", re.S)


def test_readme_walkthrough_runs(tmp_path):
    block = BLOCK.search((ROOT / "README.md").read_text())
    assert block, "README.md has no walkthrough block"
    bin_dir, work = tmp_path / "bin", tmp_path / "work"
    bin_dir.mkdir()
    work.mkdir()
    for name, command in (("python", ""), ("memfit", " -m memfit")):  # scripts: a venv's python stays in it
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}"{command} "$@"\n')
        (bin_dir / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1",
    }
    proc = subprocess.run(
        ["bash", "-c", "set -e\n" + block.group(1)],
        check=False, cwd=work, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "saved checkpoint step 20 (ck/step-00000020)" in out
    assert "resumed from step 20 (ck/step-00000020)" in out
    assert "step 30/30" in out and "eval at step 30 | val loss" in out
    assert "exported safetensors to my-model-trained" in out
    assert sorted(os.listdir(work / "ck")) == ["step-00000020", "step-00000030"]  # --keep-last 2
    assert out.rstrip().splitlines()[-1].startswith("def")  # the exported model generated text
