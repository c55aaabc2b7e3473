"""What the planner's fake step needs beyond FakeTensorMode: shape rules for ops whose meta
kernels refuse what the real kernels run, and the values a step reads from its data."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

# [Note: Ops the meta kernels refuse]
# FakeTensorMode computes an op's output from its meta kernel, which for some ops checks more
# than the real kernels do: torch's meta kernel for aten._grouped_mm (how transformers runs
# the experts of every MoE: Mixtral, Qwen-MoE, OLMoE, DeepSeek, gpt-oss, ...) accepts bfloat16
# only, while the CPU kernel (and CUDA's, on recent torch) runs float32 too. While the planner
# traces, _FakeRules answers such an op itself for the inputs the meta kernel refuses: the
# output torch's own shape rule gives (_create_grouped_mm_output_tensor, the same sizes and
# strides the meta kernel allocates for bfloat16), in the dtype the op returns. Nothing is
# registered globally: outside the planner the op is torch's.

# [Note: Values read from the data]
# A few steps read values from their tensors' data, which fake tensors do not have: a router
# that splits tokens by expert_size.tolist() (JetMoE), a model that trims its batch to
# lengths.max().item() (XLM), eager experts that loop over torch.nonzero(...) of the routing
# mask. The planner first traces without them; if an op needs one, it runs the model's
# forward once on the real example batch (train mode, no gradients, the random state and the
# buffers restored after, caches off as in the fake step) and records, for each op that reads
# data (torch's data_dependent_output and dynamic_output_shape ops, and Tensor.tolist), what
# it returned: a scalar, or the shape of a tensor; and, for every boolean tensor that indexes
# (x[mask], x[mask] = v), its count of True, the largest per mask shape: the backward of
# x[mask] = v indexes its gradient by the mask, which no forward op read (SpeechT5's and
# wav2vec2's SpecAugment mask time steps so), and gets that count. The fake step then gets the recorded answer
# at the same place: the n-th call of the same op on arguments of the same shapes inside the
# same module's call (counted per op and shapes: a real kernel may read data the fake one does
# not, one_hot's class check, which a count over every op would shift at: LongcatFlash). A module
# called several times keeps the largest answer (the largest count, the largest tensor), a
# bound on what any of its calls needs. An op no module call frames (a checkpointed block's
# recompute in backward runs its own forward outside Module.__call__) gets the largest answer
# recorded for the same op on arguments of the same shapes and dtypes (identical blocks: a
# bound over them). The assumption: the step being planned reads the
# values this forward read. Costs: one real forward without gradients (its time, and its
# memory: the parameters and one layer's working set), only for models that read their data;
# a model on the meta device cannot be planned this way (no data) and the error says so. The
# forecast error it adds: the measured step runs after an optimizer step, so a router may send
# a few tokens elsewhere than on the weights recorded (within the 3% the tests allow).

_DATA_EXCEPTIONS = (DataDependentOutputException, DynamicOutputShapeException)


def _reads_data(func) -> bool:
    return torch.Tag.data_dependent_output in func.tags or torch.Tag.dynamic_output_shape in func.tags


@dataclass
class _TensorLike:
    """What replaying an op's tensor output needs: its sizes, strides and dtype."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _describe(out):
    return tree_map(lambda t: _TensorLike(tuple(t.shape), t.stride(), t.dtype) if torch.is_tensor(t) else t, out)


def _larger(a, b):
    """The larger of two recorded answers of one op (a bound on both)."""
    if isinstance(a, _TensorLike) and isinstance(b, _TensorLike):
        return a if torch.Size(a.shape).numel() >= torch.Size(b.shape).numel() else b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return type(a)(_larger(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return max(a, b)
    return a


def _shapes(args) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in tree_flatten(args)[0] if torch.is_tensor(t))


@dataclass
class DataValues:
    """Answers recorded per (module path, n-th data-reading op in that module's call), and
    per (op, shapes and dtypes of its tensor arguments) for a call no module frames."""

    answers: dict[tuple, object] = field(default_factory=dict)  # (path, op, shapes, n-th) -> answer
    by_shape: dict[tuple, object] = field(default_factory=dict)
    mask_counts: dict[tuple[int, ...], int] = field(default_factory=dict)  # a boolean index's shape -> its Trues

    def add_masks(self, func, args) -> None:
        """The count of True of each boolean tensor indexing in ``func`` (the largest per shape)."""
        if func not in _INDEXING or len(args) < 2:
            return
        for mask in args[1]:
            if torch.is_tensor(mask) and mask.dtype == torch.bool:
                count = int(mask.sum())
                self.mask_counts[tuple(mask.shape)] = max(count, self.mask_counts.get(tuple(mask.shape), 0))

    def add(self, key: tuple, op: str, shapes: tuple, value) -> None:
        old = self.answers.get(key)
        self.answers[key] = value if old is None else _larger(old, value)
        known = self.by_shape.get((op, shapes))
        self.by_shape[(op, shapes)] = value if known is None else _larger(known, value)

    def find(self, key: tuple, op: str, shapes: tuple):
        """The answer the n-th such op gave in the same module's call, else the largest for
        the op and shapes anywhere."""
        found = self.answers.get(key)
        return found if found is not None else self.by_shape.get((op, shapes))


class _Calls:
    """The stack of module calls running, each with its count of data-reading ops so far, per
    op and argument shapes (a real step's kernels read data the fake step's do not: one_hot
    checks its classes with .item(); a count over every op would shift at each of them)."""

    def __init__(self, model: nn.Module) -> None:
        self.paths = {id(m): p for p, m in model.named_modules()}
        self.stack: list[tuple[str, dict]] = []

    def next_key(self, op: str, shapes: tuple) -> tuple:
        if not self.stack:
            return ("", op, shapes, -1)
        path, counts = self.stack[-1]
        n = counts[(op, shapes)] = counts.get((op, shapes), -1) + 1
        return (path, op, shapes, n)

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        def pre(module, args):
            self.stack.append((self.paths.get(id(module), "?"), {}))

        def post(module, args, out):
            if self.stack:
                self.stack.pop()

        handles = [
            nn.modules.module.register_module_forward_pre_hook(pre),
            nn.modules.module.register_module_forward_hook(post, always_call=True),
        ]
        try:
            yield
        finally:
            for h in handles:
                h.remove()


class _Record(TorchDispatchMode):
    def __init__(self, calls: _Calls, values: DataValues) -> None:
        super().__init__()
        self.calls, self.values = calls, values

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.values.add_masks(func, args)
        if _reads_data(func):
            op, shapes = str(func), _shapes((args, kwargs))
            self.values.add(self.calls.next_key(op, shapes), op, shapes, _describe(out))
        return out


class _ToList(TorchFunctionMode):
    """Tensor.tolist reads a real tensor's data without an aten op; FakeTensor.tolist runs one
    .item() per element. So a recorded tolist is one _local_scalar_dense answer per element,
    in the order FakeTensor's asks for them."""

    def __init__(self, calls: _Calls, values: DataValues) -> None:
        super().__init__()
        self.calls, self.values = calls, values

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.tolist:
            item, shapes = str(torch.ops.aten._local_scalar_dense.default), (((), args[0].dtype),)
            for x in tree_flatten(out)[0]:
                self.values.add(self.calls.next_key(item, shapes), item, shapes, x)
        return out


def record_data_values(model: nn.Module, run: Callable[[], object]) -> DataValues:
    """The answers of every data-reading op in ``run()`` (a real forward of ``model``), as in
    [Note: Values read from the data]."""
    values = DataValues()
    calls = _Calls(model)
    with calls.hooks(), _Record(calls, values), _ToList(calls, values):
        run()
    return values


_INDEXING = {
    torch.ops.aten.index.Tensor,
    torch.ops.aten.index_put.default,
    torch.ops.aten.index_put_.default,
    torch.ops.aten._index_put_impl_.default,
}


def _masked_index(values: DataValues, func, args) -> _TensorLike | None:
    """``x[mask]`` (aten.index.Tensor, one boolean index, the others None) from the count of
    True recorded for a mask of its shape: the backward of ``x[mask] = v`` (SpecAugment's
    masked time steps) indexes by a mask no forward op read."""
    if func is not torch.ops.aten.index.Tensor:
        return None
    x, indices = args[0], list(args[1])
    masks = [(k, i) for k, i in enumerate(indices) if i is not None]
    if len(masks) != 1 or masks[0][1].dtype != torch.bool:
        return None
    k, mask = masks[0]
    count = values.mask_counts.get(tuple(mask.shape))
    if count is None:
        return None
    shape = (*x.shape[:k], count, *x.shape[k + mask.dim() :])
    return _TensorLike(shape, torch.empty(shape, device="meta").stride(), x.dtype)


def _replay(values: DataValues | None, key, op: str, shapes: tuple, compute: Callable, device, masked=None):
    try:
        return compute()
    except _DATA_EXCEPTIONS as e:
        found = values.find(key, op, shapes) if values is not None else None
        found = masked() if found is None and masked is not None and values is not None else found
        if found is None:
            raise NeedsDataError(op, key[0]) from e
        return tree_map(
            lambda v: (
                torch.empty_strided(v.shape, v.stride, dtype=v.dtype, device=device)
                if isinstance(v, _TensorLike)
                else v
            ),
            found,
        )


class NeedsDataError(RuntimeError):
    """An op of the fake step needs a value from the data that no real forward recorded."""

    def __init__(self, op: str, path: str) -> None:
        super().__init__(f"{op} in {path or 'the model'}")
        self.op, self.path = op, path


class _FakeRules(TorchDispatchMode):
    """Pushed above the planner's FakeTensorMode: see [Note: Ops the meta kernels refuse] and
    [Note: Values read from the data]."""

    def __init__(self, calls: _Calls, values: DataValues | None) -> None:
        super().__init__()
        self.calls, self.values = calls, values

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default and not _bf16(args):
            return _grouped_mm_output(*args, **kwargs)
        if not _reads_data(func):
            return func(*args, **kwargs)
        device = next((t.device for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t)), None)
        op, shapes = str(func), _shapes((args, kwargs))
        key = self.calls.next_key(op, shapes)
        masked = (lambda: _masked_index(self.values, func, args)) if self.values is not None else None
        return _replay(self.values, key, op, shapes, lambda: func(*args, **kwargs), device, masked)


def _bf16(args) -> bool:
    return all(t.dtype == torch.bfloat16 for t in args[:2])


def _grouped_mm_output(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    from torch._meta_registrations import _create_grouped_mm_output_tensor

    if bias is not None:
        raise NotImplementedError("memfit.plan: aten._grouped_mm with a bias (no kernel runs one)")
    return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype or mat_a.dtype)


@contextlib.contextmanager
def _formatted() -> Iterator[None]:
    """f"{t}" of a real 0-dim tensor formats its value (Tensor.__format__ calls .item()); a
    FakeTensor's formats its repr. Switch Transformers names its experts f"expert_{idx[0]}": the
    fake step formats the value .item() is answered with (recorded, see [Note: Values read from
    the data]). On the class, not a TorchFunctionMode: a checkpointed block's recompute runs
    inside backward, where no mode entered outside it is seen."""

    def formatted(self, spec):
        return format(self.detach().item(), spec) if self.dim() == 0 else object.__format__(self, spec)

    with _class_attribute(FakeTensor, "__format__", formatted):
        yield


@contextlib.contextmanager
def _class_attribute(cls: type, name: str, value) -> Iterator[None]:
    """``cls.name`` set to ``value`` inside the block, then exactly what it was (a planner
    inside another's fake step restores the outer one's)."""
    missing = object()
    before = cls.__dict__.get(name, missing)
    setattr(cls, name, value)
    try:
        yield
    finally:
        if before is missing:
            delattr(cls, name)
        else:
            setattr(cls, name, before)


@contextlib.contextmanager
def _unchanged_to() -> Iterator[None]:
    """Module.to() that changes nothing (Switch Transformers' router calls
    ``self.classifier.to(self.dtype)`` in every forward) is a no-op on fake parameters too:
    torch swaps every fake parameter for a new one, which fails while the step holds it."""
    original = nn.Module._apply

    def _apply(module, fn, recurse=True):
        tensors = [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]
        if tensors and all(isinstance(t, FakeTensor) for t in tensors):
            with torch.no_grad():
                if all(fn(t) is t for t in tensors):
                    return module
        return original(module, fn, recurse)

    with _class_attribute(nn.Module, "_apply", _apply):
        yield


@contextlib.contextmanager
def fake_rules(model: nn.Module, values: DataValues | None) -> Iterator[None]:
    """Enter inside the planner's FakeTensorMode, around everything traced on ``model``'s
    skeleton (its module paths key the recorded values)."""
    calls = _Calls(model)
    with calls.hooks(), _FakeRules(calls, values), _formatted(), _unchanged_to():
        yield
