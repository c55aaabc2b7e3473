"""The `memfit` command: `bench` (memory and time of strategies on a real architecture),
`plan` (the plan and forecast for a budget) and `train` (a resumable training loop).

Thin: parse the command line into the command's config dataclass (its fields are the flags),
then run the command on it. ``parse_config(argv)`` is the first half, for callers that run a
command themselves (``train(cfg, on_step=...)``).
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from collections.abc import Callable

import memfit
from memfit.cli._bench import STRATEGIES, BenchConfig, bench
from memfit.cli._config_file import with_config_file
from memfit.cli._flags import DEVICE_HELP, DEVICES, add_flags
from memfit.cli._launch import end_process_group, leave_now
from memfit.cli._plan import CalibrateConfig, PlanConfig, calibrate_command, plan_command
from memfit.cli._preempt import Preempted, exit_status
from memfit.cli._train import TrainConfig, train
from memfit.models import PRESETS

__all__ = ["BenchConfig", "PlanConfig", "TrainConfig", "bench", "main", "parse_config", "plan_command", "train"]

Config = BenchConfig | PlanConfig | TrainConfig | CalibrateConfig
COMMANDS: dict[str, tuple[type, Callable]] = {
    "bench": (BenchConfig, bench),
    "plan": (PlanConfig, plan_command),
    "calibrate": (CalibrateConfig, calibrate_command),
    "train": (TrainConfig, train),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memfit", description="Train PyTorch models larger than your memory.")
    p.add_argument("--version", action="version", version=f"memfit {memfit.__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    models = (
        f"a preset ({', '.join(sorted(PRESETS))}), a local HF config.json (or its directory), or pkg.module:function"
    )

    b = sub.add_parser("bench", help="memory and step time of each strategy on a real architecture")
    b.add_argument("--model", default="bert", help=f"{models} (default: bert)")
    b.add_argument("--strategies", nargs="+", help=f"from {', '.join(STRATEGIES)} (default: all; one process only)")
    b.add_argument("--budget", help="memory budget of the planned strategy, e.g. 300MB (default: halfway)")
    b.add_argument("--compare", action="store_true", help="add torch.utils.checkpoint (with --world-size: FSDP2)")
    b.add_argument("--world-size", type=int, default=1, help="N > 1: DDP vs memfit sharding on N spawned ranks")
    _device_flag(b)
    _shape_flags(b)
    b.add_argument("--warmup", type=int, default=2)
    b.add_argument("--repeats", type=int, default=5)
    b.add_argument("--json", help="write the results here")
    b.add_argument("--plot", help="write a PNG of peak memory against step time here")

    pl = sub.add_parser(
        "plan",
        help="the plan and forecast for a memory budget (measures one batch)",
        description="Plan per-block activation checkpointing for a memory budget, from shapes only (the model "
        "on the meta device, one batch on fake tensors). Prints the decision per block, whether it fits, the "
        "terms that add up to the peak, every lever ranked by time per GiB saved, and the `memfit train` "
        "command that runs it. Budgets: 80GB (decimal, = 74.5 GiB), 80GiB or 80G (binary).",
    )
    pl.add_argument("--model", default="bert", help=f"{models} (default: bert); built on the meta device")
    pl.add_argument("--budget", required=True, help="e.g. 4GB, 3.5GiB, 800MB")
    pl.add_argument("--world-size", type=int, default=1, help="forecast per rank for a model sharded over N ranks")
    pl.add_argument(
        "--shard-size", type=int, help="hybrid sharding: shard over groups of S ranks, replicated N/S times"
    )
    pl.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="parameters and optimizer state")
    pl.add_argument(
        "--mixed-precision",
        default="no",
        choices=["no", "bf16"],
        help="bf16: forecast memfit train --mixed-precision bf16 (bf16 compute, fp32 master weights, gradients "
        "reduced in fp32, fp32 optimizer state)",
    )
    pl.add_argument(
        "--device-profile",
        help="price time on: h100, h200, a100, cpu, calibrated (memfit calibrate); default: this machine's "
        "accelerator's named profile, else cpu",
    )
    _shape_flags(pl)
    pl.add_argument("--json", help="write the plan here")
    _auto_flags(pl)
    pl.add_argument("--emit", metavar="RUN.toml", help="write the run for `memfit train --config RUN.toml` here")
    pl.add_argument("--plot", metavar="F.png", help="draw the predicted memory over one step, by term, here")

    c = sub.add_parser("calibrate", help="measure this machine's rates for the planner's time model; cached")
    c.add_argument("--device", default="cpu", help="the device to measure: cpu (default), cuda, cuda:1, ...")
    c.add_argument(
        "--cpu-time",
        action="store_true",
        help="one thread, timed in process CPU time: steady rates on a shared, loaded machine (the planner "
        "benchmark's setting); by default all threads and the wall clock",
    )
    c.add_argument(
        "--world-size",
        type=int,
        default=1,
        help="spawn this many ranks (gloo on the CPU, one GPU each with NCCL) that calibrate together: each "
        "rank's share of the machine, the links' latency and bandwidth and each collective's host cost, for "
        "`memfit plan --auto --world-size N` (default 1: one process, no link figures)",
    )

    t = sub.add_parser(
        "train",
        help="train a model on your data (one process, or under torchrun); resumable",
        description="Train a preset, a local HF config.json or a factory pkg.module:function on local data. "
        "Every flag can also come from --config FILE (TOML or YAML, keys are the flag names); flags override it.",
        formatter_class=_DefaultsShown,
    )
    t.add_argument("--config", help="a TOML or YAML file of flag values (keys: flag names)")
    add_flags(t, TrainConfig)  # See [Note: Flags from the config]
    return p


class _DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """--help adds "(default: X)" to each flag that has a default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action) or ""


def _auto_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--auto",
        action="store_true",
        help="search micro-batch, gradient accumulation, sharding layout and checkpointing for the most tokens/s "
        "that fits --budget per rank on --world-size ranks (memfit.autoconfigure); --batch is the example batch",
    )
    p.add_argument("--global-batch", type=int, help="with --auto: samples per optimizer step (default: free)")


def _device_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", choices=DEVICES, help=DEVICE_HELP)


def _shape_flags(p: argparse.ArgumentParser, batch_note: str = "") -> None:
    for name in ("layers", "hidden", "seq", "batch"):
        note = batch_note if name == "batch" else ""
        what = "the preset's" if name in ("layers", "hidden") else "the preset's, else 128 and 8"
        p.add_argument(f"--{name}", type=int, help=f"override the preset's {name}{note} (default: {what})")


def _config(cls: type, args: argparse.Namespace) -> Config:
    """``cls`` built from the parsed flags that are its fields (a flag's dest is its field's name)."""
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    return cls(**{k: v for k, v in vars(args).items() if k in fields})


def parse_config(argv: list[str] | None = None) -> Config:
    """The config of the command that ``argv`` names (``["train", "--steps", "5"]`` gives a
    TrainConfig); raises ValueError when a value is wrong, SystemExit on a malformed line."""
    args = _parse(argv)
    return _config(COMMANDS[args.command][0], args)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The flags of ``argv``, with the values of a ``--config`` file as defaults."""
    parser = _parser()
    return with_config_file(parser, parser.parse_args(argv), argv)


def program() -> int:
    """The ``memfit`` program (the console command, ``python -m memfit``, under torchrun too):
    :func:`main` on ``sys.argv[1:]``, then it ends the process group the command joined (See
    [Note: Ending a process group] in memfit/cli/_launch.py)."""
    status = main()
    if end_process_group():
        leave_now(status)
    return status


def main(argv: list[str] | None = None) -> int:
    """Run the command that ``argv`` (default: ``sys.argv[1:]``) names; the exit status (0; 2
    for a wrong flag or value; 128 + the signal's number when SIGTERM or SIGINT stopped it). The
    caller's process groups are left as they are (the program ends them: :func:`program`)."""
    try:
        args = _parse(argv)
        config_class, command = COMMANDS[args.command]
        command(_config(config_class, args))
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Preempted as e:  # stopped cleanly by a signal, its line printed (See [Note: Stopping on a signal])
        return e.status
    except KeyboardInterrupt:  # Ctrl-C outside a training loop (starting up, a bench, a plan)
        print(f"memfit: interrupted (Ctrl-C); exit status {exit_status(signal.SIGINT)}", file=sys.stderr)
        return exit_status(signal.SIGINT)
    return 0
