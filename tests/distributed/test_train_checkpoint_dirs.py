"""memfit train's checkpoint directory, run as users run it (`python -m memfit train`, four
processes in all): --resume auto falls back past damaged checkpoints, naming them, and ends
bitwise equal to the uninterrupted run; a fresh run refuses the directory; --overwrite starts
afresh there, under a new run id, and --keep-last keeps only its newest checkpoint."""

import json
import os

from tests.distributed.test_train import memfit_train, read

STEPS = ["--steps", "8", "--save-every", "2"]


def run_id(path):
    with open(path / "memfit.json") as f:
        return json.load(f)["extra"]["run"]["id"]


def test_resume_skips_damaged_checkpoints_and_reruns_refuse(tmp_path):
    ck = tmp_path / "ck"
    memfit_train("--checkpoint-dir", str(ck), *STEPS, "--json", str(tmp_path / "whole.json"))
    names = ["step-00000002", "step-00000004", "step-00000006", "step-00000008"]
    assert sorted(os.listdir(ck)) == names
    first = run_id(ck / names[0])
    assert all(run_id(ck / n) == first for n in names)
    # Damage the two newest: a flipped byte in step 8's tensors, step 6's metadata truncated
    data = sorted(f for f in os.listdir(ck / names[3]) if f.endswith(".distcp"))[0]
    with open(ck / names[3] / data, "r+b") as f:
        f.seek(os.path.getsize(ck / names[3] / data) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    with open(ck / names[2] / ".metadata", "r+b") as f:
        f.truncate(10)
    resumed = memfit_train("--checkpoint-dir", str(ck), *STEPS, "--resume", "auto", "--json", str(tmp_path / "r.json"))
    out = resumed.stdout
    assert f"skipped checkpoint '{ck / names[3]}'" in out and "is corrupt" in out, out
    assert f"skipped checkpoint '{ck / names[2]}'" in out and "corrupt or not a memfit checkpoint" in out, out
    assert f"resumed from step 4 ({ck / names[1]})" in out, out
    whole, rest = read(tmp_path / "whole.json"), read(tmp_path / "r.json")
    assert [e["step"] for e in rest["log"]] == [5, 6, 7, 8]
    assert [e["loss"] for e in rest["log"]] == [e["loss"] for e in whole["log"][4:]]
    assert rest["params_sha256"] == whole["params_sha256"]  # bitwise: the same run, continued
    assert all(run_id(ck / n) == first for n in names)  # the damaged ones replaced by the same run

    # A fresh run into the directory refuses, naming it and the two ways on
    refused = memfit_train("--checkpoint-dir", str(ck), *STEPS, check=False)
    assert refused.returncode == 2, refused.stderr[-2000:]
    err = refused.stderr
    assert f"--checkpoint-dir '{ck}' holds another run's checkpoints" in err, err
    assert f"run {first}: steps [2, 4, 6, 8]" in err and "--resume" in err and "--overwrite" in err, err
    assert sorted(os.listdir(ck)) == names  # untouched

    # --overwrite starts afresh under a new run id; --keep-last 1 keeps only its newest
    memfit_train("--checkpoint-dir", str(ck), "--steps", "4", "--save-every", "2", "--keep-last", "1", "--overwrite")
    assert os.listdir(ck) == ["step-00000004"]
    assert run_id(ck / "step-00000004") != first
