"""What docs/checkpoint-guarantees.md promises about saves and exports: a kill at every step of
a save (with and without RENAME_EXCHANGE) and of an export leaves the previous version whole,
or the new one; a full disk (a 1 MiB tmpfs, and a writer failing with ENOSPC) and a read-only
directory give an error naming the path, leave no partial files and the previous version whole.

One process (tests/distributed/_checkpoint_kills.py) runs every trial, each in forks of itself
that really die (os._exit at the step); each test here reports one trial.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import memfit
from tests.distributed import _checkpoint_kills as kills

TRIALS = (
    [f"save-killed-at-{s}" for s in kills.SAVE_STEPS]
    + [f"save-fallback-killed-at-{s}" for s in kills.FALLBACK_STEPS]
    + [f"async-save-killed-at-{s}" for s in kills.SAVE_STEPS]
    + [f"export-killed-at-{s}" for s in kills.EXPORT_STEPS]
    + ["writer-fails-with-enospc", "async-writer-fails", "full-tmpfs", "read-only"]
)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("kills")
    path = os.pathsep.join(filter(None, [str(Path(memfit.__file__).parents[1]), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.distributed._checkpoint_kills", str(root)],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"},
        cwd=str(Path(memfit.__file__).parents[1]),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((root / "report.json").read_text())


@pytest.mark.parametrize("trial", TRIALS)
def test_previous_version_survives(report, trial):
    if trial in report["skipped"]:
        pytest.skip(report["skipped"][trial])
    assert trial in report, sorted(report)
    assert report[trial] is None, report[trial]
