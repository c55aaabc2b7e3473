"""One measured step of the whole model: what exists around the blocks at each moment the memory
model names (before, between and after them, in their backward, at the optimizer step)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memfit._plan._candidates import _ByCall, _watching
from memfit._plan._profile_types import BlockProfile, ModelProfile
from memfit._plan._step import Inputs, _fresh, _make_optimizer, _Meter, _outputs_with_grad, _tensor_bytes, step_loss
from memfit._plan._time import CostRecorder, OpCost
from memfit.memory import MemoryMeter

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


class _StepHooks:
    """The measured step's hooks (see _measure_step): before each block, its inputs captured
    and its start marked; after it, what it made and, for the last, the head's window."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module], recorder: CostRecorder) -> None:
        self.captured: dict[int, tuple] = {}
        self.marks: dict[str, int] = {}
        self.meter_box: list[MemoryMeter] = []
        self.recorder = recorder
        self.blocks = blocks
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        self.outside = [p for p in model.parameters() if id(p) not in in_blocks]
        self.blocks_made = _BlocksMade(self.outside)

    def capture(self, i):
        captured, marks, meter_box, recorder = self.captured, self.marks, self.meter_box, self.recorder

        def hook(module, args, kwargs):
            blocks_made = self.blocks_made
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

    def made(self, i):
        def hook(module, args, kwargs, out):
            if self.meter_box and i not in self.blocks_made.ended:
                self.blocks_made.end(i, self.meter_box[0], out, [f for f, _ in self.recorder.ops])

        return hook

    def after_last(self, module, args, kwargs, out):
        if not self.meter_box:
            return
        meter, marks = self.meter_box[0], self.marks
        self.blocks_made.live_end = meter.current_bytes - _tensor_bytes(self.captured)
        marks["at_last_output"] = meter.current_bytes
        marks["last_output"] = _tensor_bytes(out)
        meter.reset_peak()  # from here on: the head, the loss and their backward

        def head_done(grad):
            marks.setdefault("head_peak", meter.peak_bytes)

        for t in _outputs_with_grad(out):
            t.register_hook(head_done)

    def ended(self, i):
        def post(module, args, kwargs, out):
            self.made(i)(module, args, kwargs, out)
            if i == len(self.blocks) - 1:
                self.after_last(module, args, kwargs, out)  # its hooks first: the head's peak before the window's
            if self.meter_box and i not in self.blocks_made.watched:
                self.blocks_made.watch_backward(i, out, self.meter_box[0], lambda: _tensor_bytes(self.captured))

        return post


def _measure_step(
    model: nn.Module,
    example_inputs: Inputs,
    loss_fn: Callable | None,
    blocks: list[nn.Module],
    optimizer: str | None,
    foreach: bool | None = None,
    *,
    warmed: bool = False,
    keep_grads: bool = False,
) -> _WholeStep:
    """One step to create the optimizer state, then one under MemoryMeter with hooks that
    capture each block's inputs and mark the moments the memory model names (``optimizer``
    None: forward and backward only, no optimizer). ``warmed``: the parameters hold the
    gradients of a step already, which the first step takes; ``keep_grads`` (no optimizer):
    the measured step's gradients stay on the parameters (See [Note: The chunked step as the
    optimizer's first] in memfit/_plan/_profile.py)."""
    recorder = CostRecorder()
    hooks = _StepHooks(model, blocks, recorder)
    captured, marks = hooks.captured, hooks.marks
    opt = _make_optimizer(optimizer, model, foreach) if optimizer else None
    with _watching(_ByCall(blocks, hooks.capture, hooks.ended)) as calls:
        if opt:  # the optimizer's state, as after a first step (fake); see [Note: Parameters the step uses]
            if not warmed:
                step_loss(model, example_inputs, loss_fn).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        captured.clear()
        marks.clear()
        calls.restart()
        blocks_made = hooks.blocks_made = _BlocksMade(hooks.outside)
        with _Meter(model=model, optimizer=opt) as whole, recorder:
            whole._track_all(tree_flatten(example_inputs)[0])  # See [Note: The batch from the step's start]
            hooks.meter_box.append(whole)
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
        if not keep_grads:
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
