"""memfit.integrations.lightning.MemfitStrategy with real Lightning under torchrun at W=2 on
the CPU: the same losses as Lightning's DDP strategy, blocks checkpointed, sharded checkpoints
saved by ModelCheckpoint and resumed with fit(ckpt_path=...).

Tolerance: losses to 1e-5 relative (fp32, same data per rank; only the order of the gradient
sum over ranks differs, and gradient clipping's norm). The resumed run must match the
uninterrupted one exactly.
"""

import json
from pathlib import Path

import pytest

from tests._dist import torchrun


def test_strategy_matches_ddp_and_resumes(tmp_path):
    result = tmp_path / "result.json"
    script = str(Path(__file__).with_name("_lightning_run.py"))
    proc = torchrun(script, str(result), str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(result.read_text())
    for rank, (ddp, mf, resumed) in enumerate(out["losses"]):
        assert len(ddp) == len(mf) == 4 and len(resumed) == 2, (rank, ddp, mf, resumed)
        # 4 steps in fp32, DDP's all-reduce vs memfit's reduce-scatter: sum order only
        assert mf == pytest.approx(ddp, rel=1e-5), rank
        assert resumed == mf[2:], rank
    assert out["resumed_params_equal"]
    assert out["units"] == ["<root LitLM>", "net.blocks.0", "net.blocks.1"]
    assert out["checkpointed"] == [[0] * 4, [2] * 4]  # memfit: both blocks wait to be recomputed in backward
    assert out["saved"] == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"]
    assert {"lightning.pt", "memfit.json", ".metadata"} <= set(out["files"])
