"""memfit.integrations.transformers.MemfitTrainer under torchrun at W=2 on a tiny GPT-2: the
same losses as the plain Trainer with DDP, checkpoints saved and resumed through the Trainer.

Tolerance: losses to 1e-5 relative. Both runs are fp32 on the CPU with the same data on each
rank; only the order in which gradients are summed over ranks differs (DDP's all-reduce, memfit's
reduce-scatter), which AdamW turns into ~1e-7 differences in the weights after a few steps.
The resumed run must match the uninterrupted one exactly (same checkpointed state, same code).
"""

import json
from pathlib import Path

import pytest

from tests._dist import torchrun


def test_trainer_matches_ddp_and_resumes(tmp_path):
    result = tmp_path / "result.json"
    script = str(Path(__file__).with_name("_hf_trainer_run.py"))
    proc = torchrun(script, str(result), str(tmp_path), env={"TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(result.read_text())
    for rank, (ddp, mf, resumed) in enumerate(out["losses"]):
        assert len(ddp) == len(mf) == 4 and len(resumed) == 2, (rank, ddp, mf, resumed)
        # 4 steps in fp32, DDP's all-reduce vs memfit's reduce-scatter: sum order only
        assert mf == pytest.approx(ddp, rel=1e-5), rank
        assert resumed == mf[2:], rank
    assert out["resumed_params_equal"] and out["exported_params_equal"]
    assert "memfit" in out["files"] and "model.safetensors.index.json" in out["files"]
    assert {"scheduler.pt", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth"} <= set(out["files"])
