"""What offload="cpu" moves to the host per step, on the CPU harness (CPU tensors sent down the
accelerator path with synchronous copies): copies and bytes each way, saves that shared a
copy, tensors kept in place, and how the copies back were issued; against the rule memfit
had before (copy every saved tensor that is not an nn.Parameter, once per save, whatever
its size), counted with a plain saved-tensor hook on the same blocks.

HF BERT-MLM, each BertLayer under save="all" (nothing recomputed: everything a layer saves is
offloaded). Counts, not times: the copies' speed needs a GPU.

    .venv/bin/python benchmarks/offload_bytes.py [--layers 4 --hidden 256 --seq 128 --batch 4] [--out F.md]
"""

from __future__ import annotations

import argparse

import torch
from _common import MIB, command, emit
from torch import nn

import memfit
from memfit.cli._data import batch_at
from memfit.models import PRESETS
from memfit.testing import host_offload_on_cpu, offload_stats


def _every_save(model: nn.Module, layer: type) -> list[int]:
    """[saves, bytes] of the old rule, over what each ``layer`` saves in one step."""
    counted = [0, 0]

    def pack(t):
        if not isinstance(t, nn.Parameter):
            counted[0] += 1
            counted[1] += t.numel() * t.element_size()
        return t

    for m in model.modules():
        if isinstance(m, layer):
            m.register_forward_pre_hook(lambda *_: hooks.__enter__())
            m.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    return counted


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    for name, value in {"layers": 4, "hidden": 256, "seq": 128, "batch": 4}.items():
        p.add_argument(f"--{name}", type=int, default=value)
    p.add_argument("--out")
    args = p.parse_args()
    preset = PRESETS["bert"].resized(layers=args.layers, hidden=args.hidden, seq=args.seq, batch=args.batch)
    layer = preset.layer_class()
    batch = batch_at(preset.arch, args.batch, args.seq, step=0)
    torch.manual_seed(0)
    old = preset.build()
    counted = _every_save(old, layer)
    old(**batch).loss.backward()
    torch.manual_seed(0)
    model = preset.build()
    memfit.apply_activation_checkpointing(model, layer, save="all", offload="cpu")
    stats = offload_stats()
    stats.reset()
    with host_offload_on_cpu() as trace:
        model(**batch).loss.backward()
    assert not trace.violations()
    lines = [
        f"# Offload to host: what one step moves (CPU harness; HF BERT-MLM L={args.layers} h={args.hidden} "
        f's={args.seq} b={args.batch}, fp32, save="all" per layer)',
        "",
        command("offload_bytes.py"),
        "",
        "| | copies to host | MiB to host | MiB back | saves sharing a copy | kept in place |",
        "|---|---|---|---|---|---|",
        f"| every non-Parameter save (before) | {counted[0]} | {counted[1] / MIB:.2f} "
        f"| {counted[1] / MIB:.2f} | 0 | - |",
        f"| memfit | {stats.d2h_copies} | {stats.d2h_bytes / MIB:.2f} | {stats.h2d_bytes / MIB:.2f} "
        f"| {stats.shared} | {stats.kept} |",
        "",
        f"Copies back: {stats.prefetched} issued ahead of their block's use (prefetch), {stats.on_demand} on "
        f"demand; {stats.from_stash} unpacks served by tensors still on the device (stash).",
    ]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
