"""memfit train as a 2-node job on one machine: two torchrun launchers (2 ranks each, --max-restarts
3) meeting through the c10d rendezvous on 127.0.0.1, hybrid sharding (a shard group per "node"),
checkpoints. One node is killed (its launcher and ranks) after two checkpoints and its launcher is
started again alone; the other launcher stays up: its ranks fail on their next collective, its
agent restarts them, the two agents meet in the next rendezvous round, and the job resumes from
the last checkpoint and ends with the parameters of an uninterrupted run.

The launchers run with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1. Without it (torch 2.13, where sharing
the rendezvous TCPStore with the ranks is the default) the new round never completes: the
surviving rank-0 agent keeps the bootstrap info of round 0 and does not publish MASTER_ADDR /
MASTER_PORT under the new round's store prefix (torch/distributed/elastic/rendezvous/
dynamic_rendezvous.py:1209, DynamicRendezvousHandler.next_rendezvous, rebuilds it only when
``self._bootstrap_store_info is None or (rank == 0 and self._shared_tcp_store_server is None)``),
while the restarted node, building its info for the first time, blocks in
RendezvousStoreInfo.build (rendezvous/api.py:102, ``store.get(MASTER_ADDR_KEY)``) and never writes
its ``torchelastic/role_info`` key that the rank-0 agent waits for in _assign_worker_ranks:
DistStoreError after 60 s on ``/torch.rendezvous.<run id>.1/MASTER_ADDR``. With the variable set,
every round's rank 0 publishes a fresh MASTER_ADDR/MASTER_PORT (and the ranks form their group on
a store of their own rather than the agent's, whose key prefix counts restarts per agent:
pytorch/pytorch#135712).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import memfit
from memfit.testing import free_port

TINY = ["--layers", "2", "--hidden", "32", "--seq", "16", "--batch", "4", "--lr", "1e-3", "--hybrid-shards", "2"]
STEPS = 30


def _env():
    path = os.pathsep.join(filter(None, [str(Path(memfit.__file__).parents[1]), os.environ.get("PYTHONPATH")]))
    # a group that lost a node fails within 20 s instead of waiting for the default timeout
    return {
        **os.environ,
        "PYTHONPATH": path,
        "OMP_NUM_THREADS": "1",
        "MEMFIT_PG_TIMEOUT": "20",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }


def _torchrun(*args):
    return [str(Path(sys.executable).parent / "torchrun"), *args]


def launcher(node_rank, port, *flags):
    """One node's launcher: torchrun --nnodes 2 --nproc-per-node 2 with the c10d rendezvous."""
    cmd = _torchrun(
        "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node_rank), "--max-restarts", "3",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "memfit-test",
        "--rdzv-conf", f"is_host={node_rank == 0}",  # node 0 hosts the rendezvous store, as a head node
        "-m", "memfit", "train", *TINY, "--steps", str(STEPS), *flags,
    )  # fmt: skip
    return subprocess.Popen(
        cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def kill_node(proc):
    """SIGKILL the launcher and every process under it (torchrun starts its ranks in their own
    sessions, so killing its process group would leave them running): a node going down."""
    tree, found = [proc.pid], True
    while found:
        found = False
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) not in tree:
                try:
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                if ppid in tree:
                    tree.append(int(entry.name))
                    found = True
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def finish(proc, what, timeout=400):
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{out[:3000]}\n...\n{out[-3000:]}"
    return out


def test_a_killed_node_rejoins_the_surviving_launcher(tmp_path):
    # The uninterrupted run: the same 2 x 2 layout from one launcher.
    ref = subprocess.run(
        _torchrun("--standalone", "--nproc-per-node", "4", "-m", "memfit", "train", *TINY, "--steps", str(STEPS),
                  "--json", str(tmp_path / "whole.json")),
        env=_env(), capture_output=True, text=True, timeout=400, check=False,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    ck = tmp_path / "ck"
    flags = ["--checkpoint-dir", str(ck), "--save-every", "3", "--resume", "auto", "--json", str(tmp_path / "run.json")]
    port = free_port()
    node0 = launcher(0, port, *flags)  # hosts the rendezvous store; stays up throughout
    node1 = launcher(1, port, *flags)
    deadline = time.monotonic() + 300
    while len([d for d in ck.glob("step-*") if "." not in d.name]) < 2:  # two checkpoints: kill node 1
        assert node0.poll() is None and node1.poll() is None, "a launcher ended before the kill"
        assert time.monotonic() < deadline, "no second checkpoint within 300 s"
        time.sleep(0.2)
    kill_node(node1)
    node1 = launcher(1, port, *flags)  # the node comes back: a new launcher, same endpoint and run id
    out1 = finish(node1, "restarted node 1")
    out0 = finish(node0, "node 0 (its agent restarted its ranks)")
    whole, run = json.loads((tmp_path / "whole.json").read_text()), json.loads((tmp_path / "run.json").read_text())
    assert run["world_size"] == whole["world_size"] == 4
    # node 0's launcher never stopped: its agent saw its ranks fail and started them again (which
    # node's ranks log depends on the new round's node order: the rendezvous sorts nodes by pid)
    assert "failed (exitcode" in out0, out0[-3000:]
    assert "resumed from step" in out0 + out1
    assert run["log"][-1]["step"] == STEPS and run["log"][0]["step"] > 1  # the last attempt resumed
    assert [e["loss"] for e in run["log"]] == [e["loss"] for e in whole["log"][run["log"][0]["step"] - 1 :]]
    assert run["params_sha256"] == whole["params_sha256"]
