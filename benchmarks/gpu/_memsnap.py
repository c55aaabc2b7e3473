"""What was live at the caching allocator's peak during one step, from the allocator's own
history (``torch.cuda.memory._record_memory_history`` / ``_snapshot``), reduced on the device
to a small JSON fixture CPU sessions can read: why the planner's forecast and
``max_memory_allocated`` differ, block by block.

:func:`peak_summary` is a pure function over a snapshot dict (the format
``torch.cuda.memory._snapshot`` documents) and is tested on the CPU with hand-made snapshots
(tests/unit/test_gpu_memsnap.py). :func:`record_peak` records one step on CUDA; it has not run
on a GPU yet, and it never raises: a failure comes back as ``{"error": ...}``.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

MAX_ENTRIES = 400_000  # allocator events kept (a ring): a BERT-large step makes tens of thousands
TOP_GROUPS = 150  # (size, frame) groups kept in the fixture; the rest are summed as one
TOP_SEGMENTS = 20  # segments with the most reserved-but-unallocated bytes at the peak
BEFORE = "<allocated before the recorded step>"
NO_FRAME = "<no python frame>"
# Frames that say which code asked for a block, innermost first wins: the model, memfit, the
# benchmark, torch's modules, optimizers, checkpointing, sharding, autograd's entry points.
INTERESTING = (
    "/memfit/",
    "/transformers/",
    "/benchmarks/",
    "/torch/nn/",
    "/torch/optim/",
    "/torch/utils/checkpoint",
    "/torch/distributed/",
    "/torch/autograd/",
    "/torch/_tensor.py",
)


# [Note: The allocator's peak from its trace]
# The snapshot holds the segments' blocks as they are when it is taken and, per device, the
# trace of allocator events since recording began (a ring of ``max_entries``). The blocks live
# when the trace starts are found by undoing the trace from the end: an ``alloc`` in the trace
# was not live before it, a ``free_completed`` was (memory counts as allocated until its free
# completes, as ``memory_allocated`` counts it). Replaying forward from that state gives the
# allocated bytes after each event; the first event where they are highest is the peak, and
# a second replay up to it gives the live blocks and the segments there. The same undo and
# replay over ``segment_alloc``/``segment_free`` (``segment_map``/``segment_unmap`` with
# expandable segments) gives the reserved bytes at the peak. When the ring overflowed
# (``truncated``), the reconstruction starts at the oldest event kept, and a peak before it
# is missed.


def frame_label(frames: list[dict]) -> str:
    """``file:line function`` of the innermost interesting frame (INTERESTING), the file cut to
    what follows ``site-packages/`` or the repository's folder names."""
    for f in frames or []:
        name = f.get("filename", "")
        if any(key in name for key in INTERESTING):
            return f"{_short(name)}:{f.get('line', 0)} {f.get('name', '')}"
    if frames:
        f = frames[0]
        return f"{_short(f.get('filename', '?'))}:{f.get('line', 0)} {f.get('name', '')}"
    return NO_FRAME


def _short(filename: str) -> str:
    if "site-packages/" in filename:
        return filename.rsplit("site-packages/", 1)[1]
    for root in ("/memfit/", "/benchmarks/"):
        if root in filename:
            return root.strip("/") + "/" + filename.rsplit(root, 1)[1]
    return filename


def _initial_state(snapshot: dict, device: int, trace: list[dict]) -> tuple[dict, dict]:
    """Live blocks {addr: (size, frames)} and segments {addr: size} when the trace begins."""
    blocks, segments = {}, {}
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:
            continue
        segments[seg["address"]] = seg["total_size"]
        for b in seg.get("blocks", []):
            if b["state"] in ("active_allocated", "active_awaiting_free"):
                blocks[b["address"]] = (b["size"], b.get("frames", []))
    for e in reversed(trace):
        action = e["action"]
        if action == "alloc":
            blocks.pop(e["addr"], None)
        elif action == "free_completed":
            blocks[e["addr"]] = (e["size"], None)  # None: live before the recorded step
        elif action in ("segment_alloc", "segment_map"):
            _shrink(segments, e["addr"], e["size"])
        elif action in ("segment_free", "segment_unmap"):
            segments[e["addr"]] = segments.get(e["addr"], 0) + e["size"]
    return {a: (s, None) for a, (s, _) in blocks.items()}, segments


def _shrink(segments: dict, addr: int, size: int) -> None:
    left = segments.get(addr, 0) - size
    if left > 0:
        segments[addr] = left
    else:
        segments.pop(addr, None)


def _apply(e: dict, blocks: dict, segments: dict) -> None:
    action = e["action"]
    if action == "alloc":
        blocks[e["addr"]] = (e["size"], e.get("frames", []))
    elif action == "free_completed":
        blocks.pop(e["addr"], None)
    elif action in ("segment_alloc", "segment_map"):
        segments[e["addr"]] = segments.get(e["addr"], 0) + e["size"]
    elif action in ("segment_free", "segment_unmap"):
        _shrink(segments, e["addr"], e["size"])


def peak_summary(snapshot: dict, device: int = 0, top: int = TOP_GROUPS) -> dict:
    """The live blocks at the trace's allocated peak, grouped by (block size, frame_label),
    with counts and bytes (largest first, ``top`` kept, the rest summed), per frame label, and
    the segments' reserved against allocated bytes there. See [Note: The allocator's peak from
    its trace]."""
    traces = snapshot.get("device_traces") or []
    trace = [e for e in (traces[device] if device < len(traces) else []) if "addr" in e]
    blocks, segments = _initial_state(snapshot, device, trace)
    allocated = sum(s for s, _ in blocks.values())
    start_allocated, peak, peak_at = allocated, allocated, -1  # -1: the peak is the state at the start
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            allocated += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in blocks:
            allocated -= blocks[e["addr"]][0]
        _apply(e, blocks, {})
        if allocated > peak:
            peak, peak_at = allocated, i
    blocks, segments = _initial_state(snapshot, device, trace)
    for e in trace[: peak_at + 1]:
        _apply(e, blocks, segments)
    groups: dict[tuple[int, str], list[int]] = {}
    by_frame: dict[str, list[int]] = {}
    for size, frames in blocks.values():
        label = BEFORE if frames is None else frame_label(frames)
        for key, table in (((size, label), groups), (label, by_frame)):
            entry = table.setdefault(key, [0, 0])  # type: ignore[index]
            entry[0] += 1
            entry[1] += size
    ranked = sorted(groups.items(), key=lambda kv: (-kv[1][1], kv[0]))
    rest = ranked[top:]
    return {
        "trace_entries": len(trace),
        "peak_event": peak_at,
        "allocated_at_start": start_allocated,
        "allocated_at_peak": peak,
        "live_blocks_at_peak": len(blocks),
        "groups": [{"size": s, "frame": label, "count": c, "bytes": b} for (s, label), (c, b) in ranked[:top]],
        "groups_left_out": {
            "groups": len(rest),
            "count": sum(c for _, (c, _) in rest),
            "bytes": sum(b for _, (_, b) in rest),
        },
        "by_frame": [
            {"frame": label, "count": c, "bytes": b}
            for label, (c, b) in sorted(by_frame.items(), key=lambda kv: -kv[1][1])
        ][:top],
        "segments_at_peak": _segments(blocks, segments),
    }


def _segments(blocks: dict, segments: dict) -> dict:
    """Reserved against allocated bytes at the peak, and the segments holding the most
    reserved-but-unallocated bytes (each block counted in the segment whose range holds it)."""
    import bisect

    starts = sorted(segments)
    used = dict.fromkeys(starts, 0)
    for addr, (size, _) in blocks.items():
        i = bisect.bisect_right(starts, addr) - 1
        if i >= 0 and addr < starts[i] + segments[starts[i]]:
            used[starts[i]] += size
    reserved = sum(segments.values())
    idle = sorted(((segments[a] - used[a], segments[a], used[a]) for a in starts), reverse=True)
    return {
        "segments": len(starts),
        "reserved": reserved,
        "allocated": sum(used.values()),
        "unallocated": reserved - sum(used.values()),
        "most_unallocated": [{"size": s, "allocated": u, "unallocated": f} for f, s, u in idle[:TOP_SEGMENTS]],
    }


def record_peak(env, step: Callable[[], object], tag: str) -> dict:
    """One call of ``step`` under the allocator's history; its peak summary is written to
    ``<out>/fixtures/mem_<tag>_<device>.json`` and a few figures come back. On the CPU:
    ``{"skipped": ...}``. Never raises (``{"error": ...}``): the part goes on. Not run on a GPU
    yet."""
    if not env.cuda:
        return {"skipped": "the CPU has no caching allocator history (CUDA only)"}
    from benchmarks.gpu._env import device_name

    memory = torch.cuda.memory
    try:
        torch.cuda.synchronize(env.device)
        torch.cuda.reset_peak_memory_stats(env.device)
        memory._record_memory_history(
            "all", context="alloc", stacks="python", max_entries=MAX_ENTRIES, clear_history=True
        )
        try:
            step()
            torch.cuda.synchronize(env.device)
            snapshot = memory._snapshot(env.device)
        finally:
            memory._record_memory_history(None)
        measured = torch.cuda.max_memory_allocated(env.device)
        summary = peak_summary(snapshot, env.device.index or 0)
        summary = {
            "tag": tag,
            "max_allocated": measured,
            "truncated": summary["trace_entries"] >= MAX_ENTRIES,
            **summary,
        }
        path = env.out / "fixtures" / f"mem_{tag}_{device_name(env.device)}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=0))
        return {
            "fixture": str(path.relative_to(env.out)),
            "max_allocated": measured,
            "replayed_peak": summary["allocated_at_peak"],
            "reserved_at_peak": summary["segments_at_peak"]["reserved"],
            "truncated": summary["truncated"],
        }
    except Exception as e:  # recorded; the part goes on
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
