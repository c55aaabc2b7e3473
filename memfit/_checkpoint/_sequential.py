"""`memfit.checkpoint_sequential`: checkpoint a chain of stages in segments."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from memfit._checkpoint._function import _checkpoint

__all__ = ["checkpoint_sequential"]


def _as_args(value) -> tuple:
    # A stage that returns a tuple passes it on as positional arguments.
    return value if isinstance(value, tuple) else (value,)


class _Segment:
    """Stages ``[start, end)`` run one after the other."""

    def __init__(self, stages: Sequence[Callable], start: int, end: int) -> None:
        self.stages = stages[start:end]
        self.name = f"checkpoint_sequential segment [stages {start}..{end - 1}]"

    def __call__(self, *args):
        out = self.stages[0](*args)
        for stage in self.stages[1:]:
            out = stage(*_as_args(out))
        return out


def checkpoint_sequential(
    functions: nn.Sequential | Sequence[Callable],
    segments: int,
    *inputs,
    preserve_rng_state: bool = True,
):
    """Run ``functions`` in order, split into ``segments`` checkpointed segments.

    Like ``torch.utils.checkpoint.checkpoint_sequential`` (the last segment runs unchecked,
    since backward needs its activations at once), but a stage may take and return several
    values: a tuple returned by one stage is passed to the next as positional arguments,
    so stages need not map one tensor to one tensor.
    """
    stages = list(functions.children()) if isinstance(functions, nn.Sequential) else list(functions)
    bad = [i for i, f in enumerate(stages) if not callable(f)]
    if bad:
        raise TypeError(f"memfit.checkpoint_sequential: stage {bad[0]} is not callable: {stages[bad[0]]!r}")
    if not isinstance(segments, int) or not 1 <= segments <= max(len(stages), 1) or not stages:
        raise ValueError(
            f"memfit.checkpoint_sequential: segments must be between 1 and the number of stages "
            f"({len(stages)}), got {segments!r}"
        )
    size, extra = divmod(len(stages), segments)
    bounds, start = [], 0
    for k in range(segments):
        end = start + size + (1 if k < extra else 0)
        bounds.append((start, end))
        start = end
    args = inputs
    for start, end in bounds[:-1]:
        seg = _Segment(stages, start, end)
        args = _as_args(_checkpoint(seg, args, {}, preserve_rng_state=preserve_rng_state, name=seg.name))
    start, end = bounds[-1]
    return _Segment(stages, start, end)(*args)
