"""The planner's time model: operation counts priced on a device profile, never a stopwatch."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten

# [Note: The planner's time model]
# Timing a block under load gives a different number each run (identical layers were timed at
# 195-917 ms on a busy 2-core CPU), and a plan that follows those numbers changes from run to
# run. The planner prices work instead: every aten op of a step is recorded once (under
# FakeTensorMode, so nothing runs) with its floating-point operations (torch's flop formulas)
# and the bytes it reads and writes, and an op costs
#     t(op) = max(flops / F[dtype], bytes / BW_mem) + t_op
# on a device profile: F the matmul rate per dtype, BW_mem the memory bandwidth, t_op the cost
# of dispatching one op (the roofline model, plus a per-op constant that dominates small ops on
# a CPU). The extra time of a decision is what it adds to a step:
#     keep       0
#     full       sum of t(op) over the block's forward (recomputed in backward)
#     selective  the same over the ops its rule does not keep
#     offload    full + 2 x the block input's bytes / BW_offload (written in forward, read back)
# and the predicted step time is sum t(op) over one measured step (forward, backward, optimizer
# step) plus the extra times. The same model, batch and profile give the same numbers: the
# same plan. Profiles are named (published peak rates: optimistic, as every roofline is) or
# measured once on this machine by `memfit calibrate` and cached.


@dataclass(frozen=True)
class DeviceProfile:
    """Rates the time model prices operations at.

    Fields:
        name: how tables and caches call it.
        flops: floating-point operations per second of a large matrix multiply, per dtype name
            ("float32", "bfloat16", "float16"); other dtypes use float32's.
        memory_bandwidth: bytes per second an elementwise op streams through device memory.
        offload_bandwidth: bytes per second to where "offload" puts a block's input (host
            memory over PCIe for an accelerator, disk for a CPU).
        op_overhead: seconds to dispatch one op (kernel launch, framework overhead).
        source: where the numbers come from.
    """

    name: str
    flops: dict[str, float]
    memory_bandwidth: float
    offload_bandwidth: float
    op_overhead: float
    source: str = ""

    def __post_init__(self) -> None:
        rates = [*self.flops.values(), self.memory_bandwidth, self.offload_bandwidth]
        if "float32" not in self.flops or min(rates) <= 0 or self.op_overhead < 0:
            raise ValueError(f"memfit.DeviceProfile {self.name!r}: rates must be positive, float32 included")

    def rate(self, dtype: torch.dtype) -> float:
        return self.flops.get(str(dtype).removeprefix("torch."), self.flops["float32"])

    def op_time(self, cost: OpCost) -> float:
        return max(cost.flops / self.rate(cost.dtype), cost.bytes / self.memory_bandwidth) + self.op_overhead

    def ops_time(self, costs: list[OpCost]) -> float:
        return sum(self.op_time(c) for c in costs)


# Published dense peak rates (no sparsity) from the vendors' data sheets; fp32 without TF32
# (PyTorch's default for matmuls). Offload over PCIe, one direction: Gen5 x16 64 GB/s, Gen4
# x16 32 GB/s.
PROFILES = {
    "h100": DeviceProfile(
        "h100",
        {"float32": 67e12, "bfloat16": 989e12, "float16": 989e12},
        3.35e12,
        64e9,
        5e-6,
        "NVIDIA H100 SXM data sheet",
    ),
    "h200": DeviceProfile(
        "h200",
        {"float32": 67e12, "bfloat16": 989e12, "float16": 989e12},
        4.8e12,
        64e9,
        5e-6,
        "NVIDIA H200 SXM data sheet",
    ),
    "a100": DeviceProfile(
        "a100",
        {"float32": 19.5e12, "bfloat16": 312e12, "float16": 312e12},
        2.039e12,
        32e9,
        5e-6,
        "NVIDIA A100 80GB SXM data sheet",
    ),
    # A modest CPU: the default for a model on a CPU or the meta device, fixed so that plans are
    # the same everywhere (device_profile="calibrated" prices on this machine's measured rates).
    "cpu": DeviceProfile(
        "cpu", {"float32": 50e9}, 10e9, 1e9, 10e-6, "fixed rates of a modest CPU; 'calibrated' measures this one"
    ),
}


@dataclass(frozen=True)
class OpCost:
    """One aten op of a recorded step: what the time model prices."""

    op: str  # overload packet name, e.g. "aten.addmm"
    flops: int
    bytes: int  # read and written
    dtype: torch.dtype


def _sdpa_cpu(query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _sdpa_cpu_backward(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


# torch counts the CUDA attention kernels; the CPU one has the same arithmetic.
_EXTRA_FLOPS = {}
if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
    _EXTRA_FLOPS[aten._scaled_dot_product_flash_attention_for_cpu] = _sdpa_cpu
if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
    _EXTRA_FLOPS[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _sdpa_cpu_backward


def _nbytes(items) -> tuple[int, torch.dtype | None]:
    total, dtype, seen = 0, None, set()
    for t in items:
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
            if dtype is None and t.is_floating_point():
                dtype = t.dtype
    return total, dtype


def op_cost(func, args, kwargs, out) -> OpCost:
    packet = func._overloadpacket
    flops = 0
    if packet in flop_registry:
        flops = int(flop_registry[packet](*args, **kwargs, out_val=out))
    elif packet in _EXTRA_FLOPS:
        flops = int(_EXTRA_FLOPS[packet](*args, **kwargs, out_val=out))
    read, dtype = _nbytes(tree_flatten((args, kwargs))[0])
    written, out_dtype = _nbytes(tree_flatten(out)[0])
    return OpCost(str(packet), flops, read + written, dtype or out_dtype or torch.float32)


class CostRecorder(TorchDispatchMode):
    """Records an :class:`OpCost` per aten op run inside it (with the op, to test a rule)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[object, OpCost]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, op_cost(func, args, kwargs, out)))
        return out

    @property
    def costs(self) -> list[OpCost]:
        return [c for _, c in self.ops]


# -- calibration ---------------------------------------------------------------------------


def _median_seconds(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _cache_path(device_type: str) -> Path:
    root = os.environ.get("MEMFIT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "memfit"
    )
    return Path(root) / f"device-{device_type}.json"


def calibrate(device: str | torch.device = "cpu", *, save: bool = True) -> DeviceProfile:
    """Measure this machine's rates once (about a second) and cache them for ``device``'s type:
    the matmul rate per dtype, the bandwidth of a large copy, the cost of a tiny op, and the
    offload path (disk for a CPU, host memory for an accelerator)."""
    device = torch.device(device)
    sync = getattr(torch.get_device_module(device.type), "synchronize", None) if device.type != "cpu" else None

    def timed(fn):
        def run():
            fn()
            if sync:
                sync()

        return _median_seconds(run)

    flops = {}
    n = 512 if device.type == "cpu" else 4096
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(n, n, device=device, dtype=dtype)
        flops[str(dtype).removeprefix("torch.")] = 2 * n**3 / timed(lambda a=a: a @ a)
    big = torch.empty(16 * 2**20 // 4, device=device)
    out = torch.empty_like(big)
    memory_bandwidth = 2 * big.nbytes / timed(lambda: out.copy_(big))
    tiny = torch.ones(1, device=device)
    op_overhead = timed(lambda: [tiny.add(1) for _ in range(200)]) / 200
    if device.type == "cpu":
        offload_bandwidth = _disk_bandwidth(big)
    else:
        host = torch.empty(big.shape, pin_memory=True)
        offload_bandwidth = big.nbytes / timed(lambda: host.copy_(big))
    profile = DeviceProfile(
        f"calibrated-{device.type}",
        flops,
        memory_bandwidth,
        offload_bandwidth,
        op_overhead,
        f"measured by memfit calibrate on {os.uname().nodename} at {time.strftime('%Y-%m-%d %H:%M')}",
    )
    if save:
        path = _cache_path(device.type)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dataclasses.asdict(profile), indent=1))
    return profile


def _disk_bandwidth(t: torch.Tensor) -> float:
    data = t.numpy().tobytes()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "probe")

        def write_read():
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            with open(path, "rb") as f:
                f.read()

        return 2 * len(data) / _median_seconds(write_read, repeats=3)


def default_profile(device: str | torch.device = "cpu") -> DeviceProfile:
    """The profile a plan gets when none is named: the named profile of the device it targets,
    the same on every run (see [Note: The default device profile])."""
    device = torch.device(device)
    if device.type == "cpu":
        return PROFILES["cpu"]
    module = torch.get_device_module(device.type)
    name = module.get_device_name(device) if hasattr(module, "get_device_name") else device.type
    for key in ("h200", "h100", "a100"):  # H200 before H100: no name holds both
        if key in name.lower().replace(" ", ""):
            return PROFILES[key]
    raise ValueError(
        f"memfit.plan: no named device profile for {name!r} ({device}); pass device_profile= one of "
        f"{sorted(PROFILES)}, 'calibrated' (measured on this machine by `memfit calibrate`) or a memfit.DeviceProfile"
    )


# [Note: The default device profile]
# A plan's times are priced on the profile named by ``device_profile``; without one, on the
# named profile of the device the model is on (an accelerator by its name, a CPU or the meta
# device: "cpu"). A cached `memfit calibrate` is used only when asked for ("calibrated"): a
# calibration made once on a loaded machine must not change later plans behind the user's
# back (one made under load priced a 0.5 s step at 16.9 s), and the same call must give the
# same plan on every machine. Plan.table() and `memfit plan` say which profile priced the step.
def device_profile(spec: str | DeviceProfile | None = None, device_type: str = "cpu") -> DeviceProfile:
    """The profile ``spec`` names: a DeviceProfile as is, a name from PROFILES, "calibrated"
    (this machine's cached calibration, measured now if there is none), or None: the named
    profile of ``device_type`` (:func:`default_profile`), never the cache."""
    if isinstance(spec, DeviceProfile):
        return spec
    if spec is None:
        return default_profile(device_type)
    if spec == "calibrated":
        cached = _cache_path(torch.device(device_type).type)
        if cached.exists():
            return DeviceProfile(**json.loads(cached.read_text()))
        return calibrate(device_type)
    if spec not in PROFILES:
        raise ValueError(
            f"memfit.plan: unknown device profile {spec!r}; choose one of {sorted(PROFILES)}, 'calibrated' "
            "(this machine, measured once by `memfit calibrate`) or a memfit DeviceProfile"
        )
    return PROFILES[spec]


__all__ = ["PROFILES", "CostRecorder", "DeviceProfile", "OpCost", "calibrate", "default_profile", "device_profile"]
