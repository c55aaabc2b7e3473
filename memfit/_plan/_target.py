"""The op stream of the device a plan is for: what the planner's fake step runs when it plans
for an accelerator, wherever the planner itself runs (see [Note: The target's op stream])."""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten, tree_map

from memfit._plan._time import DeviceProfile

# [Note: The target's op stream]
# A plan made on a CPU-only host for an accelerator ("h100", a CUDA calibration) must trace
# the step that accelerator runs: the fake step's tensors are CPU fake tensors, so torch
# dispatches them as the CPU would, and the CPU's stream differs where the memory is (BERT-
# large, seq 512, dropout 0.1: 39,218 MiB forecast, 19,622 MiB allocated on an H100). Fake
# CUDA tensors are not an option on a CPU-only build: SDPA on a fake CUDA tensor picks the
# math path (no CUDA backend chooser is compiled in) and a device guard for CUDA aborts the
# process. So the planner maps, with the rule written here, the few places the CUDA step
# differs, while it traces for a CUDA target (Target.cuda), on any host (planning on the GPU
# itself traces the same stream: the rules below are what CUDA picks there too):
#   - scaled_dot_product_attention: the backend torch's CUDA chooser (sdp_utils.cpp,
#     select_sdp_backend, default priority flash > memory-efficient > math; sm80+) picks:
#     flash for float16/bfloat16 with no attn_mask and equal q/k/v head dims <= 256 (GQA
#     included); else memory-efficient for float32/float16/bfloat16 with q and k head dims
#     equal and q and v head dims a multiple of 16 bytes, a mask allowed (a boolean one
#     converted to an additive mask of the query's dtype, as attention.cpp does), not GQA with
#     fewer key/value heads; else math (aten._scaled_dot_product_attention_math: the scores
#     materialised, where the CPU would pick its own flash kernel). Dropout is allowed in both fused
#     backends. The fused ops' meta kernels (torch/_meta_registrations.py) give their outputs:
#     no batch x heads x seq^2 score tensor, a logsumexp and the RNG state kept for backward.
#   - F.dropout (not in place, training, 0 < p < 1): aten.native_dropout, as at::dropout does
#     on CUDA (is_fused_kernel_acceptable), one boolean mask kept; the CPU's path is four ops
#     (bernoulli_, div_, mul) with a mask of the input's dtype. In-place dropout and the
#     feature dropouts run the same impl on both devices: left as they are.
#   - the optimizer: torch's default on CUDA tensors (_default_to_fused_or_foreach: foreach,
#     not fused, for Adam, AdamW and SGD), where the CPU runs the per-parameter loop. foreach's
#     temporaries (AdamW's sqrt of the second moments, one list the size of the parameters)
#     are in the optimizer step's peak.
#   - the caching allocator's rounding: every allocation takes a multiple of 512 bytes
#     (CUDACachingAllocator's kMinBlockSize), so MemoryMeter counts each storage so rounded.
#   - host offload's streams ([Note: Host offload]): an offloaded block's backward prefetches
#     the group of the block before it on the side stream, so its backward moment holds one
#     more block input than full checkpointing's; in forward the stash keeps the sources of
#     the last two offloaded blocks on the device ([Note: The offload stash]). The fake step
#     runs no streams, so the profile adds both (Target.offload_prefetch, offload_stash).
#   - transformers' causal mask: on fake tensors its SDPA check (_ignore_causal_mask_sdpa) takes
#     the cache position for a traced graph and passes a [batch, 1, q, k] mask where the real
#     step passes none and is_causal=True (so CUDA runs flash, with GQA, not memory-efficient
#     with a mask); the check is given the real step's answer where it reads no value, and
#     its test for packed sequences (position ids restarting in a row: it reads their values)
#     answers "one sequence per row", as for a batch without position ids (an assumption
#     where the batch's own position ids pack several sequences).
# CPU profiles get no mapping (Target()): their forecasts are those of the CPU's stream.
# Patched as module attributes, not a TorchFunctionMode: a checkpointed block's recompute runs
# inside backward, where no mode entered outside it is seen (the recompute of a full block must
# trace the fused attention too). The patches, the module hooks and the autocast kernels are
# process-wide, so one thread traces a CUDA target at a time (_TRACING, a lock held for the
# trace: a second planner waits), and each patch acts for that thread only: another thread's
# F.scaled_dot_product_attention, F.dropout and module calls run as torch's own meanwhile
# (the fake step's autograd runs on the tracing thread: its tensors are CPU fakes). The one
# thing another thread can see is the autocast kernels: an op of the lists above run under the
# host's autocast by another thread during a trace runs without autocast's cast (a kernel
# cannot hand over to the one it replaces).
#   - autocast: a plan made inside torch.autocast("cpu", dtype) (the host's autocast: CUDA's
#     cannot be entered on a CPU-only build) traces CUDA autocast's op lists, by a kernel at
#     the AutocastCPU key per op for the trace's duration (torch.library; torch's own kernels
#     are back after). The lists are aten/src/ATen/autocast_mode.h's (AT_FORALL_LOWER_PRECISION_FP,
#     AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_PROMOTE); which of their ops CUDA
#     registers and the CPU does not is read from the dispatcher (a CPU build registers both
#     keys' kernels), so the mapping follows the installed torch:
#       lower precision: the ops CUDA lowers and the CPU leaves alone (addmv, addr, mv, einsum,
#         chain_matmul, linalg_multi_dot, convolution, the RNN cells) cast their floating
#         inputs (not float64) to the autocast dtype, as cached_cast does; a weight is cast at
#         each such call (CUDA caches a leaf's cast for the region: one copy more per extra
#         use of a weight by these ops, never less);
#       fp32 (layer_norm, exp, pow, rsqrt, ...): their lower-precision inputs cast to fp32;
#       fp32_set_opt_dtype (softmax, log_softmax, sum, cumsum, prod, ...): with no dtype given
#         and a floating first input, called with dtype=float32 (set_opt_dtype: the op itself
#         decides what to copy: log_softmax copies bf16 logits to fp32, sum casts on the fly);
#         with a dtype given, as called -- cross_entropy's composite calls
#         log_softmax(logits, dim, logits.dtype): bf16 log-probabilities on CUDA (a dtype given
#         positionally was read as none before: an fp32 and a bf16 copy of the logits more);
#       promote (addcmul, index_put, scatter_add, dot, ...): inputs to their widest float type;
#       the ops only the CPU registers (cross_entropy_loss, cat, stack, the pads, the FFTs,
#         the linalg solvers, ...): fall through, as on CUDA; cross_entropy_loss then runs as
#         CUDA's composite (no fp32 copy of the logits: one logits' size at BERT's head).
#     SDPA's inputs are cast to the autocast dtype before the backend is chosen (CUDA's
#     lower-precision list names it: fp32 q/k/v from RoPE run flash in bf16). And autocast is
#     on around each forward only, its weight cache cleared as the forward returns, as a step
#     runs `with autocast: loss = model(batch)` and backward outside (the planner's own calls
#     would otherwise keep every bf16 weight copy cached through backward and the optimizer).
# Not mapped: cuDNN attention (off by default), and the CUDA allocator's segments and caching
# beyond the 512-byte rounding ([Note: The allocator beside the tensors]).

CUDA_BLOCK = 512  # CUDACachingAllocator's kMinBlockSize: every allocation a multiple of it
_TRACING = threading.RLock()  # held by the thread tracing a CUDA target: the patches are process-wide
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_EFFICIENT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Target:
    """What the planner's fake step runs as.

    Fields:
        cuda: trace CUDA's op stream (fused attention, native dropout, foreach optimizer).
        block_bytes: the allocator's rounding of each storage (1: none).
        offload_prefetch: inputs of other blocks an offloaded block's backward holds on the
            device beside its own (the one the streams prefetch; 0 where offload copies
            synchronously: no streams).
        offload_stash: offloaded blocks whose inputs the forward's stash still holds on the
            device (the last two: [Note: The offload stash]; 0: no streams).
    """

    cuda: bool = False
    block_bytes: int = 1
    offload_prefetch: int = 0
    offload_stash: int = 0

    @property
    def foreach(self) -> bool | None:
        """The optimizer's ``foreach=``: True on CUDA (torch's default there), None (torch's
        default on the host) otherwise."""
        return True if self.cuda else None

    @contextlib.contextmanager
    def tracing(self, meter: type | None = None) -> Iterator[None]:
        """Inside: F.scaled_dot_product_attention, F.dropout and autocast as the target runs
        them, and ``meter`` (a MemoryMeter class) rounding to the target's allocator blocks."""
        if not self.cuda:
            yield
            return
        with _TRACING, contextlib.ExitStack() as stack:  # one tracing thread at a time
            sdpa, dropout = F.scaled_dot_product_attention, F.dropout
            if meter is not None:
                stack.enter_context(_attribute(meter, "block_bytes", self.block_bytes))
            stack.enter_context(_attribute(F, "scaled_dot_product_attention", _mine(_cuda_sdpa(sdpa), sdpa)))
            stack.enter_context(_attribute(F, "dropout", _mine(_cuda_dropout(dropout), dropout)))
            masks = sys.modules.get("transformers.masking_utils")
            if masks is not None and hasattr(masks, "_ignore_causal_mask_sdpa"):
                plain = masks._ignore_causal_mask_sdpa
                stack.enter_context(
                    _attribute(masks, "_ignore_causal_mask_sdpa", _mine(_real_causal_skip(plain), plain))
                )
            if masks is not None and hasattr(masks, "find_packed_sequence_indices"):
                plain = masks.find_packed_sequence_indices
                packed = _mine(_unpacked_on_fakes(plain), plain)
                stack.enter_context(_attribute(masks, "find_packed_sequence_indices", packed))
            if torch.is_autocast_enabled("cpu"):
                stack.enter_context(_cuda_autocast_lists(torch.get_autocast_dtype("cpu")))
                stack.enter_context(_autocast_per_forward(torch.get_autocast_dtype("cpu")))
            yield


def _mine(patched, plain):
    """``patched`` for the thread that made it (the one tracing), ``plain`` for any other."""
    owner = threading.get_ident()

    def either(*args, **kwargs):
        return (patched if threading.get_ident() == owner else plain)(*args, **kwargs)

    return either


def target_of(device: DeviceProfile) -> Target:
    """The target a plan priced on ``device`` traces: CUDA's stream for a CUDA profile (the named
    accelerators, or a calibration on a CUDA device: it has CUDA's workspace), the host's else."""
    if device.name in ("h100", "h200", "a100") or device.workspace_bytes > 0:
        return Target(cuda=True, block_bytes=CUDA_BLOCK, offload_prefetch=1, offload_stash=2)
    return Target()


def cuda_backend(query, key, value, attn_mask=None, dropout_p=0.0, enable_gqa=False) -> str:
    """The SDPA backend CUDA picks: "flash", "efficient" or "math" ([Note: The target's op stream])."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or query.is_nested:
        return "math"
    dq, dk, dv = query.shape[-1], key.shape[-1], value.shape[-1]
    fewer_heads = key.shape[1] != query.shape[1] or value.shape[1] != query.shape[1]
    if fewer_heads and not enable_gqa:
        return "math"
    if query.dtype in _FLASH_DTYPES and attn_mask is None and dq == dk == dv and dq <= 256:
        return "flash"
    align = 16 // query.element_size()
    if query.dtype in _EFFICIENT_DTYPES and dq == dk and dq % align == 0 and dv % align == 0 and not fewer_heads:
        return "efficient"
    return "math"


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _cuda_sdpa(plain):
    def scaled_dot_product_attention(
        query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ):
        if torch.is_autocast_enabled("cpu"):  # CUDA autocast's lower-precision list names SDPA
            low = torch.get_autocast_dtype("cpu")
            query, key, value, attn_mask = (
                t.to(low) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                for t in (query, key, value, attn_mask)
            )
        backend = cuda_backend(query, key, value, attn_mask, dropout_p, enable_gqa)
        if backend == "flash":
            out = torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale
            )
            return out[0]
        if backend == "efficient":
            bias = _as_bias(attn_mask, query, key)
            lse = _needs_grad(query, key, value)
            out = torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, bias, lse, dropout_p, is_causal, scale=scale
            )
            return out[0]
        if query.dim() != 4 or query.is_nested:  # torch's own checks and errors
            return plain(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        out = torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
        return out[0]

    return scaled_dot_product_attention


def _as_bias(mask, query, key):
    """An attn_mask as CUDA's memory-efficient kernel takes it: a boolean mask as an additive
    one of the query's dtype, its last dim padded to 16 bytes' elements, expanded to
    batch x heads x q x k (attention.cpp: convert_boolean_attn_mask, preprocess_mask)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill(
            mask.logical_not(), float("-inf")
        )
    align = 16 // mask.element_size()
    if mask.shape[-1] % align:
        pad = align - mask.shape[-1] % align
        mask = F.pad(mask, (0, pad))[..., : key.shape[-2]]
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return mask.expand(query.shape[0], query.shape[1], query.shape[-2], key.shape[-2])


def _real_causal_skip(plain):
    """transformers' check whether SDPA can take is_causal=True instead of a mask, as on a real
    step: its cache position (q_offset) is a fake tensor in the fake step, which it takes for
    a traced graph and keeps the mask; the real step skips it where the value is not read
    (q_length 1, or kv_length == q_length)."""

    def _ignore_causal_mask_sdpa(padding_mask, q_length, kv_length, q_offset, kv_offset, *args, **kwargs):
        if isinstance(q_offset, FakeTensor) and q_length in (1, kv_length):
            q_offset = 0  # not read on this path
        return plain(padding_mask, q_length, kv_length, q_offset, kv_offset, *args, **kwargs)

    return _ignore_causal_mask_sdpa


# CUDA autocast's op lists (aten/src/ATen/autocast_mode.h). Of each, the ops CUDA registers and
# the CPU does not are mapped, read from the dispatcher at the trace (_cuda_only); the fp32
# lists' ops are mapped whether or not the CPU registers them (where it does, it lowers them).
_CUDA_LOWER = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr", "matmul",
    "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)  # fmt: skip
_CUDA_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity", "dist", "pdist",
    "renorm", "logsumexp",
)  # fmt: skip
_CUDA_FP32_SET_OPT = (  # dtype=float32 unless a dtype is given
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm", "sum",
    "sum.dim_IntList",
)  # fmt: skip
_CUDA_PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put", "tensordot",
    "scatter_add",
)  # fmt: skip
_LOWER = (torch.float16, torch.bfloat16)


def _registered(name: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", key)


def _cuda_only(names) -> list[str]:
    """Those of ``names`` (aten op overloads) CUDA's autocast has a kernel for and the CPU's not."""
    return [n for n in names if _registered(n, "AutocastCUDA") and not _registered(n, "AutocastCPU")]


def _cpu_only() -> list[str]:
    """The aten ops the CPU's autocast has a kernel for and CUDA's not: they fall through on CUDA."""
    names = (n.removeprefix("aten::") for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::"))
    return [n for n in names if _registered(n, "AutocastCPU") and not _registered(n, "AutocastCUDA")]


def _op(name: str):
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


@contextlib.contextmanager
def _cuda_autocast_lists(dtype: torch.dtype) -> Iterator[None]:
    """Inside: CPU autocast runs CUDA autocast's lists ([Note: The target's op stream]) for the
    thread that entered (a kernel at the AutocastCPU key per op, removed after: torch's own
    kernels return)."""
    owner = threading.get_ident()
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
            for name in _cuda_only(_CUDA_LOWER):
                lib.impl(name, _cast_kernel(_op(name), owner, lambda ts: dtype), "AutocastCPU")
            for name in _CUDA_FP32:
                lib.impl(name, _cast_kernel(_op(name), owner, _fp32), "AutocastCPU")
            for name in _CUDA_FP32_SET_OPT:
                lib.impl(name, _set_opt_kernel(_op(name), owner), "AutocastCPU")
            for name in _cuda_only(_CUDA_PROMOTE):
                lib.impl(name, _cast_kernel(_op(name), owner, _widest), "AutocastCPU")
            for name in _cpu_only():
                lib.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
        yield
    finally:
        lib._destroy()


@contextlib.contextmanager
def _autocast_per_forward(dtype: torch.dtype) -> Iterator[None]:
    """The ambient autocast off, and on around each outermost module call (the step's forward,
    a block's alone, a recompute's) with its weight cache cleared as it returns: a step runs
    ``with autocast: loss = model(batch)`` and its backward and optimizer step outside, so the
    bf16 copies of the weights the cache holds are gone by backward. The tracing thread's
    module calls only."""
    state: list = []  # the autocast entered by the outermost call running (depth 1), or nothing
    owner = threading.get_ident()

    def pre(module, args):
        if threading.get_ident() != owner:
            return
        state.append(None)
        if len(state) == 1:
            state[0] = torch.autocast("cpu", dtype=dtype)
            state[0].__enter__()

    def post(module, args, out):
        if threading.get_ident() != owner:
            return
        if len(state) == 1 and state[0] is not None:
            state[0].__exit__(None, None, None)
            torch.clear_autocast_cache()
        if state:
            state.pop()

    with torch.autocast("cpu", enabled=False):
        handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(pre),
            torch.nn.modules.module.register_module_forward_hook(post, always_call=True),
        ]
        try:
            yield
        finally:
            for h in handles:
                h.remove()


def _fp32(tensors) -> torch.dtype | None:
    return torch.float32


def _widest(tensors) -> torch.dtype | None:
    floats = [t.dtype for t in tensors if t.is_floating_point() and t.dtype != torch.float64]
    return max(floats, key=lambda d: torch.finfo(d).bits) if floats else None


def _cast_kernel(op, owner: int, to):
    """``op`` at the AutocastCPU key: its floating inputs cast to ``to(inputs)`` (the lower
    precision ones for fp32, any but float64 for a lower dtype, every one for promote) on the
    tracing thread; on another, ``op`` as without the key (see [Note: The target's op stream])."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(keys):
            if threading.get_ident() != owner:
                return op(*args, **kwargs)
            flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            dtype = to(flat)
            if dtype is not None:

                def cast(t):  # autocast's eligible tensors: floating, not float64
                    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == torch.float64:
                        return t
                    return t if t.dtype == dtype or (dtype == torch.float32 and t.dtype not in _LOWER) else t.to(dtype)

                args, kwargs = tree_map(cast, (args, kwargs))
            return op(*args, **kwargs)

    return kernel


def _set_opt_kernel(op, owner: int):
    """``op`` (one with a ``dtype=`` argument) at the AutocastCPU key as CUDA's
    fp32_set_opt_dtype policy runs it on the tracing thread: with no dtype given and a floating
    first input, called with dtype=float32; else as called (another thread: always)."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    schema = [a for a in op._schema.arguments]
    at = next(i for i, a in enumerate(schema) if a.name == "dtype")
    positional = not schema[at].kwarg_only

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(keys):
            if threading.get_ident() == owner and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
                if positional and len(args) > at:
                    if args[at] is None:
                        args = (*args[:at], torch.float32, *args[at + 1 :])
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)

    return kernel


def _unpacked_on_fakes(plain):
    """transformers' test for packed sequences (position ids restarting inside a row) reads the
    ids' values, which a fake step has not: one sequence per row, as without position ids."""

    def find_packed_sequence_indices(position_ids):
        return None if isinstance(position_ids, FakeTensor) else plain(position_ids)

    return find_packed_sequence_indices


def _cuda_dropout(plain):
    def dropout(input, p=0.5, training=True, inplace=False):
        if inplace or not training or not 0 < p < 1 or input.numel() == 0:
            return plain(input, p, training, inplace)
        return torch.native_dropout(input, p, True)[0]

    return dropout


@contextlib.contextmanager
def _attribute(owner, name: str, value) -> Iterator[None]:
    """``owner.name`` set to ``value`` inside the block, then what it was."""
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


__all__ = ["CUDA_BLOCK", "Target", "cuda_backend", "target_of"]
