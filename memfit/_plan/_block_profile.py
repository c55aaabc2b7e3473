"""One block measured on its own under every decision, on fake tensors: the bytes it keeps, its
peaks and the priced time a decision adds."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from memfit._checkpoint import Decision, remove_checkpointing
from memfit._checkpoint._decision import KINDS as DECISIONS
from memfit._checkpoint._decision import SPECS, DecisionKind
from memfit._plan._profile_types import BlockProfile
from memfit._plan._step import _fresh, _Meter, _outputs_with_grad, _state_bytes, _tensor_bytes
from memfit._plan._time import CostRecorder, OpCost
from memfit._plan._trace import NeedsDataError

# [Note: A decision a block cannot take]
# Some blocks cannot be recomputed as a decision asks: a block whose recompute takes another
# path than its forward (runs an op a different number of times) cannot hand selective
# checkpointing's kept outputs back by call count, which memfit (as torch) refuses. (Swinv2,
# whose block mutates a kept Linear output, was one until selective recompute ran such an op
# again: [Note: The cost of selective recompute].) The block's profile runs every decision
# on fake tensors; a decision other than keep that raises is left out of that block's choices,
# with the error kept in BlockProfile.unavailable and named in Plan.table. Keep itself failing
# is the model failing: that error is raised.


# [Note: Inputs a block never reads]
# A block's profile runs it alone on copies of its inputs, and the meter counts a tensor from
# the first op that touches it; the inputs it never reads (Longformer's layers are given masks
# and flags their attention does not touch, HY-V4's and Afmoe's layers rotary tables or
# positions) were never counted, while the block's inputs other than the chain's, subtracted
# from its profile ([Note: Memory outside the blocks]), were: A_i and B_i came out short by
# their bytes (Longformer 1 KB, HY-V4 2 KB under the measured peak), and kept_i too, which
# D_i absorbed at keep (it is the measured step less the kept bytes). So every input counts
# from the start of the block's profile. D_i and D_end then no longer hold those bytes, which
# had covered an input a checkpointed block holds past the stack ([Note: Inputs a
# checkpointed block holds]; llama's all-full forecast went 495 bytes under at W=4 when only
# this was fixed).


def _signature(block: nn.Module, args, kwargs) -> tuple:
    """What makes two blocks the same to the planner: class, structure, parameter and buffer
    shapes, and the shapes of what they are called with (values do not matter)."""

    def leaf(x):
        if isinstance(x, torch.Tensor):
            return ("tensor", tuple(x.shape), x.dtype, x.requires_grad)
        return x if isinstance(x, (int, float, bool, str, type(None))) else type(x).__name__

    tensors: list[tuple] = [(n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in block.named_parameters()]
    tensors += [(n, tuple(t.shape), t.dtype) for n, t in block.named_buffers()]
    flat, spec = tree_flatten((args, kwargs))
    try:
        text = repr(block)
    except Exception:  # a repr that reads a tensor's value (IBert's quantizers print their ranges)
        text = str([(n, type(m).__name__) for n, m in block.named_modules()])
    return (type(block), text, tuple(tensors), str(spec), tuple(leaf(x) for x in flat))


def _profile_block(path, block, args, kwargs, reached, rule, offload, decisions, device) -> BlockProfile:
    """Bytes of ``block`` under each decision (on fake tensors) and their priced extra time; its
    backward from the outputs the step's backward reaches (``reached``: their positions among
    the outputs with grad; T5's encoder blocks return a position bias nothing after them uses)."""
    trainable = sum(p.untyped_storage().nbytes() for p in block.parameters() if p.requires_grad)
    a, k = _fresh(args, kwargs)
    with torch.no_grad():
        out = block(*a, **k)
    # Outputs that share storage with an input (a mask passed through) count once, as input.
    in_bytes = _tensor_bytes((a, k))
    out_bytes = _tensor_bytes(((a, k), out)) - in_bytes
    prof = BlockProfile(path, _state_bytes(block), trainable, in_bytes, out_bytes)
    traced = {SPECS[DecisionKind(d)].traced_as for d in decisions} - {None}  # what the derived kinds read
    measured = [d for d in DECISIONS if d == "keep" or d in decisions or d in traced]
    work: dict[str, list[OpCost]] = {}  # per decision: the ops of the block's forward and backward
    for decision in measured:
        if SPECS[DecisionKind(decision)].traced_as is not None:  # derived below
            continue
        Decision.parse(decision, save=rule).apply(block)
        a, k = _fresh(args, kwargs)
        recorder = CostRecorder()
        try:
            with _Meter(model=block) as meter:
                meter._track_all(tree_flatten((a, k))[0])  # See [Note: Inputs a block never reads]
                with recorder:
                    out = block(*a, **k)
                forward = len(recorder.ops)
                alive = meter.current_bytes
                outs = [t for n, t in enumerate(_outputs_with_grad(out)) if n in reached]
                if outs:
                    grads = [torch.ones_like(t) for t in outs]
                    with recorder:
                        torch.autograd.backward(outs, grads)
        except NeedsDataError:
            raise
        except RuntimeError as e:  # torch refuses it: see [Note: A decision a block cannot take]
            if decision == "keep":
                raise
            prof.unavailable[decision] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            block.zero_grad(set_to_none=True)
            continue
        prof.forward_peak[decision] = max(0, meter.peak_bytes - prof.param_bytes)
        work[decision] = recorder.costs
        if decision == "keep":
            prof.forward_time = device.ops_time(recorder.costs[:forward])
        internal = max(0, alive - prof.param_bytes - prof.input_bytes - prof.output_bytes)
        prof.kept[decision] = internal + prof.input_bytes
        # In the chain the block's output is gone by its backward (the next block released it).
        prof.peak[decision] = max(0, meter.peak_bytes - prof.param_bytes - prof.output_bytes)
        block.zero_grad(set_to_none=True)
        del out, outs
    remove_checkpointing(block)
    derived = {d: SPECS[DecisionKind(d)] for d in measured if SPECS[DecisionKind(d)].traced_as is not None}
    for d, spec in derived.items():  # See [Note: Decision kinds as data]
        base = str(spec.traced_as)
        if base in prof.unavailable:
            prof.unavailable[d] = prof.unavailable[base]
            continue
        # offload: full checkpointing with the input elsewhere until backward
        prof.kept[d] = prof.kept[base] - (prof.input_bytes if spec.moves_input else 0)
        prof.peak[d] = prof.peak[base]
        prof.forward_peak[d] = prof.forward_peak[base]
    # See [Note: The planner's time model]: what a decision's forward and backward cost beyond keep's.
    keep, n_keep = device.ops_time(work["keep"]), len(work["keep"])
    prices = {d: max(0.0, device.ops_time(c) - keep + device.checkpoint_time(len(c) - n_keep)) for d, c in work.items()}
    prices["keep"] = 0.0
    for d, spec in derived.items():
        if d in prof.kept:
            moved = 2 * prof.input_bytes / device.offload_bandwidth if spec.moves_input else 0.0
            prices[d] = prices[str(spec.traced_as)] + moved
    prof.extra_time = {d: prices[d] for d in measured if d in prof.kept}
    return prof


def _without_shared_inputs(prof: BlockProfile, shared: int) -> BlockProfile:
    """``prof`` less ``shared`` bytes of inputs counted outside the blocks (see [Note: Memory
    outside the blocks]); an offloaded block's kept bytes have no input in them already."""
    if not shared:
        return prof
    kept = {d: v if SPECS[DecisionKind(d)].moves_input else max(0, v - shared) for d, v in prof.kept.items()}
    peak = {d: max(0, v - shared) for d, v in prof.peak.items()}
    forward = {d: max(0, v - shared) for d, v in prof.forward_peak.items()}
    less = max(0, prof.input_bytes - shared)
    return dataclasses.replace(prof, input_bytes=less, kept=kept, peak=peak, forward_peak=forward)
