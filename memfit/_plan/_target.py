"""The op stream of the device a plan is for: what the planner's fake step runs when it plans
for an accelerator, wherever the planner itself runs (see [Note: The target's op stream])."""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_map

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
#     more block input than full checkpointing's (BERT-large, batch 16: 30 MiB under the H100's
#     peak without it). The fake step runs no streams, so the profile adds it.
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
# trace the fused attention too).
#   - autocast: a plan made inside torch.autocast("cpu", dtype) (the host's autocast: CUDA's
#     cannot be entered on a CPU-only build) traces CUDA autocast's op lists: the ops CUDA's
#     fp32 lists name (layer_norm, softmax, log_softmax, exp, pow, rsqrt, sum, ...) run in
#     fp32, by a kernel at the AutocastCPU key for the trace's duration (torch.library; torch's
#     own kernels are back after). Its lower-precision list (the matmuls, linear, SDPA) is the
#     CPU's; of the ops only the CPU's fp32 list names, cross_entropy_loss runs as CUDA's
#     composite (no fp32 copy of the logits: one logits' size at BERT's head), the rest as
#     the CPU runs them; a
#     set_opt_dtype op casts its input rather than passing dtype= (a temporary copy more).
#     SDPA's inputs are cast to the autocast dtype before the backend is chosen (CUDA's
#     lower-precision list names it: fp32 q/k/v from RoPE run flash in bf16). And autocast is
#     on around each forward only, its weight cache cleared as the forward returns, as a step
#     runs `with autocast: loss = model(batch)` and backward outside (the planner's own calls
#     would otherwise keep every bf16 weight copy cached through backward and the optimizer).
# Not mapped: cuDNN attention (off by default), and the CUDA allocator's segments and caching
# beyond the 512-byte rounding ([Note: The allocator beside the tensors]).

CUDA_BLOCK = 512  # CUDACachingAllocator's kMinBlockSize: every allocation a multiple of it
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
    """

    cuda: bool = False
    block_bytes: int = 1
    offload_prefetch: int = 0

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
        sdpa, dropout = F.scaled_dot_product_attention, F.dropout
        with contextlib.ExitStack() as stack:
            if meter is not None:
                stack.enter_context(_attribute(meter, "block_bytes", self.block_bytes))
            stack.enter_context(_attribute(F, "scaled_dot_product_attention", _cuda_sdpa(sdpa)))
            stack.enter_context(_attribute(F, "dropout", _cuda_dropout(dropout)))
            masks = sys.modules.get("transformers.masking_utils")
            if masks is not None and hasattr(masks, "_ignore_causal_mask_sdpa"):
                skip = _real_causal_skip(masks._ignore_causal_mask_sdpa)
                stack.enter_context(_attribute(masks, "_ignore_causal_mask_sdpa", skip))
            if masks is not None and hasattr(masks, "find_packed_sequence_indices"):
                packed = _unpacked_on_fakes(masks.find_packed_sequence_indices)
                stack.enter_context(_attribute(masks, "find_packed_sequence_indices", packed))
            if torch.is_autocast_enabled("cpu"):
                stack.enter_context(_cuda_autocast_lists())
                stack.enter_context(_autocast_per_forward(torch.get_autocast_dtype("cpu")))
            yield


def target_of(device: DeviceProfile) -> Target:
    """The target a plan priced on ``device`` traces: CUDA's stream for a CUDA profile (the named
    accelerators, or a calibration on a CUDA device: it has CUDA's workspace), the host's else."""
    if device.name in ("h100", "h200", "a100") or device.workspace_bytes > 0:
        return Target(cuda=True, block_bytes=CUDA_BLOCK, offload_prefetch=1)
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


# CUDA autocast's fp32 lists (aten/src/ATen/autocast_mode.cpp, AutocastCUDA: "fp32" and
# "fp32_set_opt_dtype") where the CPU's lists leave an op in the lower precision.
_CUDA_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity", "dist", "pdist",
    "renorm", "logsumexp",
    # fp32_set_opt_dtype: run in fp32 unless a dtype is given
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm", "sum",
    "sum.dim_IntList",
)  # fmt: skip
# Named by the CPU's fp32 list, not CUDA's: CUDA runs them as composites (cross_entropy's
# log_softmax takes the logits in their dtype and gives fp32, with no fp32 copy of them).
_CPU_ONLY_FP32 = ("cross_entropy_loss",)
_LOWER = (torch.float16, torch.bfloat16)


@contextlib.contextmanager
def _cuda_autocast_lists() -> Iterator[None]:
    """Inside: CPU autocast runs the ops of CUDA autocast's fp32 lists in fp32, as AutocastCUDA
    does (a kernel at the AutocastCPU key per op, removed after: torch's own kernels return)."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
            for name in _CUDA_FP32:
                packet, _, overload = name.partition(".")
                op = getattr(getattr(torch.ops.aten, packet), overload or "default")
                lib.impl(name, _fp32_kernel(op), "AutocastCPU")
            for name in _CPU_ONLY_FP32:
                lib.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
        yield
    finally:
        lib._destroy()


@contextlib.contextmanager
def _autocast_per_forward(dtype: torch.dtype) -> Iterator[None]:
    """The ambient autocast off, and on around each outermost module call (the step's forward,
    a block's alone, a recompute's) with its weight cache cleared as it returns: a step runs
    ``with autocast: loss = model(batch)`` and its backward and optimizer step outside, so the
    bf16 copies of the weights the cache holds are gone by backward."""
    state: list = []  # the autocast entered by the outermost call running (depth 1), or nothing

    def pre(module, args):
        state.append(None)
        if len(state) == 1:
            state[0] = torch.autocast("cpu", dtype=dtype)
            state[0].__enter__()

    def post(module, args, out):
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


def _fp32_kernel(op):
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def to_fp32(t):
        return t.to(torch.float32) if isinstance(t, torch.Tensor) and t.dtype in _LOWER else t

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(keys):
            if kwargs.get("dtype") is None:
                args, kwargs = tree_map(to_fp32, (args, kwargs))
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
