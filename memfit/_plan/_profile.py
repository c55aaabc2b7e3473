"""Measure what the planner's memory model needs: a skeleton of the model on fake tensors, its
blocks measured one by one (_block_profile) and its whole step (_step_profile), into one
ModelProfile (_profile_types)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from memfit._checkpoint import Offload
from memfit._checkpoint._decision import KINDS as DECISIONS
from memfit._plan._block_profile import _profile_block, _signature, _without_shared_inputs
from memfit._plan._calibrate import device_profile
from memfit._plan._candidates import _candidate_paths
from memfit._plan._head import LMHead, find_head, unchunk_head
from memfit._plan._head import chunk_head as chunk_forward
from memfit._plan._mixed_profile import _compute_as, _inputs_to, _master_step, _mixed_terms, _reduce_dtype
from memfit._plan._profile_types import ModelProfile
from memfit._plan._step import Inputs, _buffer_bytes, _Meter, _state_bytes, call
from memfit._plan._step_profile import _backward_outside, _between, _BlocksMade, _measure_step, _used_bytes, _WholeStep
from memfit._plan._target import target_of
from memfit._plan._time import DeviceProfile
from memfit._plan._trace import DataValues, NeedsDataError, fake_rules, record_data_values
from memfit._shard._mixed import MixedPrecision


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


def _profile(
    model, example_inputs, paths, values, *, loss_fn, optimizer, rule, offload, decisions, device, chunk_head,
    mixed_precision,
):  # fmt: skip
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    on = "cpu" if (p0 := next(iter(model.parameters()), None)) is None or p0.device.type == "meta" else p0.device
    mp = mixed_precision
    with fake, (target := target_of(device)).tracing(_Meter):  # See [Note: The target's op stream]
        skeleton = _fake_copy(model, on)
        inputs = tree_map(lambda t: _fake_like(t, on), example_inputs)
        skeleton.train()
        _caches_off(skeleton)
        _layerdrop_off(skeleton)
        masters = _compute_as(skeleton, mp) if mp else []
        with fake_rules(skeleton, values):
            head = find_head(model) if chunk_head and loss_fn is None and _has_labels(example_inputs) else None
            paths, blocks, head = _blocks_and_head(skeleton, inputs, paths, type(model).__name__, head, mp)
            whole, chunked_step = _steps(
                skeleton, inputs, loss_fn, blocks, None if mp else optimizer, target.foreach, head
            )
            if mp:  # the optimizer steps on the shards, in their own dtype
                whole = _master_step(whole, masters, optimizer, _buffer_bytes(skeleton), target.foreach)
            made = whole.made or _BlocksMade()
            profiles, seen = [], {}
            for i, (path, blk) in enumerate(zip(paths, blocks)):
                args, kwargs = whole.block_inputs[i]
                reached = made.reached.get(i, set())
                key = (_signature(blk, args, kwargs), made.fingerprint.get(i), tuple(sorted(reached)))
                if key not in seen:  # identical blocks are profiled once
                    seen[key] = _profile_block(path, blk, args, kwargs, reached, rule, offload, decisions, device,
                                               target.offload_prefetch)  # fmt: skip
                prof = _without_shared_inputs(seen[key], made.shared.get(i, 0))
                last = path not in paths[i + 1 :]  # a module's gradients once: [Note: A module run several times]
                grads = _used_bytes(blk, whole.used) if last else 0
                profiles.append(dataclasses.replace(prof, path=path, grad_bytes=grads))
            in_blocks = {id(p) for b in blocks for p in b.parameters()}
            grad_rest = _used_bytes(skeleton, whole.used - in_blocks)
            root = [p for p in skeleton.parameters() if p.requires_grad and id(p) not in in_blocks]
            state = _state_bytes(skeleton)
            buffers = _buffer_bytes(skeleton)
            chunked = _chunked_terms(chunked_step, whole, device) if chunked_step else None
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
        **device.step_fields(whole.forward_backward, whole.costs[len(whole.forward_backward) :]),
        step_ops=whole.costs,
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
    return dataclasses.replace(profile, offload_stash=target.offload_stash, **_backward_outside(profile, made))


def _blocks_and_head(skeleton, inputs, paths, name: str, head: LMHead | None, mp: MixedPrecision | None):
    """The candidates' paths and modules (their inputs cast under ``mp``) and ``head`` where
    the chunked loss computes it exactly, from one forward ([Note: One forward, two checks])."""
    check = _HeadCheck(skeleton, head)
    paths = _candidate_paths(skeleton, inputs, paths, name, check)
    blocks = [skeleton.get_submodule(p) for p in paths]
    if mp is not None:
        for b in blocks:
            b.register_forward_pre_hook(_inputs_to(mp.param_dtype), with_kwargs=True)
    return paths, blocks, check.exact_head()


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
class _HeadCheck:
    """The check of [Note: A head the chunked loss computes exactly] as hooks on the forward
    the candidates are found with ([Note: One forward, two checks]): a context manager whose
    ``__enter__`` returns the callable given the forward's output; ``exact_head`` after: the
    head where it is one (``head`` None: none, nothing watched)."""

    def __init__(self, skeleton: nn.Module, head: LMHead | None) -> None:
        self.skeleton, self.head = skeleton, head
        self.seen: dict[str, Any] = {}
        self.out: Any = None
        self.failed = False  # a hook that could not read what it watches: not such a head
        self.handles: list = []

    def _keep(self, name: str):
        def hook(module, args, out):
            self.seen[name] = out[0] if isinstance(out, tuple) else getattr(out, "last_hidden_state", out)

        return self._guarded(hook)

    def _guarded(self, hook):
        def guarded(*args):
            try:
                hook(*args)
            except Exception:  # any failure: not a head the chunked loss computes exactly
                self.failed = True

        return guarded

    def __enter__(self):
        skeleton, head = self.skeleton, self.head
        if head is None:
            return self._output
        self.handles = [skeleton.get_submodule(head.base).register_forward_hook(self._keep("base"))]
        if head.transform is not None:
            self.handles.append(skeleton.get_submodule(head.transform).register_forward_hook(self._keep("transform")))
        proj = skeleton.get_submodule(head.proj)
        first_input = self._guarded(lambda m, args: self.seen.setdefault("proj_in", args[0]))
        self.handles.append(proj.register_forward_pre_hook(first_input))
        self.handles.append(proj.register_forward_hook(self._keep("proj")))
        return self._output

    def _output(self, out) -> None:
        self.out = out

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def exact_head(self) -> LMHead | None:
        head, out, seen = self.head, self.out, self.seen
        if (
            head is None
            or self.failed
            or getattr(getattr(self.skeleton, "config", None), "output_router_logits", False)
        ):
            return None
        logits = out.get("logits") if isinstance(out, dict) else getattr(out, "logits", None)
        fed = seen.get("transform" if head.transform is not None else "base")
        exact = _same_data(seen.get("proj_in"), fed) and _same_data(logits, seen.get("proj"))
        return head if exact else None


# [Note: One forward, two checks]
# Finding the candidates runs one forward of the skeleton without gradients (which modules
# run, in which order: [Note: Default candidates]); the check of the LM head ([Note: A head
# the chunked loss computes exactly]) needs one such forward as well. The head's hooks watch
# the candidates' forward, so the two cost one (on llama-8b, a forward of 32 layers at 8192
# tokens: about a second of the planner's time, per micro-batch size in memfit.autoconfigure).
# A forward that raises raises from the candidates' search, as it did before the check ran.


def _chunked_step(skeleton, inputs, blocks, head: LMHead, keep_grads: bool = False) -> _WholeStep:
    """A forward and backward of the skeleton with its head chunked (no optimizer: it does not
    change), its head's forward replaced and restored after; ``keep_grads``: the step's
    gradients left on the parameters (see [Note: The chunked step as the optimizer's first])."""
    chunk_forward(skeleton, head)
    try:
        return _measure_step(skeleton, inputs, None, blocks, None, keep_grads=keep_grads)
    finally:
        unchunk_head(skeleton)


def _chunked_terms(step: _WholeStep, plain: _WholeStep, device: DeviceProfile) -> tuple[int, float]:
    """T_head with the head chunked and the seconds chunking adds to a step."""
    marks = step.marks
    extra = device.ops_time(step.forward_backward) - device.ops_time(plain.forward_backward)
    return marks.get("head_peak", marks["at_last_output"]) - marks["at_last_output"], max(0.0, extra)


# [Note: The chunked step as the optimizer's first]
# The measured step runs with the optimizer's state made ([Note: Parameters the step uses]),
# which takes a first step: a forward and backward of the whole skeleton that nothing else
# reads. Where the head is a decision, the step with the head chunked is measured as well
# ([Note: The head as a decision]), on the same parameters: so it runs first, leaves its
# gradients, and the optimizer's first step takes them. The state it makes is the same as
# the plain step's would be where both steps give the same parameters a gradient, which the
# plain measured step then checks (its parameters with a gradient against the chunked
# step's); where they differ, the measured step runs again after a first step of its own.
# On llama-8b this is one step of three, a third of the planner's time.
def _steps(skeleton, inputs, loss_fn, blocks, optimizer, foreach, head: LMHead | None):
    """The measured plain step and, with ``head``, the chunked one (see [Note: The chunked
    step as the optimizer's first]); ``optimizer`` None: forward and backward only."""
    if head is None or optimizer is None:
        whole = _measure_step(skeleton, inputs, loss_fn, blocks, optimizer, foreach)
        return whole, _chunked_step(skeleton, inputs, blocks, head) if head else None
    chunked = _chunked_step(skeleton, inputs, blocks, head, keep_grads=True)
    whole = _measure_step(skeleton, inputs, loss_fn, blocks, optimizer, foreach, warmed=True)
    if whole.used != chunked.used:
        whole = _measure_step(skeleton, inputs, loss_fn, blocks, optimizer, foreach)
    return whole, chunked


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
