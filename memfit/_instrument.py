"""The switches of memfit's instrumentation: one process-wide hook object, read with one
attribute load where the hot path asks (``HOOKS.trace is not None``), and the stream trace
that sharding and activation offload both record into.

Nothing here imports the rest of memfit, so every module may import it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

# [Note: Instrumentation switches]
# Tests and benchmarks turn tracing, checks and fault injection on through `HOOKS` (via
# memfit.testing), never by assigning another module's globals. `HOOKS` is one process-wide
# object, not a ContextVar, because the hot path that reads it runs partly on autograd's own
# threads (one per CUDA device), which a ContextVar set by the caller would not reach.


class Trace:
    """What the streams did, in order, as tuples; for tests of [Note: Streams and buffer
    lifetimes] (sharding) and of host offload's stream rules (one checker for both).

    ("alloc" | "use" | "free", buffer, stream), ("record", stream, event), ("wait", stream, event).
    A "use" is any read, write or add into the buffer on that stream.
    """

    def __init__(self, log: list[tuple] | None = None) -> None:
        self.log: list[tuple] = log if log is not None else []

    def alive(self, match: Callable[[str], bool]) -> tuple[int, set[str]]:
        """Of the buffers whose names ``match``: the most allocated and not yet freed at once,
        and those still so at the end of the log."""
        live: set[str] = set()
        most = 0
        for kind, name, _ in self.log:
            if kind in ("alloc", "free") and match(name):
                (live.add if kind == "alloc" else live.discard)(name)
                most = max(most, len(live))
        return most, live

    def violations(self) -> list[str]:
        """Uses and frees that break the stream rules:

        - a use on one stream not ordered (through a record on the other stream, then a
          wait on this one) after the buffer's earlier uses and allocation on other streams;
        - a free before the allocating stream waited for every use on another stream;
        - a use after the buffer was freed (until it is allocated again).
        """
        recorded: dict[object, tuple[str, int]] = {}  # event -> (stream, position)
        waited: dict[str, list[tuple[object, int]]] = {}  # stream -> (event, position)
        touched: dict[object, list[tuple[str, int]]] = {}  # buffer -> (stream, position) of alloc and uses
        owner: dict[object, str] = {}  # buffer -> the stream it was allocated on
        freed: set = set()
        bad = []

        def ordered(src: str, after: int, dst: str, before: int) -> bool:
            """Whether ``dst`` waited, before ``before``, for an event ``src`` recorded after ``after``."""
            return any(recorded[e][0] == src and recorded[e][1] > after and p < before for e, p in waited.get(dst, []))

        for i, (kind, a, b) in enumerate(self.log):
            if kind == "record":
                recorded[b] = (a, i)
            elif kind == "wait":
                waited.setdefault(a, []).append((b, i))
            elif kind == "alloc":
                owner[a], touched[a] = b, [(b, i)]
                freed.discard(a)
            elif kind == "use" and a in freed:
                bad.append(f"{a} used on {b} at {i} after it was freed")
            elif kind == "use":
                bad += [
                    f"{a} used on {b} at {i} before waiting for {s} (at {p})"
                    for s, p in touched.get(a, [])
                    if s != b and not ordered(s, p, b, i)
                ]
                touched.setdefault(a, []).append((b, i))
            elif kind == "free" and a in touched:  # (not one this trace saw allocated or used)
                o = owner.get(a, b)
                bad += [
                    f"{a} freed at {i} before {o} waited for its use on {s} (at {p})"
                    for s, p in touched.pop(a)
                    if s != o and not ordered(s, p, o, i)
                ]
                freed.add(a)
        return bad


class Hooks:
    """The instrumentation switches (all off in training)."""

    __slots__ = (
        "allocator",
        "checksums",
        "cpu_as_device",
        "debug_collectives",
        "offload_write",
        "save_step",
        "trace",
    )

    def __init__(self) -> None:
        self.trace: Trace | None = None  # every stream record, wait and buffer note goes here
        # every collective checked as soon as it finishes (See [Note: Divergence detection])
        self.debug_collectives = os.environ.get("MEMFIT_DEBUG_COLLECTIVES", "0") not in ("", "0")
        self.cpu_as_device = False  # "cpu" offload: CPU tensors take the accelerator path
        self.checksums = True  # save_checkpoint's per-chunk checksums (off only to measure their cost)
        # disk offload writes through this (path, tensor, real_write) when set: fault injection
        self.offload_write: Callable | None = None
        self.allocator = None  # a stand-in for the accelerator's device module (MemoryMeter's peaks)
        # called with the name of each step of a save or an export (tests kill the process there)
        self.save_step: Callable[[str], None] | None = None


HOOKS = Hooks()  # process-wide: see [Note: Instrumentation switches]


@contextlib.contextmanager
def switched(**values) -> Iterator[Hooks]:
    """Set some of `HOOKS`' switches inside the context; restore them after."""
    saved = {k: getattr(HOOKS, k) for k in values}
    for k, v in values.items():
        setattr(HOOKS, k, v)
    try:
        yield HOOKS
    finally:
        for k, v in saved.items():
            setattr(HOOKS, k, v)
