"""benchmarks/gpu/_memsnap.py's reduction of an allocator snapshot to what was live at the
peak, on hand-made snapshots in the format torch.cuda.memory._snapshot documents."""

import sys
from pathlib import Path

import torch

import memfit

sys.path.insert(0, str(Path(memfit.__file__).resolve().parents[1]))

from benchmarks.gpu import _memsnap
from benchmarks.gpu._env import Env

MIB = 2**20
LINEAR = [
    {"filename": "/x/site-packages/torch/_C/whatever.py", "line": 1, "name": "inner"},
    {"filename": "/x/site-packages/torch/nn/modules/linear.py", "line": 134, "name": "forward"},
    {"filename": "/repo/benchmarks/gpu/bert.py", "line": 90, "name": "step"},
]
ADAM = [{"filename": "/x/site-packages/torch/optim/adamw.py", "line": 50, "name": "_init_group"}]


def _snapshot() -> dict:
    """A 8 MiB weight (before recording) and a 4 MiB block freed during it, then the step:
    two 2 MiB activations and a 1 MiB one (the peak: 8 + 2 + 2 + 1 = 13 MiB, the old 4 MiB
    block already freed), the activations freed, a 3 MiB optimizer state kept; a second
    20 MiB segment reserved for the activations."""
    a, b, c, state = 0x1000000, 0x1200000, 0x1400000, 0x1600000
    trace = [
        {"action": "free_requested", "addr": 0x800000, "size": 4 * MIB, "stream": 0, "frames": []},
        {"action": "free_completed", "addr": 0x800000, "size": 4 * MIB, "stream": 0, "frames": []},
        {"action": "segment_alloc", "addr": a, "size": 20 * MIB, "stream": 0, "frames": []},
        {"action": "alloc", "addr": a, "size": 2 * MIB, "stream": 0, "frames": LINEAR},
        {"action": "alloc", "addr": b, "size": 2 * MIB, "stream": 0, "frames": LINEAR},
        {"action": "alloc", "addr": c, "size": MIB, "stream": 0, "frames": LINEAR[2:]},
        {"action": "free_completed", "addr": a, "size": 2 * MIB, "stream": 0, "frames": []},
        {"action": "free_completed", "addr": b, "size": 2 * MIB, "stream": 0, "frames": []},
        {"action": "free_completed", "addr": c, "size": MIB, "stream": 0, "frames": []},
        {"action": "alloc", "addr": state, "size": 3 * MIB, "stream": 0, "frames": ADAM},
        {"action": "oom", "size": 1, "stream": 0, "device_free": 0, "frames": []},  # no addr: ignored
    ]
    segments = [
        {
            "device": 0,
            "address": 0,
            "total_size": 16 * MIB,
            "stream": 0,
            "segment_type": "large",
            "allocated_size": 8 * MIB,
            "active_size": 8 * MIB,
            "blocks": [
                {"size": 8 * MIB, "requested_size": 8 * MIB, "address": 0, "state": "active_allocated", "frames": []},
                {"size": 8 * MIB, "requested_size": 0, "address": 8 * MIB, "state": "inactive", "frames": []},
            ],
        },
        {
            "device": 0,
            "address": a,
            "total_size": 20 * MIB,
            "stream": 0,
            "segment_type": "large",
            "allocated_size": 3 * MIB,
            "active_size": 3 * MIB,
            "blocks": [
                {"size": 3 * MIB, "requested_size": 3 * MIB, "address": state, "state": "active_allocated"},
                {"size": 17 * MIB, "requested_size": 0, "address": a, "state": "inactive"},
            ],
        },
        {"device": 1, "address": 0, "total_size": 99 * MIB, "blocks": []},  # another device: not counted
    ]
    return {"segments": segments, "device_traces": [trace, []]}


def test_the_peak_is_found_by_replaying_the_trace_and_its_blocks_are_grouped():
    s = _memsnap.peak_summary(_snapshot())
    assert s["allocated_at_start"] == 12 * MIB  # the weight and the block freed early
    assert s["allocated_at_peak"] == 13 * MIB and s["peak_event"] == 5 and s["live_blocks_at_peak"] == 4
    groups = {(g["size"], g["frame"]): (g["count"], g["bytes"]) for g in s["groups"]}
    assert groups == {
        (8 * MIB, _memsnap.BEFORE): (1, 8 * MIB),
        (2 * MIB, "torch/nn/modules/linear.py:134 forward"): (2, 4 * MIB),
        (MIB, "benchmarks/gpu/bert.py:90 step"): (1, MIB),
    }
    assert [g["bytes"] for g in s["groups"]] == [8 * MIB, 4 * MIB, MIB]  # largest first
    assert sum(g["bytes"] for g in s["by_frame"]) == 13 * MIB
    seg = s["segments_at_peak"]
    assert (seg["segments"], seg["reserved"], seg["allocated"]) == (2, 36 * MIB, 13 * MIB)
    assert seg["most_unallocated"][0] == {"size": 20 * MIB, "allocated": 5 * MIB, "unallocated": 15 * MIB}


def test_groups_past_top_are_summed_and_an_empty_trace_is_the_final_state():
    s = _memsnap.peak_summary(_snapshot(), top=1)
    assert len(s["groups"]) == 1
    assert s["groups_left_out"] == {"groups": 2, "count": 3, "bytes": 5 * MIB}
    final = _snapshot() | {"device_traces": [[]]}
    s = _memsnap.peak_summary(final)
    assert s["allocated_at_peak"] == 11 * MIB and s["peak_event"] == -1 and s["trace_entries"] == 0
    assert s["segments_at_peak"]["reserved"] == 36 * MIB


def test_frame_labels_prefer_the_model_memfit_and_torch_nn():
    assert _memsnap.frame_label(LINEAR) == "torch/nn/modules/linear.py:134 forward"
    assert _memsnap.frame_label([{"filename": "/a/b.py", "line": 3, "name": "f"}]) == "/a/b.py:3 f"
    assert _memsnap.frame_label([]) == _memsnap.NO_FRAME
    memfit_frame = [{"filename": "/w/memfit/_checkpoint/_function.py", "line": 7, "name": "unpack"}]
    assert _memsnap.frame_label(memfit_frame) == "memfit/_checkpoint/_function.py:7 unpack"


def test_on_the_cpu_recording_is_skipped_and_says_so(tmp_path):
    env = Env(device=torch.device("cpu"), smoke=True, out=tmp_path, repo=tmp_path)
    calls = []
    out = _memsnap.record_peak(env, lambda: calls.append(1), "t")
    assert "skipped" in out and "CUDA" in out["skipped"] and not calls
    assert not (tmp_path / "fixtures").exists()
