"""Measure what the planner's memory model needs: per block and for the rest of the step."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from memfit._checkpoint import Decision, Offload, remove_checkpointing
from memfit._checkpoint._cache import cache_type, snapshot_caches
from memfit._checkpoint._decision import KINDS as DECISIONS
from memfit._plan._calibrate import device_profile
from memfit._plan._head import LMHead, find_head, unchunk_head
from memfit._plan._head import chunk_head as chunk_forward
from memfit._plan._time import CostRecorder, DeviceProfile, OpCost
from memfit._plan._trace import DataValues, NeedsDataError, fake_rules, record_data_values
from memfit._shard._mixed import MixedPrecision
from memfit.memory import MemoryMeter

# [Note: The planner's memory model]
# A training step's peak is the largest of three kinds of moment (named terms, all bytes):
#   end of forward:  S + O + D_end + sum_j kept_j + y_last + T_head
#   forward before i: S + O + D_i + sum_{j<i} kept_j + x_i + F_i
#   forward of i:    S + O + D_i + sum_{j<i} kept_j + A_i
#   backward of i:   S + O + D_i + G_after_i + G_rest + sum_{j<i} kept_j + B_i
#   optimizer step:  P_opt
# S     parameters, buffers and optimizer state (per rank when sharded),
# O     what exists when the first block starts: the batch and what the embeddings keep,
# D_i   what the code between the blocks made after that and still holds when block i starts
#       (an encoder's output, a decoder's masks and positions: [Note: Memory outside the blocks]),
# F_i   the peak of the code that runs before block i (after block i-1, or the embeddings)
#       above what is alive when block i starts, x_i its input from block i-1 (ProphetNet's
#       relative positions: 20 MB of int64 temporaries where the whole step holds 2 MB),
# kept_j what block j keeps for backward under its decision, its input from block j-1 included
#       unless offloaded (its output is the next block's input, counted there; the last one is
#       y_last); its other inputs (masks, positions, the first block's input) are in O + D_j,
# T_head the peak of the head, the loss and their backward above the end-of-forward state,
# G_after_i / G_rest_i  the gradients of the blocks after i / of the parameters outside the
#       blocks that the forward used after block i started (the head's, a tied embedding's:
#       their gradients exist from the backward of that use; an embedding used only before the
#       blocks gets its gradient after them: BART's learned positions counted in every block's
#       backward over-forecast it by 3.3%),
# A_i   the peak of block i's forward on its own: its input from block i-1, its temporaries
#       and what it keeps, its output (PegasusX's staggered local attention peaks there),
# B_i   the peak of block i's forward and backward on its own (input from block i-1, what it
#       keeps, recompute, gradients of its parameters and of its input, its output's gradient;
#       not its output, which the next block released),
# P_opt the peak of the optimizer step (parameters, gradients, state and its temporaries), plus
#       L, what the step's forward leaves alive beside them (a mask a model caches, 4 KiB on Llama),
# and after the blocks' backward, the backward of what comes before them (the embeddings):
#   backward before the blocks:  S + G_blocks + T_tail
# T_tail what that backward holds above S and the blocks' gradients: the gradients outside the
#       blocks and its temporaries (a tied embedding's gradient is summed: three copies at once).
# Every term is measured with MemoryMeter on the example batch, per block and per decision, on
# fake tensors (see [Note: Planning on fake tensors]); R_i, what the backward of block i holds
# beside them, comes from the measured step ([Note: What the backward holds outside the blocks]).


@dataclass
class BlockProfile:
    """One candidate block, measured on the example batch (bytes and seconds)."""

    path: str
    param_bytes: int  # its parameters (its gradients have the same size when trainable)
    grad_bytes: int
    input_bytes: int
    output_bytes: int
    kept: dict[str, int] = field(default_factory=dict)  # per decision, input included unless offloaded
    peak: dict[str, int] = field(default_factory=dict)  # B_i per decision
    forward_time: float = 0.0  # its forward with activations kept (priced)
    extra_time: dict[str, float] = field(default_factory=dict)  # added to a step per decision
    forward_peak: dict[str, int] = field(default_factory=dict)  # A_i per decision (none: 0)
    # decisions the block cannot take, with why ([Note: A decision a block cannot take])
    unavailable: dict[str, str] = field(default_factory=dict)


@dataclass
class ModelProfile:
    blocks: list[BlockProfile]
    state_bytes: int  # S: parameters + buffers + optimizer state
    param_bytes: int
    optimizer_bytes: int
    grad_rest_bytes: int  # gradients of parameters outside the blocks
    before_blocks: int  # O
    last_output: int  # y_last
    head_transient: int  # T_head
    optimizer_peak: int  # P_opt
    tail_transient: int = 0  # T_tail: peak of the backward before the blocks, above S and the blocks' gradients
    leftover: int = 0  # L: what the forward leaves alive after backward beside S and gradients (cached masks)
    buffer_bytes: int = 0  # buffers (replicated on every rank when sharded)
    step_time: float = 0.0  # priced forward, backward and optimizer step, activations kept (s)
    step_split: tuple[float, float] = (0.0, 0.0)  # (host, device) seconds of its forward and backward
    device: str = ""  # the device profile the times are priced on
    device_source: str = ""  # where its rates come from (DeviceProfile.source)
    offload_bandwidth: float = 0.0  # the device profile's bytes per second to host memory
    workspace_bytes: int = 0  # the device profile's allocator memory beside tensors (CUDA's workspaces)
    head: LMHead | None = None  # the LM head, when it can be chunked
    head_chunked: int | None = None  # T_head with the head and loss chunked
    head_chunked_time: float = 0.0  # seconds chunking adds to a step (the head's matmul again)
    distinct_blocks: int = 0  # blocks profiled (identical ones once)
    between: list[int] = field(default_factory=list)  # D_i per block (none: 0)
    between_end: int = 0  # D_end: at the end of forward
    forward_transient: list[int] = field(default_factory=list)  # F_i per block (none: 0)
    # G_rest_i: the gradients outside the blocks alive in block i's backward (those of the
    # parameters the forward used after block i started). None: grad_rest_bytes
    grad_rest_at: list[int] = field(default_factory=list)
    # R_i: what the step holds in block i's backward beyond the terms above (none: 0), and E_i:
    # what the backward of the code after block i holds beyond what is alive then (none: 0)
    backward_outside: list[int] = field(default_factory=list)
    after_outside: list[int] = field(default_factory=list)
    # H: the blocks' inputs other than the chain's that the measured step (every block kept)
    # frees before the end of forward, each (bytes, dies, blocks given it): dies j < n, dead as
    # block j starts; n, as the forward returns ([Note: Inputs a checkpointed block holds])
    released_inputs: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)
    # Mixed precision ([Note: Forecasts under mixed precision]): the parameters as the shards
    # hold them, in their own dtype (0: they compute in it, no mixed precision); bytes of a
    # gradient's shard (the shards' dtype) and of its reduce buffer (the reduce dtype) per byte
    # of the gradient the compute makes (the compute dtype), over all trainable parameters.
    master_bytes: int = 0
    grad_shard_scale: float = 1.0
    reduce_scale: float = 1.0
    compute: str = ""  # what the step computes in under mixed precision (tables say it); "": the model's dtypes
    # The root's reduce (sharded): every trainable parameter outside the blocks, used by the step
    # or not (a parameter without a gradient sends zero rows), in the compute dtype and in the
    # root's reduce dtype. None: the gradients the step made (grad_rest_bytes).
    root_grad_bytes: int | None = None
    root_reduce_bytes: int | None = None
    # Gradients accumulate over micro-batches (autoconfigure's held_gradients): the root's shard
    # from the micro-batches before is alive at its reduce too.
    accumulating: bool = False

    @property
    def measured_state(self) -> int:
        """S as the measured step counted it: the parameters it computed with (under mixed
        precision the compute copies, without the optimizer, which steps on the shards)."""
        return self.param_bytes if self.master_bytes else self.state_bytes


# [Note: Memory outside the blocks]
# A block's inputs are of two kinds. Its input from the block before it (the first tensor it
# is called with, when the block before returned it) is the chain the decisions act on: kept
# with the block, offloaded with it. Every other input -- the masks, positions and rotary
# tables every layer of a stack is given, an encoder's output each decoder layer attends to,
# the first block's input -- is made once by the code between the blocks and alive for all of
# them; counting it in every block's kept bytes over-forecast encoder-decoders by 5% and still
# missed what it holds (ProphetNet's layers get 8-row views of a 512 x 1024 mask: a copy is
# small, the view holds the whole storage). So such inputs are taken out of each block's own
# profile (kept, B_i), and the measured step of the whole model (every block kept) gives, at
# each block's start, what is alive beyond O, the blocks' kept bytes and the block's input:
# D_i, what the code between the blocks holds (the masks, an encoder's output and what its
# final norm keeps). It does not depend on the decisions. The same step gives F_i, the peak of
# the code before block i above what block i starts with (ProphetNet builds its relative
# positions in 20 MB of int64 temporaries where the whole step holds 2 MB: the forecast was a
# tenth of the peak). An offloaded first block's input stays counted (an over-forecast).

# [Note: A decision a block cannot take]
# Some blocks cannot be recomputed as a decision asks: a block whose recompute takes another
# path than its forward (runs an op a different number of times) cannot hand selective
# checkpointing's kept outputs back by call count, which memfit (as torch) refuses. (Swinv2,
# whose block mutates a kept Linear output, was one until selective recompute ran such an op
# again: [Note: The cost of selective recompute].) The block's profile runs every decision
# on fake tensors; a decision other than keep that raises is left out of that block's choices,
# with the error kept in BlockProfile.unavailable and named in Plan.table. Keep itself failing
# is the model failing: that error is raised.

# [Note: What the backward holds outside the blocks]
# The backward of block i holds, beside the terms of [Note: The planner's memory model], what
# the code around the blocks keeps alive through it: the loss, labels or a mask that a loss or
# an attention path holds until its own backward ran (Whisper's encoder: 43 KB at its tiny
# size); and the backward of the code between two blocks runs after block i's, with what it
# allocates (a custom op's scratch). The measured step (every block kept) gives two peaks per
# block: of its backward (from the gradient of its output to that of its input, the chain's)
# and of the code's backward after it (to the gradient of the block before's output). R_i is
# what the first holds beyond the forecast of block i's backward moment; E_i, what the second
# holds beyond what is alive then (the blocks before it kept, the gradients, its own made, its
# input), a moment of its own ("backward after X") where E_i > 0. Both are never below 0 and
# taken not to depend on the decisions: at keep they make those moments the measured step's
# own, so the tests that plan at a budget nothing constrains check the rest of the model. Where
# the blocks are checkpointed, a test (tests/integration/test_plan.py) measured E_i 16 KiB short
# (0.988x) of a 1.3 MiB step. Before them, Whisper was forecast at 0.965x and 11 other
# architectures up to 0.11% below their measured peak (HY-V4 0.999x until [Note: Inputs a
# block never reads]).

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

# [Note: Inputs a checkpointed block holds]
# A checkpointed block (any decision but keep) holds every input it is given until its
# backward, to recompute; a kept block holds only what its ops save. An input the step with
# every block kept frees early -- the position ids and cache positions no layer reads (256
# bytes at llama's size), an eager attention's [batch, 1, seq, seq] mask that no op saves, an
# encoder's mask after the encoder -- is then alive where D_i, D_end and T_head, all measured
# with every block kept, do not count it. The measured step records, for each storage given to
# a block as an input other than the chain's, the first block start it is dead at, or that it
# is dead when the forward has returned (the loss made: an over-count where it died after the
# head's peak); H = those (bytes, when, blocks). At block j's moments (its forward, the
# code's before it, its backward, the code's backward after it: all count D_j) the forecast
# adds the storages dead at j's start that a block before it, not kept, was given; at the end
# of forward, those dead by then. Each storage counts once however many blocks hold it (every
# layer of a stack holds the same mask). The solver adds them as if every block were
# checkpointed, an upper bound, and takes keeping every block where that alone fits.


def _stacks(model: nn.Module) -> list[list[tuple[str, nn.Module]]]:
    """The stacks of layers: the children of a ModuleList (2 or more, whatever their classes:
    a hybrid alternates attention and state-space layers), and every longest run (2 or more)
    of consecutive same-class children of a Sequential (also inside a flat Sequential(stem,
    blocks..., head))."""
    stacks = []
    for path, m in model.named_modules():
        named = [(f"{path}.{n}" if path else n, k) for n, k in m.named_children()]
        if isinstance(m, nn.ModuleList) and len(named) >= 2:
            stacks.append(named)
        elif isinstance(m, nn.Sequential):
            run: list[tuple[str, nn.Module]] = []
            for n, k in [*named, ("", None)]:
                if run and (k is None or type(k) is not type(run[-1][1])):
                    if len(run) >= 2:
                        stacks.append(run)
                    run = []
                if k is not None:
                    run.append((n, k))
    return stacks


def _no_split_classes(model: nn.Module) -> set[str]:
    """The class names transformers models name in ``_no_split_modules`` (their layers)."""
    return {name for m in model.modules() for name in getattr(m, "_no_split_modules", None) or ()}


# [Note: Default candidates]
# The candidates are the layers that run in the step, whatever their classes. The stacks are
# the ModuleLists of 2 or more modules and the runs of same-class modules in a Sequential.
# The planner traces one forward first and keeps the members that ran: a vision-language
# model's vision tower does not run on a text batch (and an image batch runs it first). Of
# those, a transformers model's layers are the stacks of the classes its _no_split_modules
# names (the units it never splits across devices); other models get the longest stack, with
# every other stack of the same classes or the same length (the encoder and the decoder of T5
# or BART; the four per-layer lists of XLM). Stacks inside a chosen module are left out, and
# the blocks are ordered as they first ran.
def find_candidates(model: nn.Module, ran: dict[str, int] | None = None) -> list[tuple[str, nn.Module]]:
    """Default candidates (see [Note: Default candidates]); ``ran``: the paths that ran in a
    forward on the example batch, each with its position in the order they first ran."""
    stacks = [r for s in _stacks(model) if (r := [(p, m) for p, m in s if ran is None or p in ran])]
    if not stacks:
        raise ValueError(
            f"memfit.plan: found no repeated blocks in {type(model).__name__} (two or more modules in a ModuleList, "
            "or of one class in a Sequential, that run on the example batch); pass candidates=[...] with the module "
            "paths of its blocks"
        )
    hinted = _no_split_classes(model)
    chosen = [s for s in stacks if all(type(m).__name__ in hinted for _, m in s)]
    if not chosen:
        classes = lambda s: {type(m) for _, m in s}  # noqa: E731
        best = max(stacks, key=len)
        chosen = [s for s in stacks if classes(s) == classes(best) or len(s) == len(best)]
    prefixes = [p for s in chosen for p, _ in s]
    inside = lambda path: any(path.startswith(p + ".") for p in prefixes)  # noqa: E731
    blocks = [(p, m) for s in chosen for p, m in s if not inside(p)]
    return sorted(blocks, key=lambda b: ran[b[0]]) if ran is not None else blocks


def _tensor_bytes(obj) -> int:
    seen, total = set(), 0
    for t in tree_flatten(obj)[0]:
        if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in seen:
            seen.add(t.untyped_storage()._cdata)
            total += t.untyped_storage().nbytes()
    return total


def _state_bytes(module: nn.Module) -> int:
    return sum(t.untyped_storage().nbytes() for t in [*module.parameters(), *module.buffers()])


def _buffer_bytes(module: nn.Module) -> int:
    return sum(b.untyped_storage().nbytes() for b in module.buffers())


def _fresh(args, kwargs):
    """Copies of a block's arguments: tensors cloned, a transformers Cache snapshot (as a
    checkpointed call's recompute sees it: [Note: Key/value caches under recompute])."""
    cache = cache_type()

    def clone(t):
        if cache is not None and isinstance(t, cache):
            return snapshot_caches([t])[0]
        if not isinstance(t, torch.Tensor):
            return t
        c = t.detach().clone()
        return c.requires_grad_(t.requires_grad)

    return tree_map(clone, args), tree_map(clone, kwargs)


def _outputs_with_grad(out) -> list[torch.Tensor]:
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


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
    measured = [d for d in DECISIONS if d == "keep" or d in decisions or (d == "full" and "offload" in decisions)]
    work: dict[str, list[OpCost]] = {}  # per decision: the ops of the block's forward and backward
    for decision in measured:
        if decision == "offload":
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
    if "offload" in measured and "full" in prof.unavailable:
        prof.unavailable["offload"] = prof.unavailable["full"]
    elif "offload" in measured:  # full checkpointing with the input elsewhere until backward
        prof.kept["offload"] = prof.kept["full"] - prof.input_bytes
        prof.peak["offload"] = prof.peak["full"]
        prof.forward_peak["offload"] = prof.forward_peak["full"]
    # See [Note: The planner's time model]: what a decision's forward and backward cost beyond keep's.
    prices = {d: device.decision_time(d, c, work["keep"]) for d, c in work.items()}
    if "offload" in prof.kept:
        prices["offload"] = prices["full"] + device.offload_time(prof.input_bytes, prof.forward_time)
    prof.extra_time = {d: prices[d] for d in measured if d in prof.kept}
    return prof


Inputs = dict | tuple | list | torch.Tensor


def call(model: nn.Module, inputs: Inputs):
    """``model`` on an example batch: a dict as keyword arguments, a tuple or list as positional
    arguments, a tensor as the one argument."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    if isinstance(inputs, torch.Tensor):
        return model(inputs)
    raise TypeError(
        f"memfit.plan: example inputs must be a dict (keyword arguments), a tuple or list (positional "
        f"arguments) or a tensor, got {type(inputs).__name__}"
    )


def step_loss(model: nn.Module, inputs: Inputs, loss_fn: Callable | None = None) -> torch.Tensor:
    """The loss of one forward: ``loss_fn(output)`` when given, else the output's ``.loss`` (or
    ``["loss"]``), else the output itself when it is a scalar tensor."""
    out = call(model, inputs)
    if loss_fn is not None:
        return loss_fn(out)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is None and isinstance(out, torch.Tensor) and out.dim() == 0:
        loss = out
    if loss is None:
        what = f"a tensor of shape {list(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"memfit.plan: {type(model).__name__} returned {what} and no loss; pass loss_fn=callable(output) -> "
            "scalar loss (e.g. cross-entropy of the logits against your labels), or inputs that make the model "
            "return one (HF models: labels=...)"
        )
    return loss


def profile_model(
    model: nn.Module,
    example_inputs: Inputs,
    candidates: list[tuple[str, nn.Module]] | None = None,
    *,
    loss_fn: Callable | None = None,
    optimizer: str = "adamw",
    rule: str = "linear",
    offload: Offload | None = None,
    decisions: tuple[str, ...] = DECISIONS,
    device: DeviceProfile | None = None,
    chunk_head: bool = True,
    mixed_precision: MixedPrecision | None = None,
) -> ModelProfile:
    """Every term of the planner's memory model for ``model`` on the batch, and the priced
    work of a step; with ``chunk_head`` and an LM head, the head's terms chunked as well (see
    [Note: The head as a decision]). ``candidates`` None: the default ones ([Note: Default
    candidates]). ``mixed_precision``: the step computes as memfit's units compute under it
    ([Note: Forecasts under mixed precision]). See [Note: Planning on fake tensors] and
    [Note: Values read from the data]."""
    opts = {
        "mixed_precision": mixed_precision,
        "loss_fn": loss_fn,
        "optimizer": optimizer,
        "rule": rule,
        "offload": offload,
        "decisions": decisions,
        "device": device or device_profile(None),
        "chunk_head": chunk_head,
    }
    paths = None if candidates is None else [p for p, _ in candidates]
    try:
        return _profile(model, example_inputs, paths, None, **opts)
    except NeedsDataError as e:
        values = _record_values(model, example_inputs, e)
    return _profile(model, example_inputs, paths, values, **opts)


def _record_values(model: nn.Module, inputs: Inputs, need: NeedsDataError) -> DataValues:
    """The values the step reads from its data, from one real forward (see [Note: Values read
    from the data]); the model's mode, buffers, caches and random state are restored."""
    if any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()]):
        raise ValueError(
            f"memfit.plan: {type(model).__name__} reads values from its data ({need.op} in "
            f"{need.path or 'its forward'}), which a model on the meta device does not have; plan it with "
            "its weights materialized (on any device), or pass profile= from such a model"
        ) from need
    training = {m: m.training for m in model.modules()}
    buffers = _buffers_of(model)
    caches = _caches_off(model)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model.train()
            return record_data_values(model, lambda: call(model, inputs))
    finally:
        for m, mode in training.items():
            m.training = mode
        _restore_buffers(model, buffers)
        for config, value in caches:
            config.use_cache = value


def _buffers_of(model: nn.Module) -> list[tuple[nn.Module, dict, dict[str, torch.Tensor], set]]:
    """Each module's buffers (the tensors and copies of their values) and non-persistent names."""
    return [
        (m, dict(m._buffers), {k: b.detach().clone() for k, b in m._buffers.items() if b is not None},
         set(m._non_persistent_buffers_set))
        for m in model.modules()
    ]  # fmt: skip


def _restore_buffers(model: nn.Module, saved: list) -> None:
    """Every module's buffers as before a forward: the same tensors with their values back
    (IBert's quantizers assign new range tensors), none added, none removed."""
    with torch.no_grad():
        for module, tensors, values, non_persistent in saved:
            module._buffers.clear()
            module._buffers.update(tensors)
            module._non_persistent_buffers_set.clear()
            module._non_persistent_buffers_set.update(non_persistent)
            for k, v in values.items():
                t = tensors[k]
                if t.shape == v.shape and t.dtype == v.dtype and t.device == v.device:
                    t.copy_(v)
                else:  # changed in place beyond a copy: its old storage back
                    t.data = v


def _caches_off(model: nn.Module) -> list[tuple[Any, bool]]:
    """Turn an HF key/value cache off in every config of ``model`` (an encoder-decoder's stacks
    have configs of their own: it is for generation, and would grow per run); returns what
    to restore."""
    changed = []
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and getattr(config, "use_cache", False):
            changed.append((config, True))
            config.use_cache = False
    return changed


# LayerDrop (M2M100, NLLB, SeamlessM4T, Wav2Vec2, ...) skips each layer of a training step
# with some probability: which layers run, and so the step's memory, is random. The planner
# plans the step that runs every layer, the largest, with the skeleton's layerdrop set to 0
# (the skeleton is a copy: the model keeps its own).
def _layerdrop_off(skeleton: nn.Module) -> None:
    """Every float attribute named ``*layerdrop`` of the modules and their configs to 0
    ("layerdrop", "encoder_layerdrop", SeamlessM4T's "speech_encoder_layerdrop", ...)."""
    for m in skeleton.modules():
        for owner in (m, getattr(m, "config", None)):
            for name, value in list(getattr(owner, "__dict__", {}).items()):  # (a dict config: none)
                if name.endswith("layerdrop") and isinstance(value, float) and value:
                    setattr(owner, name, 0.0)


def _ran(model: nn.Module, inputs: Inputs, paths: list[str] | None) -> dict[str, int]:
    """The candidate modules (``paths``, or every member of a stack) that run in a forward on
    ``inputs``, each with its position in the order they first ran."""
    named = (
        [(p, model.get_submodule(p)) for p in paths] if paths is not None else [m for s in _stacks(model) for m in s]
    )
    order: dict[str, int] = {}

    def hook(path):
        def first_run(module, args, kwargs):
            order.setdefault(path, len(order))

        return first_run

    with _watching([(m, hook(p), None) for p, m in named]), torch.no_grad():
        call(model, inputs)
    return order


class _Watched:
    """A block's forward, watched: ``pre(module, args, kwargs)`` before it and ``post(module,
    args, kwargs, out)`` after it, however it is called (SqueezeBERT calls its layers'
    ``forward`` directly, which module hooks do not see)."""

    def __init__(self, module: nn.Module, pre: Callable | None, post: Callable | None) -> None:
        self.inner = module.__dict__.get("forward")  # an instance forward (a checkpointed one) or None
        self.module, self.pre, self.post = module, pre, post

    def __call__(self, *args, **kwargs):
        if self.pre is not None:
            self.pre(self.module, args, kwargs)
        forward = self.inner if self.inner is not None else type(self.module).forward.__get__(self.module)
        out = forward(*args, **kwargs)
        if self.post is not None:
            self.post(self.module, args, kwargs, out)
        return out


class _ByCall:
    """Blocks by call: the k-th call of a module is the k-th block of its module in ``blocks``
    (a module run several times, ALBERT's shared layer, is one block per call; see [Note: A
    module run several times]). ``restart()`` before each step."""

    def __init__(self, blocks: list[nn.Module], pre: Callable, post: Callable) -> None:
        self.indices: dict[int, list[int]] = {}
        for i, b in enumerate(blocks):
            self.indices.setdefault(id(b), []).append(i)
        self.modules = list({id(b): b for b in blocks}.values())
        self.pre_of, self.post_of = pre, post
        self.restart()

    def restart(self) -> None:
        self.calls: dict[int, int] = dict.fromkeys(self.indices, 0)
        self.running: dict[int, list[int | None]] = {k: [] for k in self.indices}

    def pre(self, module, args, kwargs) -> None:
        key, k = id(module), self.calls[id(module)]
        self.calls[key] = k + 1
        i = self.indices[key][k] if k < len(self.indices[key]) else None  # a call past those planned
        self.running[key].append(i)
        if i is not None:
            self.pre_of(i)(module, args, kwargs)

    def post(self, module, args, kwargs, out) -> None:
        i = self.running[id(module)].pop()
        if i is not None:
            self.post_of(i)(module, args, kwargs, out)


@contextlib.contextmanager
def _watching(watched):
    """Each (module, pre, post) watched (see _Watched) inside the block, then as it was; or,
    given a _ByCall, each of its modules, the hooks of the block each call is."""
    installed = []
    by_call = watched if isinstance(watched, _ByCall) else None
    if by_call is not None:
        watched = [(m, by_call.pre, by_call.post) for m in by_call.modules]
    try:
        for module, pre, post in watched:
            installed.append(_Watched(module, pre, post))
            module.forward = installed[-1]
        yield by_call
    finally:
        for w in reversed(installed):
            if w.inner is None:
                w.module.__dict__.pop("forward", None)
            else:
                w.module.forward = w.inner


# [Note: A module run several times]
# ALBERT runs one layer (one set of weights) N times. Without stacks of distinct layers, the
# candidates are the calls of the outermost module of a ModuleList that runs two or more times:
# each call is a block of the profile (its own kept bytes, its own moments, named "#k" after the
# path from the second call on), and all its calls take one decision (the module is checkpointed
# or not): the solver tries each decision for the module with the others solved as usual.
# Gradients of the module exist once, from the backward of its last call: counted with that
# call, none with the others (whose own backward profile still counts a gradient: above).
def _shared_calls(model: nn.Module, inputs: Inputs) -> list[str]:
    """The paths of the calls, in order, of the outermost ModuleList members that run two or
    more times in a forward on ``inputs`` (see [Note: A module run several times])."""
    members = [(f"{p}.{n}" if p else n, k) for p, m in model.named_modules() if isinstance(m, nn.ModuleList)
               for n, k in m.named_children()]  # fmt: skip
    order: list[str] = []

    def pre(path):
        def hook(module, args, kwargs):
            order.append(path)

        return hook

    with _watching([(m, pre(p), None) for p, m in members]), torch.no_grad():
        call(model, inputs)
    shared = {p for p in order if order.count(p) >= 2}
    outer = {p for p in shared if not any(p.startswith(q + ".") for q in shared)}
    return [p for p in order if p in outer]


def _candidate_paths(skeleton: nn.Module, inputs: Inputs, paths: list[str] | None, name: str) -> list[str]:
    """The candidates' paths in the order they run: the default ones, or those given, checked
    to run on the batch (see [Note: Default candidates])."""
    ran = _ran(skeleton, inputs, paths)
    if paths is None:
        try:
            return [p for p, _ in find_candidates(skeleton, ran)]
        except ValueError:
            if shared := _shared_calls(skeleton, inputs):
                return shared
            raise
    if missing := [p for p in paths if p not in ran]:
        raise ValueError(
            f"memfit.plan: candidates {missing} never run in {name}'s forward on the example batch; leave them "
            "out, or pass a batch that runs them"
        )
    return paths


def _profile(
    model, example_inputs, paths, values, *, loss_fn, optimizer, rule, offload, decisions, device, chunk_head,
    mixed_precision,
):  # fmt: skip
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    first = next(iter(model.parameters()), None)
    on = "cpu" if first is None or first.device.type == "meta" else first.device
    mp = mixed_precision
    with fake:
        skeleton = _fake_copy(model, on)
        inputs = tree_map(lambda t: _fake_like(t, on), example_inputs)
        skeleton.train()
        _caches_off(skeleton)
        _layerdrop_off(skeleton)
        masters = _compute_as(skeleton, mp) if mp else []
        with fake_rules(skeleton, values):
            paths = _candidate_paths(skeleton, inputs, paths, type(model).__name__)
            blocks = [skeleton.get_submodule(p) for p in paths]
            for b in blocks if mp else ():
                b.register_forward_pre_hook(_inputs_to(mp.param_dtype), with_kwargs=True)
            whole = _measure_step(skeleton, inputs, loss_fn, blocks, None if mp else optimizer)
            if mp:  # the optimizer steps on the shards, in their own dtype
                whole = _master_step(whole, masters, optimizer, _buffer_bytes(skeleton))
            made = whole.made or _BlocksMade()
            profiles, seen = [], {}
            for i, (path, blk) in enumerate(zip(paths, blocks)):
                args, kwargs = whole.block_inputs[i]
                reached = made.reached.get(i, set())
                key = (_signature(blk, args, kwargs), made.fingerprint.get(i), tuple(sorted(reached)))
                if key not in seen:  # identical blocks are profiled once
                    seen[key] = _profile_block(path, blk, args, kwargs, reached, rule, offload, decisions, device)
                prof = _without_shared_inputs(seen[key], made.shared.get(i, 0))
                last = path not in paths[i + 1 :]  # a module's gradients once: [Note: A module run several times]
                grads = _used_bytes(blk, whole.used) if last else 0
                profiles.append(dataclasses.replace(prof, path=path, grad_bytes=grads))
            in_blocks = {id(p) for b in blocks for p in b.parameters()}
            grad_rest = _used_bytes(skeleton, whole.used - in_blocks)
            root = [p for p in skeleton.parameters() if p.requires_grad and id(p) not in in_blocks]
            state = _state_bytes(skeleton)
            buffers = _buffer_bytes(skeleton)
            head = find_head(model) if chunk_head and loss_fn is None and _has_labels(example_inputs) else None
            head = head if head is None or _head_gives_the_logits(skeleton, inputs, head) else None
            chunked = _chunked_head(skeleton, inputs, blocks, whole, head, device) if head else None
    marks = whole.marks
    between = _between(profiles, made, marks)
    counted = state + (0 if mp else whole.optimizer_bytes)  # S as the measured step counted it
    master = sum(p.numel() * p.element_size() for p in model.parameters())  # the shards: their own dtypes
    profile = ModelProfile(
        blocks=profiles,
        state_bytes=(master + buffers if mp else state) + whole.optimizer_bytes,
        param_bytes=state,
        optimizer_bytes=whole.optimizer_bytes,
        grad_rest_bytes=grad_rest,
        before_blocks=marks["before"] - counted,
        last_output=marks["last_output"],
        head_transient=marks.get("head_peak", marks["at_last_output"]) - marks["at_last_output"],
        optimizer_peak=whole.optimizer_peak,
        tail_transient=max(0, marks["tail_peak"] - counted - sum(b.grad_bytes for b in profiles)),
        leftover=max(0, marks["after_backward"] - counted),
        buffer_bytes=buffers,
        step_time=device.ops_time(whole.forward_backward) + device.ops_time(whole.costs[len(whole.forward_backward) :]),
        step_split=device.split(whole.forward_backward),
        head=head,
        head_chunked=None if chunked is None else chunked[0],
        head_chunked_time=0.0 if chunked is None else chunked[1],
        device=device.name,
        device_source=device.source,
        offload_bandwidth=device.offload_bandwidth,
        workspace_bytes=device.workspace_bytes,
        distinct_blocks=len(seen),
        between=between[:-1],
        between_end=between[-1],
        forward_transient=[made.transient.get(i, 0) for i in range(len(profiles))],
        grad_rest_at=[min(grad_rest, made.rest_at(i)) for i in range(len(profiles))] if made.last_use else [],
        released_inputs=made.released(),
        root_grad_bytes=sum(p.untyped_storage().nbytes() for p in root),
        root_reduce_bytes=sum(p.numel() * _reduce_dtype(root, mp).itemsize for p in root),
        **(_mixed_terms(masters, blocks, mp, master) if mp else {}),
    )
    return dataclasses.replace(profile, **_backward_outside(profile, made))


# [Note: Forecasts under mixed precision]
# memfit.MixedPrecision (FSDP2's MixedPrecisionPolicy) keeps the shards, their gradients and the
# optimizer state in the parameters' own dtype (fp32 master weights), and computes on full
# parameters cast to param_dtype (norm layers in fp32 by default): a unit's gathered copy, its
# activations and the gradients its backward makes are in the compute dtype; the gradients are
# copied into a reduce buffer of the reduce dtype and reduce-scattered into fp32 shards. So the
# profile measures the step on a skeleton cast as the units compute (parameters to their
# compute dtype, buffers and norm layers as MixedPrecision.prepare leaves them, the floating
# inputs of the model and of each block cast to param_dtype, as a unit's pre-forward does), and
# the optimizer step on fake shards in their own dtype with gradients in it. The forecast then
# holds, per rank: the shards and optimizer state at 1/s (S); the units' compute copies as
# gathered buffers at any shard count (one rank too: the copy is made each forward); the
# gradients made in the compute dtype until their unit's reduce; the reduce buffer at
# reduce_scale and the shard at grad_shard_scale of those bytes (one ratio over the whole
# model: a norm layer's fp32 gradient among bf16 ones moves it by its share of the bytes).
# Replicated layouts of W > 1 ranks (memfit's (W, 1) units) are forecast where gradients are
# summed in fp32 (reduce_dtype=torch.float32, as memfit train's --mixed-precision bf16): under
# no_sync the micro-batches' gradients accumulate in fp32 accumulators, which the accumulated
# gradients of autoconfigure's held_gradients count (fp32, whole). 2 gloo ranks of BERT, GPT-2
# and Llama (and 4 of BERT and Llama) at 4 x 1, 2 x 2 and 1 x 4 measured 0.94 to 0.998x their
# forecast. Summed in
# bf16 (reduce_dtype=None) the units hold them otherwise (a Llama at 1 x 4 measured 1.03x its
# forecast): refused by memfit.plan, left out by autoconfigure.
def _compute_as(skeleton: nn.Module, mp: MixedPrecision) -> list[tuple[nn.Parameter, torch.dtype]]:
    """Cast ``skeleton`` as memfit's units compute under ``mp`` (see [Note: Forecasts under
    mixed precision]); returns each trainable parameter of the cast skeleton with the dtype its
    shard keeps (its own before the cast)."""
    cast: dict[int, nn.Parameter] = {}
    masters = []
    for m in skeleton.modules():
        dtype = mp.compute_dtype(m)
        for name, p in list(m._parameters.items()):
            if p is None:
                continue
            if id(p) not in cast:  # a tied parameter takes its first module's dtype, as a unit's chunk does
                new = p
                if p.is_floating_point() and p.dtype != dtype:
                    new = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                cast[id(p)] = new
                if p.requires_grad:
                    masters.append((new, p.dtype))
            m._parameters[name] = cast[id(p)]
    mp.prepare(list(skeleton.modules()))
    skeleton.register_forward_pre_hook(_inputs_to(mp.param_dtype), with_kwargs=True)
    return masters


def _inputs_to(dtype: torch.dtype) -> Callable:
    """A forward pre-hook casting floating inputs to ``dtype``, as a unit's pre-forward does."""

    def to(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    def hook(module, args, kwargs):
        return tree_map(to, args), tree_map(to, kwargs)

    return hook


def _master_step(
    whole: _WholeStep, masters: list[tuple[nn.Parameter, torch.dtype]], optimizer: str, buffers: int
) -> _WholeStep:
    """``whole`` (a step measured without optimizer) with the optimizer's state, peak and ops
    over shards in their own dtype: one step to create the state, one measured, each parameter
    the step gave a gradient holding one of its shard's dtype; the model's ``buffers`` bytes
    alive beside (the peak of a step measured with the optimizer counts them)."""
    used = [(p, dtype) for p, dtype in masters if id(p) in whole.used]
    shards = nn.ParameterList([nn.Parameter(torch.empty(p.shape, dtype=dtype, device=p.device)) for p, dtype in used])
    for p in shards:
        p.grad = torch.zeros_like(p)
    opt = _make_optimizer(optimizer, shards)
    opt.step()
    with _Meter(model=shards, optimizer=opt) as meter, CostRecorder() as recorder:
        opt.step()
    state = sum(v.untyped_storage().nbytes() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    costs = [*whole.forward_backward, *recorder.costs]
    peak = meter.peak_bytes + buffers
    return dataclasses.replace(whole, optimizer_bytes=state, optimizer_peak=peak, costs=costs)


def _mixed_terms(masters, blocks: list[nn.Module], mp: MixedPrecision, master: int) -> dict[str, Any]:
    """ModelProfile's mixed-precision fields (see [Note: Forecasts under mixed precision]): a
    unit's reduce dtype is mp.reduce_dtype, or its gradients' one dtype, or fp32 where it mixes
    dtypes (fp32 norm layers among bf16 ones), as memfit's reduce buffer takes it."""
    owner: dict[int, int] = {}
    for i, b in enumerate(blocks):
        for p in b.parameters():
            owner.setdefault(id(p), i)
    units: dict[int, list[nn.Parameter]] = {}
    for p, _ in masters:
        units.setdefault(owner.get(id(p), -1), []).append(p)  # -1: the root
    made = reduced = 0
    for params in units.values():
        dtype = _reduce_dtype(params, mp)
        made += sum(p.numel() * p.element_size() for p in params)
        reduced += sum(p.numel() * dtype.itemsize for p in params)
    shard = sum(p.numel() * dt.itemsize for p, dt in masters)
    computed = f"{str(mp.param_dtype).removeprefix('torch.')} compute"
    return {
        "master_bytes": master,
        "grad_shard_scale": shard / made if made else 1.0,
        "reduce_scale": reduced / made if made else 1.0,
        "compute": computed + (", torch.nn norm layers in float32" if mp.keep_norms_fp32 else ""),
    }


def _reduce_dtype(params: list[nn.Parameter], mp: MixedPrecision | None) -> torch.dtype:
    """The dtype a unit of ``params`` reduces in: mp.reduce_dtype, else its gradients' one
    dtype, else fp32 (fp32 norm layers among bf16 ones), as memfit's reduce buffer takes it."""
    dtypes = {p.dtype for p in params}
    if mp is not None and mp.reduce_dtype is not None:
        return mp.reduce_dtype
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


def _backward_outside(profile: ModelProfile, made: _BlocksMade) -> dict[str, list[int]]:
    """R_i and E_i per block: the measured step's peak in block i's backward beyond the forecast
    of that moment with every block kept, and the peak of the code's backward after it beyond
    what is alive then (never below 0); see [Note: What the backward holds outside the blocks]."""
    # Block i's backward moment in one process with every block kept, less B_i: what
    # memfit/_plan/_solve.py's _Moments adds up (S + O, the gradients alive, D_i, the blocks
    # before it); its tests check the two agree (the forecast equals the measured step at keep).
    rest_at = profile.grad_rest_at or [profile.grad_rest_bytes] * len(profile.blocks)
    between = profile.between or [0] * len(profile.blocks)
    kept = [b.kept["keep"] for b in profile.blocks]
    within, after = [], []
    for i, b in enumerate(profile.blocks):
        grads = rest_at[i] + sum(c.grad_bytes for c in profile.blocks[i + 1 :])
        alive = profile.measured_state + profile.before_blocks + grads + between[i] + sum(kept[:i])
        within.append(max(0, int(made.backward_peak[i] - alive - b.peak["keep"])) if i in made.backward_peak else 0)
        done = alive + b.grad_bytes + b.input_bytes  # its gradients made; its input may still be held
        after.append(max(0, int(made.after_peak[i] - done)) if i in made.after_peak else 0)
    return {"backward_outside": within, "after_outside": after}


def block_names(profile: ModelProfile) -> list[str]:
    """Each block's name in the forecast's moments: its path, "#k" after it for the k-th call
    of a module run several times ([Note: A module run several times])."""
    names: list[str] = []
    seen: dict[str, int] = {}
    for b in profile.blocks:
        seen[b.path] = seen.get(b.path, 0) + 1
        names.append(b.path if seen[b.path] == 1 else f"{b.path} #{seen[b.path]}")
    return names


def _between(blocks: list[BlockProfile], made: _BlocksMade, marks: dict[str, int]) -> list[int]:
    """D_i per block and D_end: the live bytes the measured step holds as each block starts
    (and as the last ends) beyond what the model names, O and the blocks' kept bytes (see
    [Note: Memory outside the blocks]); never below 0."""
    before, kept, out = marks["before"], 0, []
    for i, b in enumerate(blocks):
        out.append(max(0, made.live.get(i, before) - before - kept - b.input_bytes))
        kept += b.kept["keep"]
    out.append(max(0, made.live_end - before - kept - marks["last_output"]))
    return out


def _without_shared_inputs(prof: BlockProfile, shared: int) -> BlockProfile:
    """``prof`` less ``shared`` bytes of inputs counted outside the blocks (see [Note: Memory
    outside the blocks]); an offloaded block's kept bytes have no input in them already."""
    if not shared:
        return prof
    kept = {d: v if d == "offload" else max(0, v - shared) for d, v in prof.kept.items()}
    peak = {d: max(0, v - shared) for d, v in prof.peak.items()}
    forward = {d: max(0, v - shared) for d, v in prof.forward_peak.items()}
    less = max(0, prof.input_bytes - shared)
    return dataclasses.replace(prof, input_bytes=less, kept=kept, peak=peak, forward_peak=forward)


# [Note: Parameters the step uses]
# Gradients and optimizer state are counted for the parameters the step uses: those its
# backward gives a gradient. A trainable parameter it never reaches (the cross-attention of a
# BART-family decoder used as a causal LM, Fuyu's patch embedding on text) gets no gradient,
# zero_grad(set_to_none=True) leaves it None, and AdamW makes no state for it; counting them
# over-forecast such models by 12% (Fuyu: 65%). So the optimizer's state is made by a real
# first step on the skeleton, and the measured step's backward names the parameters used.
def _used_bytes(module: nn.Module, used: set[int]) -> int:
    """Bytes of ``module``'s parameters (each once) that the step gives a gradient."""
    return sum(p.untyped_storage().nbytes() for p in module.parameters() if id(p) in used)


def _grad_bytes(model: nn.Module) -> int:
    return _grad_bytes_of(model.parameters())


def _grad_bytes_of(params) -> int:
    grads = {id(p.grad): p.grad for p in params if p.grad is not None}
    return sum(g.untyped_storage().nbytes() for g in grads.values())


def _has_labels(inputs: Inputs) -> bool:
    return isinstance(inputs, dict) and inputs.get("labels") is not None


def _same_data(a, b) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.untyped_storage()._cdata == b.untyped_storage()._cdata
        and (a.shape, a.stride(), a.storage_offset()) == (b.shape, b.stride(), b.storage_offset())
    )


# [Note: A head the chunked loss computes exactly]
# The chunked head computes cross_entropy(proj(transform(base(x)[0]))) itself, so it is a
# decision only where the model's own forward computes exactly that: one forward on the
# skeleton checks that the projection is given the base's hidden states (through the
# transform, where there is one), that the logits the model returns are the projection's
# output (no softcapping, scaling or extra dense layer: Gemma 2, Cohere, RemBERT's projection
# to a wider output embedding), and that no router loss is added (output_router_logits).
# Elsewhere the head stays plain: never a different loss.
def _head_gives_the_logits(skeleton: nn.Module, inputs: Inputs, head: LMHead) -> bool:
    if getattr(getattr(skeleton, "config", None), "output_router_logits", False):
        return False
    seen: dict[str, Any] = {}

    def keep(name):
        def hook(module, args, out):
            seen[name] = out[0] if isinstance(out, tuple) else getattr(out, "last_hidden_state", out)

        return hook

    handles = [skeleton.get_submodule(head.base).register_forward_hook(keep("base"))]
    if head.transform is not None:
        handles.append(skeleton.get_submodule(head.transform).register_forward_hook(keep("transform")))
    proj = skeleton.get_submodule(head.proj)
    handles.append(proj.register_forward_pre_hook(lambda m, args: seen.setdefault("proj_in", args[0])))
    handles.append(proj.register_forward_hook(keep("proj")))
    try:
        with torch.no_grad():
            out = call(skeleton, inputs)
    except Exception:  # any failure: not a head the chunked loss computes exactly
        return False
    finally:
        for h in handles:
            h.remove()
    logits = out.get("logits") if isinstance(out, dict) else getattr(out, "logits", None)
    fed = seen.get("transform" if head.transform is not None else "base")
    return _same_data(seen.get("proj_in"), fed) and _same_data(logits, seen.get("proj"))


def _chunked_head(skeleton, inputs, blocks, plain: _WholeStep, head: LMHead, device: DeviceProfile):
    """T_head with the head chunked and the seconds chunking adds to a step: a second forward
    and backward of the skeleton (no optimizer: it does not change), its head's forward
    replaced and restored after."""
    chunk_forward(skeleton, head)
    try:
        step = _measure_step(skeleton, inputs, None, blocks, None)
    finally:
        unchunk_head(skeleton)
    marks = step.marks
    extra = device.ops_time(step.forward_backward) - device.ops_time(plain.forward_backward)
    return marks.get("head_peak", marks["at_last_output"]) - marks["at_last_output"], max(0.0, extra)


# [Note: Planning on fake tensors]
# The planner never runs the model on real memory. It builds a skeleton: a copy of the model's
# modules whose parameters and buffers are fake tensors (torch's FakeTensorMode: shape, dtype,
# device and storage size, no data), and the batch is replaced by fake tensors of the same
# shapes. Every op of the step then runs on the fake tensors, and MemoryMeter counts their
# storage bytes exactly as it counts real ones, so the terms of [Note: The planner's memory
# model] come from shapes alone (a model that reads values from its data runs one forward on
# the batch first: [Note: Values read from the data]). A model on the meta device plans the same way. What the
# planner holds in real memory is the skeleton's module objects and the profile; its peak of
# real tensor storage is the optimizer's scalar step counters (4 bytes each: fake mode keeps
# constants real), far below the bound it promises, the largest block's working set max_i B_i.
# Identical blocks (same class, structure, shapes and inputs, and the same forward in the
# measured step: its ops, the bytes it leaves and its peak) are profiled once. The forward
# tells apart blocks that differ only in a plain attribute (PegasusX staggers the local
# attention blocks of every other encoder layer: twice the memory; Gemma's sliding and global
# layers).
def _fake_copy(model: nn.Module, device) -> nn.Module:
    """The model's modules with fake parameters and buffers (ties kept); call under the mode."""
    memo: dict[int, object] = {}
    for p in model.parameters():
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(_fake_like(p, device), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo.setdefault(id(b), _fake_like(b, device))
    return copy.deepcopy(model, memo)


def _fake_like(t, device):
    if not isinstance(t, torch.Tensor):
        return t
    fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    return fake.requires_grad_(t.requires_grad)  # reads only the shape: no op touches the real tensor


# [Note: The batch from the step's start]
# MemoryMeter counts a tensor made before its region from the first op that touches it; the
# batch is alive for the whole step (the caller holds it), but the real and the fake step touch
# it at different times. transformers checks input_ids for padding (input_ids[:, [-1, 0]]) at
# the start of a real step and skips the check on fake tensors (is_tracing), so the fake step
# first read them at the embedding, after Tapas's segment index had peaked in 3.5 MB of
# temporaries: that peak was forecast without them (256 bytes under). The measured step counts
# the batch from its start: at most its bytes above the measure before the real step reads it,
# never below.
@dataclass
class _WholeStep:
    """What one measured step of the whole model gives the profile."""

    block_inputs: dict[int, tuple]  # block index -> fresh copies of its (args, kwargs)
    marks: dict[str, int]  # live bytes at named moments: before, at_last_output, head_peak; last_output
    optimizer_bytes: int  # the optimizer's state after its first step
    optimizer_peak: int  # P_opt
    costs: list[OpCost]  # every op of the measured step, optimizer step included
    forward_backward: list[OpCost]  # the ops of its forward and backward
    used: set[int] = field(default_factory=set)  # ids of the parameters its backward gave a gradient
    made: _BlocksMade | None = None  # what each block's forward did ([Note: Memory outside the blocks])


def _measure_step(
    model: nn.Module, example_inputs: Inputs, loss_fn: Callable | None, blocks: list[nn.Module], optimizer: str | None
) -> _WholeStep:
    """One step to create the optimizer state, then one under MemoryMeter with hooks that
    capture each block's inputs and mark the moments the memory model names (``optimizer``
    None: forward and backward only, no optimizer)."""
    captured: dict[int, tuple] = {}
    marks: dict[str, int] = {}
    meter_box: list[MemoryMeter] = []
    recorder = CostRecorder()
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    outside = [p for p in model.parameters() if id(p) not in in_blocks]
    blocks_made = _BlocksMade(outside)

    def capture(i):
        def hook(module, args, kwargs):
            if meter_box and i not in blocks_made.started:  # before the copies below
                blocks_made.transient[i] = blocks_made.since_last_block(meter_box[0])
            if i not in captured:
                with recorder.paused():  # the copies kept here are not the step's work
                    captured[i] = _fresh(args, kwargs)
            if meter_box and i not in blocks_made.started:
                blocks_made.start(i, meter_box[0], (args, kwargs), captured, len(recorder.ops))
            if i == 0 and meter_box and "before" not in marks:
                marks["before"] = meter_box[0].current_bytes - _tensor_bytes(captured)  # not the copies kept here
                for t in _outputs_with_grad((args, kwargs)):  # the blocks' backward is over
                    t.register_hook(lambda grad: _tail_starts(meter_box[0], marks, blocks_made))

        return hook

    def made(i):
        def hook(module, args, kwargs, out):
            if meter_box and i not in blocks_made.ended:
                blocks_made.end(i, meter_box[0], out, [f for f, _ in recorder.ops])

        return hook

    def after_last(module, args, kwargs, out):
        if not meter_box:
            return
        meter = meter_box[0]
        blocks_made.live_end = meter.current_bytes - _tensor_bytes(captured)
        marks["at_last_output"] = meter.current_bytes
        marks["last_output"] = _tensor_bytes(out)
        meter.reset_peak()  # from here on: the head, the loss and their backward

        def head_done(grad):
            marks.setdefault("head_peak", meter.peak_bytes)

        for t in _outputs_with_grad(out):
            t.register_hook(head_done)

    def ended(i):
        def post(module, args, kwargs, out):
            made(i)(module, args, kwargs, out)
            if i == len(blocks) - 1:
                after_last(module, args, kwargs, out)  # its hooks first: the head's peak before the window's
            if meter_box and i not in blocks_made.watched:
                blocks_made.watch_backward(i, out, meter_box[0], lambda: _tensor_bytes(captured))

        return post

    opt = _make_optimizer(optimizer, model) if optimizer else None
    with _watching(_ByCall(blocks, capture, ended)) as calls:
        if opt:  # the optimizer's state, as after a first step (fake); see [Note: Parameters the step uses]
            step_loss(model, example_inputs, loss_fn).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        captured.clear()
        marks.clear()
        calls.restart()
        blocks_made = _BlocksMade(outside)
        with _Meter(model=model, optimizer=opt) as whole, recorder:
            whole._track_all(tree_flatten(example_inputs)[0])  # See [Note: The batch from the step's start]
            meter_box.append(whole)
            with _Uses(blocks_made):
                loss = step_loss(model, example_inputs, loss_fn)
            blocks_made.inputs_dead(len(blocks))  # the forward has returned
            loss.backward()
            del loss
            blocks_made.backward_ends()
            # no input of the first block needs a gradient: nothing runs after the blocks' backward
            marks["tail_peak"] = whole.peak_bytes - _tensor_bytes(captured) if "tail" in marks else 0
            # S and what outlives backward, but for the copies of the blocks' inputs kept here
            marks["after_backward"] = whole.current_bytes - _grad_bytes(model) - _tensor_bytes(captured)
            used = {id(p) for p in model.parameters() if p.grad is not None}
    forward_backward = list(recorder.costs)
    if opt is None:  # forward and backward only
        model.zero_grad(set_to_none=True)
        return _WholeStep(captured, marks, 0, 0, forward_backward, forward_backward, used, blocks_made)
    with _Meter(model=model, optimizer=opt) as opt_meter, recorder:
        opt.step()
    opt.zero_grad(set_to_none=True)
    opt_bytes = sum(v.untyped_storage().nbytes() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    costs = recorder.costs
    return _WholeStep(captured, marks, opt_bytes, opt_meter.peak_bytes, costs, forward_backward, used, blocks_made)


def _tail_starts(meter: MemoryMeter, marks: dict[str, int], made: _BlocksMade) -> None:
    """The blocks' backward is over: the backward before them (T_tail) starts from here."""
    made.backward_ends()
    marks["tail"] = 1
    meter.reset_peak()


class _Uses(TorchDispatchMode):
    """The forward's ops, for _BlocksMade.used: the parameters each reads (views of them too,
    by the parameter itself: a Linear reads weight.t(), whose input is the weight)."""

    def __init__(self, made: _BlocksMade) -> None:
        super().__init__()
        self.made = made

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.made.used((args, kwargs))
        return func(*args, **(kwargs or {}))


class _BlocksMade:
    """What one measured forward holds as each block starts (see [Note: Memory outside the
    blocks]): the live bytes, the block's inputs other than the one from the block before, and
    the peak of the code since the block before ended."""

    def __init__(self, outside: list[nn.Parameter] | None = None) -> None:
        self._outside = outside or []  # the parameters outside the blocks
        self._outside_ids = {id(p) for p in self._outside}
        # parameter id -> blocks started when the forward last used it (its gradient exists from
        # the backward of that use: in the backward of every block started before it)
        self.last_use: dict[int, int] = {}
        self.started: set[int] = set()
        self.ended: set[int] = set()
        self.live: dict[int, int] = {}  # block -> live bytes at its start (the copies kept here not)
        self.shared: dict[int, int] = {}  # block -> its copied inputs' bytes other than the chain's
        self.transient: dict[int, int] = {}  # block -> the peak since the block before ended, above its start
        self.live_end = 0  # live bytes as the last block ends
        self._region_start = 0  # live bytes as the block before ended (0: none has)
        # block -> what its forward did in the step: bytes it left, its peak above its start, its ops
        self.fingerprint: dict[int, tuple] = {}
        self.reached: dict[int, set[int]] = {}  # block -> its outputs (of those with grad) given a gradient
        self._last_output: set[int] = set()  # storage keys of the output of the block that ended last
        self._at_start = (0, 0)  # live bytes and ops recorded as the running block started
        # block -> the peak of its backward in the step (from its output's gradient to its input's),
        # and of the code's after it (to the next block's output's gradient), the copies kept here
        # not counted; see [Note: What the backward holds outside the blocks]
        self.backward_peak: dict[int, int] = {}
        self.after_peak: dict[int, int] = {}
        self.watched: set[int] = set()
        self._in_backward: tuple[int, str, MemoryMeter, Callable[[], int]] | None = None
        # the blocks' inputs other than the chain's, by storage: [weak reference, bytes, blocks
        # given it, the first block start it is dead at (None: alive)]; see [Note: Inputs a
        # checkpointed block holds]
        self._inputs: dict[int, list] = {}
        self._dead: list[list] = []

    def start(self, i: int, meter: MemoryMeter, inputs: tuple, captured: dict[int, tuple], ops: int) -> None:
        leaves, copies = tree_flatten(inputs)[0], tree_flatten(captured[i])[0]
        tensors = [(t, c) for t, c in zip(leaves, copies) if isinstance(t, torch.Tensor)]
        chain = tensors[:1] if tensors and tensors[0][0].untyped_storage()._cdata in self._last_output else []
        self.shared[i] = sum(c.untyped_storage().nbytes() for _, c in tensors[len(chain) :])
        self.inputs_dead(i)
        for t, _ in tensors[len(chain) :]:
            st = t.untyped_storage()
            entry = self._inputs.get(st._cdata)
            if entry is None or entry[0].expired():
                entry = self._inputs[st._cdata] = [StorageWeakRef(st), st.nbytes(), set(), None]
            entry[2].add(i)
        if chain and chain[0][0].requires_grad:  # its gradient: the block's backward is over
            chain[0][0].register_hook(lambda grad: self._block_done(i))
        self.live[i] = meter.current_bytes - _tensor_bytes(captured)
        self.started.add(i)
        meter.reset_peak()
        self._at_start = (meter.current_bytes, ops)

    def _reached(self, i: int, n: int, grad: torch.Tensor) -> None:
        self.reached.setdefault(i, set()).add(n)

    def watch_backward(self, i: int, out, meter: MemoryMeter, copies: Callable[[], int]) -> None:
        """Hooks on block i's outputs with grad: which ones the backward reaches, and (its first
        output, the chain's) when its backward starts."""
        self.watched.add(i)
        for n, t in enumerate(_outputs_with_grad(out)):
            t.register_hook(functools.partial(self._reached, i, n))
            if n == 0:
                t.register_hook(lambda grad: self._backward_starts(i, meter, copies))

    def _backward_starts(self, i: int, meter: MemoryMeter, copies: Callable[[], int]) -> None:
        self.backward_ends()
        meter.reset_peak()
        self._in_backward = (i, "block", meter, copies)

    def _block_done(self, i: int) -> None:
        if self._in_backward is not None and self._in_backward[:2] == (i, "block"):
            _, _, meter, copies = self._in_backward
            self.backward_ends()
            meter.reset_peak()
            self._in_backward = (i, "after", meter, copies)

    def backward_ends(self) -> None:
        """The window running ends (the next block's backward starts, the tail's, or the step's end)."""
        if self._in_backward is not None:
            i, kind, meter, copies = self._in_backward
            (self.backward_peak if kind == "block" else self.after_peak)[i] = meter.peak_bytes - copies()
            self._in_backward = None

    def inputs_dead(self, when: int) -> None:
        """The blocks' inputs freed by now (block ``when`` starts, or the forward's end: the
        number of blocks) are dead from ``when``."""
        for key, entry in list(self._inputs.items()):
            if entry[0].expired():
                entry[3] = when
                self._dead.append(entry)
                del self._inputs[key]

    def released(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """H: (bytes, dead from, blocks given it) per input freed before the forward's end."""
        return [(nbytes, when, tuple(sorted(given))) for _, nbytes, given, when in self._dead]

    def used(self, args) -> None:
        """An op of the forward: the parameters outside the blocks it reads."""
        for t in tree_flatten(args)[0]:
            if id(t) in self._outside_ids:
                self.last_use[id(t)] = len(self.started)

    def rest_at(self, i: int) -> int:
        """G_rest_i: bytes of the gradients of the parameters outside the blocks that the forward
        used after block i started."""
        return sum(p.untyped_storage().nbytes() for p in self._outside if self.last_use.get(id(p), -1) > i)

    def end(self, i: int, meter: MemoryMeter, out, ops: list) -> None:
        live, first = self._at_start
        self.fingerprint[i] = (meter.current_bytes - live, meter.peak_bytes - live, tuple(ops[first:]))
        self._last_output = {t.untyped_storage()._cdata for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)}
        self.ended.add(i)
        meter.reset_peak()  # the code before the next block starts from here
        self._region_start = meter.peak_bytes

    def since_last_block(self, meter: MemoryMeter) -> int:
        """F_i: the peak since the block before ended above what is alive now, where that code
        allocated beyond the block's end (else the forward of the block before covers it)."""
        peak = meter.peak_bytes
        return max(0, peak - meter.current_bytes) if peak > self._region_start else 0


class _Meter(MemoryMeter):
    """MemoryMeter without the breakdown by category at each new peak (the planner reads the
    totals only; naming the categories costs O(live tensors) per peak)."""

    def _categorise(self) -> dict[str, int]:
        return {}

    def entries(self) -> dict[int, tuple]:
        """The live storages now: key -> the meter's entry (a new entry for a reused key)."""
        self._sweep()
        return dict(self._live)


def _make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "adamw":
        return torch.optim.AdamW(params)
    if name == "adam":
        return torch.optim.Adam(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    raise ValueError(f"memfit.plan: unknown optimizer {name!r}; choose 'adamw', 'adam' or 'sgd'")
