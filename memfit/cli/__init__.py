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

from memfit.cli._bench import bench
from memfit.cli._config import BenchConfig, CalibrateConfig, ConfigFile, PlanConfig, Program, TrainConfig
from memfit.cli._config_file import with_config_file
from memfit.cli._flags import DefaultsShown, Parser, add_flags, joined_negatives
from memfit.cli._launch import end_process_group, leave_now
from memfit.cli._plan import calibrate_command, plan_command
from memfit.cli._preempt import Preempted, exit_status
from memfit.cli._train import train

__all__ = ["BenchConfig", "PlanConfig", "TrainConfig", "bench", "main", "parse_config", "plan_command", "train"]

Config = BenchConfig | PlanConfig | TrainConfig | CalibrateConfig
COMMANDS: dict[str, tuple[type[Config], Callable]] = {
    "bench": (BenchConfig, bench),
    "plan": (PlanConfig, plan_command),
    "calibrate": (CalibrateConfig, calibrate_command),
    "train": (TrainConfig, train),
}


def _parser() -> argparse.ArgumentParser:
    """The command line, generated: the program's flags, then a subcommand per config dataclass
    with a flag per field (See [Note: Flags from the config]); ``train`` also takes --config."""
    p = Parser(prog="memfit", description="Train PyTorch models larger than your memory.")
    add_flags(p, Program)
    sub = p.add_subparsers(dest="command", required=True)
    for name, (config, _) in COMMANDS.items():
        c = sub.add_parser(name, help=config.HELP, description=config.DESCRIPTION, formatter_class=DefaultsShown)
        if name == "train":
            add_flags(c, ConfigFile)  # See memfit/cli/_config_file.py
        add_flags(c, config)
    return p


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
    argv = joined_negatives(sys.argv[1:] if argv is None else argv)
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
