"""Mixed precision for sharded units: compute in a low precision from fp32 master shards."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

_NORMS: tuple[type, ...] = (_NormBase, nn.LayerNorm, nn.GroupNorm) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())

# [Note: Mixed precision]
# The shards (what the optimizer updates) stay in their own dtype, fp32. A unit gathers them
# already cast to `param_dtype` (half the bytes on the wire for bf16) and computes with full
# parameters of that dtype; gradients come out in `param_dtype`, are reduce-scattered in
# `reduce_dtype` (default: their own dtype, fp32 in a unit that mixes in fp32 norm layers) and
# land in the shards' `.grad` in fp32. Floating inputs of every unit are cast to `param_dtype`.
# Full parameters seen through summon_full_params or export_safetensors are in the compute
# dtype; checkpoints hold the fp32 shards. Norm layers (BatchNorm, LayerNorm,
# GroupNorm, InstanceNorm, RMSNorm) keep fp32 parameters and buffers by default: their inputs
# are cast to fp32 and their outputs back to `param_dtype` (low-precision batch statistics are
# what breaks BatchNorm). Buffers of other modules are cast to `buffer_dtype`.


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes for a sharded model's compute; the shards, which the optimizer updates, keep theirs.

    A unit gathers its parameters already cast to ``param_dtype`` and computes with them;
    gradients are summed across ranks in ``reduce_dtype`` and reach the shards' ``.grad`` in
    the shards' dtype. Floating inputs of every unit are cast to ``param_dtype``.

    Attributes:
        param_dtype: the dtype of the gathered parameters the forward and backward use.
        reduce_dtype: the dtype gradients are summed in across ranks (default: the gradients'
            own dtype, param_dtype; fp32 for a unit that also holds fp32 norm layers).
        buffer_dtype: the dtype of buffers outside norm layers (default: param_dtype).
        keep_norms_fp32: norm layers compute in fp32 with fp32 parameters and buffers.
    """

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_norms_fp32: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise ValueError(f"memfit.MixedPrecision: {name} must be a floating torch.dtype, got {value!r}")

    def compute_dtype(self, module: nn.Module) -> torch.dtype:
        return torch.float32 if self.keep_norms_fp32 and isinstance(module, _NORMS) else self.param_dtype

    def prepare(self, modules: list[nn.Module]) -> None:
        """Cast buffers and hook norm layers, for the modules a unit manages."""
        # See [Note: Mixed precision]
        for m in modules:
            keep = self.keep_norms_fp32 and isinstance(m, _NORMS)
            for name, b in m._buffers.items():
                if b is not None and b.is_floating_point() and not keep:
                    m._buffers[name] = b.to(self.buffer_dtype or self.param_dtype)
            if keep:
                m.register_forward_pre_hook(_to_fp32)
                m.register_forward_hook(lambda mod, args, out, dt=self.param_dtype: _cast(out, dt))


def _cast(obj, dtype: torch.dtype):
    if isinstance(obj, torch.Tensor) and obj.is_floating_point():
        return obj.to(dtype)
    if isinstance(obj, tuple):
        return tuple(_cast(x, dtype) for x in obj)
    return obj


def _to_fp32(module: nn.Module, args: tuple):
    return _cast(args, torch.float32)


def gradient_divide_factors(reduce_dtype: torch.dtype, world: float) -> tuple[float, float]:
    """(pre, post): a unit's gradients are divided by ``pre`` before the sum over the ``world``
    ranks and by ``post`` after it (``pre * post == world``), so that a 16-bit sum does not
    overflow (fp16 tops out at 65504) nor the quotient underflow. ``pre`` is FSDP2's
    (``_get_gradient_divide_factors``): the first power of two that is at least sqrt(world) or
    no longer divides it (W=6: 4, then 1.5). FSDP2 splits only fp16 sums (it averages bf16 ones
    in the collective); here bf16 is split too, which changes only the rounding of the
    quotients. In fp32 and fp64 the sum comes first, whole, as without mixed precision.
    ``world`` may be FSDP2's ``set_gradient_divide_factor`` instead of the rank count."""
    if reduce_dtype in (torch.float32, torch.float64) or world <= 1:
        return 1.0, float(world)
    factor = 1
    while world % factor == 0 and world / factor > factor:
        factor *= 2
    return float(factor), world / factor
