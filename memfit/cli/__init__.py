"""The `memfit` command: `bench` (memory and time of strategies on a real architecture),
`plan` (the plan and forecast for a budget) and `train` (a resumable training loop).

Thin: parse the command line into the command's config dataclass (its fields are the flags),
then run the command on it. ``parse_config(argv)`` is the first half, for callers that run a
command themselves (``train(cfg, on_step=...)``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable

from memfit.cli._bench import STRATEGIES, BenchConfig, bench
from memfit.cli._plan import PlanConfig, plan_command
from memfit.cli._train import TrainConfig, train
from memfit.models import PRESETS

__all__ = ["BenchConfig", "PlanConfig", "TrainConfig", "bench", "main", "parse_config", "plan_command", "train"]

Config = BenchConfig | PlanConfig | TrainConfig
COMMANDS: dict[str, tuple[type, Callable]] = {
    "bench": (BenchConfig, bench),
    "plan": (PlanConfig, plan_command),
    "train": (TrainConfig, train),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memfit", description="Train PyTorch models larger than your memory.")
    sub = p.add_subparsers(dest="command", required=True)
    models = ", ".join(sorted(PRESETS))

    b = sub.add_parser("bench", help="memory and step time of each strategy on a real architecture")
    b.add_argument("--model", default="bert", help=f"one of {models} (default: bert)")
    b.add_argument("--strategies", nargs="+", help=f"from {', '.join(STRATEGIES)} (default: all; one process only)")
    b.add_argument("--budget", help="memory budget of the planned strategy, e.g. 300MB (default: halfway)")
    b.add_argument("--compare", action="store_true", help="add torch.utils.checkpoint (with --world-size: FSDP2)")
    b.add_argument("--world-size", type=int, default=1, help="N > 1: DDP vs memfit sharding on N spawned ranks")
    _shape_flags(b)
    b.add_argument("--warmup", type=int, default=2)
    b.add_argument("--repeats", type=int, default=5)
    b.add_argument("--json", help="write the results here")
    b.add_argument("--plot", help="write a PNG of peak memory against step time here")

    pl = sub.add_parser("plan", help="the plan and forecast for a memory budget (measures one batch)")
    pl.add_argument("--model", default="bert", help=f"one of {models}")
    pl.add_argument("--budget", required=True, help="e.g. 4GB, 3.5GiB, 800MB")
    pl.add_argument("--world-size", type=int, default=1, help="forecast per rank for a model sharded over N ranks")
    _shape_flags(pl)
    pl.add_argument("--json", help="write the plan here")

    t = sub.add_parser("train", help="train a preset (one process, or under torchrun); resumable")
    t.add_argument("--model", default="bert", help=f"one of {models}")
    t.add_argument("--steps", type=int, default=20)
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--warmup", type=int, default=2, help="linear warm-up steps, then cosine decay")
    t.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    t.add_argument("--clip", type=float, default=1.0, help="max global gradient norm")
    t.add_argument("--checkpointing", default="full", choices=["none", "full", "selective"])
    _shape_flags(t, " (batch: rows per rank per micro-batch)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--checkpoint-dir")
    t.add_argument("--save-every", type=int, default=0, help="save a checkpoint every K steps")
    t.add_argument(
        "--resume",
        nargs="?",
        const="yes",
        default="no",
        choices=["no", "yes", "auto"],
        help="continue from --checkpoint-dir (auto: only if a checkpoint is there)",
    )
    t.add_argument("--json", help="write the log and a digest of the final parameters here")
    return p


def _shape_flags(p: argparse.ArgumentParser, note: str = "") -> None:
    for name in ("layers", "hidden", "seq", "batch"):
        p.add_argument(f"--{name}", type=int, help=f"override the preset's {name}{note}")


def _config(cls: type, args: argparse.Namespace) -> Config:
    """``cls`` built from the parsed flags that are its fields (a flag's dest is its field's name)."""
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    return cls(**{k: v for k, v in vars(args).items() if k in fields})


def parse_config(argv: list[str] | None = None) -> Config:
    """The config of the command that ``argv`` names (``["train", "--steps", "5"]`` gives a
    TrainConfig); raises ValueError when a value is wrong, SystemExit on a malformed line."""
    args = _parser().parse_args(argv)
    return _config(COMMANDS[args.command][0], args)


def main(argv: list[str] | None = None) -> int:
    """Run the command that ``argv`` (default: ``sys.argv[1:]``) names; the exit status."""
    args = _parser().parse_args(argv)
    config_class, command = COMMANDS[args.command]
    try:
        command(_config(config_class, args))
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
