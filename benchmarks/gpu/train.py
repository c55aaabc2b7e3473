"""Part f: ``memfit train --device cuda --steps 20 --async-save`` on the gpt2-small preset
(smoke: the tiny gpt2 preset on the CPU), resumed once.

Run 1 trains 20 steps, saving at steps 10 and 20 in the background (``--async-save``: the
path the first run never took, where the staged host copy went back to the GPU). The step-20
checkpoint is then deleted and run 2 resumes from step 10 to 20. Goals: both exit 0, run 2 logs
steps 11-20, and its losses
match run 1's (bitwise reported; goal: relative 1e-5, since some CUDA kernels, such as the
embedding's backward, accumulate in a nondeterministic order) and final parameter digests
are reported.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.gpu._env import Env, goal


def memfit_train(env: Env, *args: str) -> tuple[int, str]:
    path = os.pathsep.join(filter(None, [str(env.repo), os.environ.get("PYTHONPATH")]))
    shape = ["--layers", "1", "--hidden", "32", "--seq", "16", "--batch", "2"] if env.smoke else ["--batch", "8"]
    model = "gpt2" if env.smoke else "gpt2-small"
    cmd = [sys.executable, "-m", "memfit", "train", "--model", model, "--device", env.device.type, *shape, *args]
    proc = subprocess.run(
        cmd,
        cwd=env.repo,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return proc.returncode, (proc.stdout + proc.stderr)[-2500:]


def run(env: Env) -> dict:
    steps = 2 if env.smoke else 20
    half = steps // 2
    with tempfile.TemporaryDirectory(prefix="memfit-gpu-train-") as tmp:
        ck = Path(tmp) / "ck"
        common = ["--steps", str(steps), "--checkpoint-dir", str(ck), "--save-every", str(half), "--async-save"]
        rc1, out1 = memfit_train(env, *common, "--json", f"{tmp}/whole.json")
        shutil.rmtree(ck / f"step-{steps:08d}", ignore_errors=True)
        rc2, out2 = memfit_train(env, *common, "--resume", "--json", f"{tmp}/rest.json")
        whole = json.loads(Path(f"{tmp}/whole.json").read_text()) if rc1 == 0 else {"log": []}
        rest = json.loads(Path(f"{tmp}/rest.json").read_text()) if rc2 == 0 else {"log": []}
    tail = {e["step"]: e["loss"] for e in whole["log"] if e["step"] > half}
    resumed = {e["step"]: e["loss"] for e in rest["log"]}
    worst = max((abs(resumed[s] - tail[s]) / abs(tail[s]) for s in tail if s in resumed), default=None)
    figures = {
        "returncodes": [rc1, rc2],
        "whole_losses": [e["loss"] for e in whole["log"]],
        "resumed_steps": sorted(resumed),
        "resumed_losses": [resumed[s] for s in sorted(resumed)],
        "bitwise_losses": resumed == tail and bool(tail),
        "max_rel_loss_diff": worst,
        "params_sha256": [whole.get("params_sha256"), rest.get("params_sha256")],
        "peak_bytes": [e.get("peak_bytes") for e in whole["log"]][:3],
        "tails": {"run": out1 if rc1 else "", "resume": out2 if rc2 else ""},
    }
    goals = [
        goal("train and resume exit 0", None, "0, 0", rc1 == 0 and rc2 == 0),
        goal(
            "resumed steps",
            len(resumed),
            f"steps {half + 1}-{steps}",
            sorted(resumed) == list(range(half + 1, steps + 1)),
        ),
        goal("resumed losses vs whole run", worst, "<= 1e-5 relative", worst is not None and worst <= 1e-5),
    ]
    md = [
        f"- `memfit train --model {'gpt2 (tiny)' if env.smoke else 'gpt2-small --batch 8'} --device "
        f"{env.device.type} --steps {steps} --async-save` saved at {half} and {steps}; resumed from {half}: exit codes "
        f"{rc1}, {rc2}; losses bitwise {figures['bitwise_losses']}, max relative difference {worst}; "
        f"parameter digests equal: {figures['params_sha256'][0] == figures['params_sha256'][1]}",
    ]
    return {"figures": figures, "goals": goals, "markdown": md}
