"""memfit.integrations.transformers.MemfitTrainer under torchrun at W=2 on a tiny GPT-2: the
same losses as the plain Trainer with DDP, checkpoints saved and resumed through the Trainer.

Tolerance: losses to 1e-5 relative. Both runs are fp32 on the CPU with the same data on each
rank; only the order in which gradients are summed over ranks differs (DDP's all-reduce, memfit's
reduce-scatter), which AdamW turns into ~1e-7 differences in the weights after a few steps.
The resumed run must match the uninterrupted one exactly (same checkpointed state, same code).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import memfit

pytest.importorskip("accelerate")


def test_trainer_matches_ddp_and_resumes(tmp_path):
    exe = str(Path(sys.executable).parent / "torchrun")
    script = str(Path(__file__).with_name("_hf_trainer_run.py"))
    repo = str(Path(memfit.__file__).parents[1])
    path = os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = tmp_path / "result.json"
    cmd = [exe, "--standalone", "--nproc-per-node=2", script, str(result), str(tmp_path)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=400, env=env, cwd=repo)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(result.read_text())
    for rank, (ddp, mf, resumed) in enumerate(out["losses"]):
        assert len(ddp) == len(mf) == 4 and len(resumed) == 2, (rank, ddp, mf, resumed)
        assert mf == pytest.approx(ddp, rel=1e-5), rank
        assert resumed == mf[2:], rank
    assert out["resumed_params_equal"] and out["exported_params_equal"]
    assert "memfit" in out["files"] and "model.safetensors.index.json" in out["files"]
    assert {"scheduler.pt", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth"} <= set(out["files"])
