"""The `memfit` command: `bench` (memory and time of strategies on a real architecture) and
`plan` (the plan and forecast for a budget). Thin: parse into a config dataclass, run."""

from __future__ import annotations

import argparse
import sys

from memfit.cli._bench import STRATEGIES, BenchConfig, bench
from memfit.models import PRESETS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memfit", description="Train PyTorch models larger than your memory.")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("bench", help="memory and step time of each strategy on a real architecture")
    b.add_argument("--model", default="bert", help=f"one of {', '.join(sorted(PRESETS))} (default: bert)")
    b.add_argument("--strategies", nargs="+", default=list(STRATEGIES), help=f"from {', '.join(STRATEGIES)}")
    b.add_argument("--budget", help="memory budget of the planned strategy, e.g. 300MB (default: halfway)")
    b.add_argument("--compare", action="store_true", help="add torch.utils.checkpoint (with --world-size: FSDP2)")
    b.add_argument("--world-size", type=int, default=1, help="N > 1: DDP vs memfit sharding on N spawned ranks")
    for name in ("layers", "hidden", "seq", "batch"):
        b.add_argument(f"--{name}", type=int, help=f"override the preset's {name}")
    b.add_argument("--warmup", type=int, default=2)
    b.add_argument("--repeats", type=int, default=5)
    b.add_argument("--json", help="write the results here")
    b.add_argument("--plot", help="write a PNG of peak memory against step time here")

    pl = sub.add_parser("plan", help="the plan and forecast for a memory budget (measures one batch)")
    pl.add_argument("--model", default="bert", help=f"one of {', '.join(sorted(PRESETS))}")
    pl.add_argument("--budget", required=True, help="e.g. 4GB, 3.5GiB, 800MB")
    pl.add_argument("--world-size", type=int, default=1, help="forecast per rank for a model sharded over N ranks")
    for name in ("layers", "hidden", "seq", "batch"):
        pl.add_argument(f"--{name}", type=int, help=f"override the preset's {name}")
    pl.add_argument("--json", help="write the plan here")

    t = sub.add_parser("train", help="train a preset (one process, or under torchrun); resumable")
    t.add_argument("--model", default="bert", help=f"one of {', '.join(sorted(PRESETS))}")
    t.add_argument("--steps", type=int, default=20)
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--warmup", type=int, default=2, help="linear warm-up steps, then cosine decay")
    t.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    t.add_argument("--clip", type=float, default=1.0, help="max global gradient norm")
    t.add_argument("--checkpointing", default="full", choices=["none", "full", "selective"])
    for name in ("layers", "hidden", "seq", "batch"):
        t.add_argument(f"--{name}", type=int, help=f"override the preset's {name} (batch: per rank)")
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
    t.add_argument("--fail-at-step", type=int, help=argparse.SUPPRESS)  # tests: the last rank dies there once
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "bench":
            cfg = BenchConfig(
                model=args.model,
                strategies=tuple(args.strategies),
                budget=args.budget,
                compare=args.compare,
                world_size=args.world_size,
                layers=args.layers,
                hidden=args.hidden,
                seq=args.seq,
                batch=args.batch,
                warmup=args.warmup,
                repeats=args.repeats,
                json=args.json,
                plot=args.plot,
            )
            bench(cfg)
        elif args.command == "train":
            from memfit.cli._train import TrainConfig, train

            train(
                TrainConfig(
                    **{k: v for k, v in vars(args).items() if k != "command"},
                )
            )
        else:
            from memfit.cli._plan import PlanConfig, plan_command

            plan_command(
                PlanConfig(
                    model=args.model,
                    budget=args.budget,
                    world_size=args.world_size,
                    layers=args.layers,
                    hidden=args.hidden,
                    seq=args.seq,
                    batch=args.batch,
                    json=args.json,
                )
            )
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
