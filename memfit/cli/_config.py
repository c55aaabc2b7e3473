"""Every `memfit` command's configuration in one module: a dataclass per command whose fields
are its flags (See [Note: Flags from the config] in memfit/cli/_flags.py), each default declared
here once, each value checked in ``__post_init__`` (See [Note: One line per bad input]).

The commands (memfit/cli/_bench.py, _plan.py, _train.py) and the modules they use import their
config from here; nothing here imports a command, so the imports run one way.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field
from typing import ClassVar

import torch

import memfit
from memfit.cli._flags import DEVICE_HELP, DEVICES, decision_kind, flag
from memfit.cli._launch import choose_device
from memfit.models import PRESETS
from memfit.models._spec import ModelSpec, resolve

# Not OFFLOAD: a block's input offloaded to disk under sharded training is untested
CHECKPOINTING = tuple(k.value for k in memfit.DecisionKind if k.spec.train_applies)
STRATEGIES = (*(k.value for k in memfit.DecisionKind), "planned")  # each DecisionKind on every block, or planned
MIXED = {"no": None, "bf16": torch.bfloat16}  # --mixed-precision: the compute dtype (None: the parameters')
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # memfit plan --dtype
MODELS = f"a preset ({', '.join(sorted(PRESETS))}), a local HF config.json (or its directory), or pkg.module:function"
_BUDGETS = "e.g. 80GB (decimal, = 74.5 GiB), 80GiB or 80G (binary), 800MB"

# [Note: One line per bad input]
# A value the command cannot run with is refused before anything is built, by the config's
# __post_init__, with one line that names the flag, the value and what to pass instead; `memfit`
# prints it and exits with status 2, in bench, plan and train alike. A size of 0 or below is
# refused (never replaced by the default: `--batch 0` is not "the preset's batch"); a budget must
# be a positive size (`--budget -1GB` reaches the check: see _flags.joined_negatives); a model
# transformers cannot build as a language model is refused by memfit.models._spec.resolve. What
# needs the model built (a sequence longer than its learned positions) is checked right after
# the build, before the first step (memfit/cli/_data.py check_first_batch). argparse's own errors
# (a malformed number, an unknown choice) are one line too (_flags.Parser).


@dataclass
class ModelConfig:
    """The model a command runs and its sizes: the flags bench, plan and train share."""

    COMMAND: ClassVar[str] = "memfit"  # how its errors start

    model: str = field(default="bert", metadata=flag(MODELS))
    layers: int | None = field(default=None, metadata=flag("override the preset's number of blocks"))
    hidden: int | None = field(default=None, metadata=flag("override the preset's hidden size"))
    seq: int | None = field(
        default=None,
        metadata=flag("tokens per sequence (default: the preset's; a config's: 128, or its positions if fewer)"),
    )
    batch: int | None = field(
        default=None, metadata=flag("sequences per rank per micro-batch (default: the preset's, else 8)")
    )

    def check_sizes(self) -> None:
        """Refuse a size below 1 (See [Note: One line per bad input])."""
        for name in ("layers", "hidden", "seq", "batch"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(
                    f"{self.COMMAND}: --{name} {value}: pass a whole number of at least 1, or leave --{name} out "
                    "for the model's own"
                )


def check_budget(command: str, budget: str, name: str = "--budget") -> int:
    """The bytes of a budget flag; a ValueError naming the flag when it is not a positive size."""
    try:
        return memfit.parse_bytes(budget)
    except (ValueError, TypeError) as e:
        why = str(e).removeprefix("memfit: ")
        advice = "" if "write a whole number" in why else f"; pass a positive size, {_BUDGETS}"  # said once
        raise ValueError(f"{command}: {name} {budget}: {why}{advice}") from None


# --host-budget, --disk, --disk-budget, --disk-bandwidth: the tiers of the model state (memfit.plan's
# host_budget=, disk=, disk_budget=, disk_bandwidth=; See [Note: Planned tiers]), in plan and train
def _host_budget_field():
    return field(
        default=None,
        metadata=flag(
            "with --budget: host memory per rank for the model state beyond the device (e.g. 200GB; "
            "memfit.plan chooses the tiers)",
            metavar="SIZE",
        ),
    )


def _disk_field():
    return field(
        default=None,
        metadata=flag("with --budget: a directory on a local disk for the disk tier of the model state", metavar="DIR"),
    )


def _disk_budget_field():
    return field(
        default=None, metadata=flag("bytes the disk tier may take (default: DIR's free space)", metavar="SIZE")
    )


def _disk_bandwidth_field():
    return field(
        default=None,
        metadata=flag("the disk's bytes per second, e.g. 2GB (its dd figure; default: 1GB)", metavar="SIZE"),
    )


def tier_options(cfg: PlanConfig | TrainConfig) -> dict:
    """memfit.plan's keywords for the tiers the flags ask for ({}: none), with the --clip their
    host step clips at (See [Note: Planned tiers]); refused where bad."""
    given = {k: v for k in ("host_budget", "disk", "disk_budget", "disk_bandwidth") if (v := getattr(cfg, k))}
    if not given:
        return {}
    names = ", ".join(f"--{k.replace('_', '-')}" for k in given)
    if not getattr(cfg, "budget", None):
        raise ValueError(f"{cfg.COMMAND}: {names} plan the tiers of the model state for a --budget: pass one")
    if getattr(cfg, "trials", 0):
        raise ValueError(f"{cfg.COMMAND}: {names} with --trials: the trials time no tiers yet; drop one")
    if cfg.disk_budget is not None and cfg.disk is None:
        raise ValueError(f"{cfg.COMMAND}: --disk-budget is the room of the disk tier: pass --disk DIR too")
    for name in ("host_budget", "disk_budget", "disk_bandwidth"):
        if name in given:
            given[name] = check_budget(cfg.COMMAND, given[name], f"--{name.replace('_', '-')}")
    if cfg.disk is not None and not os.path.isdir(cfg.disk):
        raise ValueError(f"{cfg.COMMAND}: --disk {cfg.disk!r} is not a directory; pass one on a local disk")
    if "disk_bandwidth" in given:
        given["disk_bandwidth"] = float(given["disk_bandwidth"])
    return {**given, "max_norm": cfg.clip}


def _at_least(command: str, minimum: int, **values: int) -> None:
    for name, value in values.items():
        if value < minimum:
            flag_ = "--" + name.replace("_", "-")
            raise ValueError(f"{command}: {flag_} {value}: pass a whole number of at least {minimum}")


@dataclass
class ConfigFile:
    """`memfit train --config FILE` (memfit/cli/_config_file.py): the defaults of the flags."""

    config: str | None = field(
        default=None, metadata=flag("a TOML or YAML file of flag values (keys: flag names); flags override it")
    )


@dataclass
class Program:
    """The flags of `memfit` itself, before the command."""

    version: bool = field(
        default=False,
        metadata=flag(
            "print memfit's version and exit",
            action="version",
            version=f"memfit {memfit.__version__}",
            default=argparse.SUPPRESS,
        ),
    )


@dataclass
class BenchConfig(ModelConfig):
    """What `memfit bench` runs (each field is a command-line flag)."""

    COMMAND: ClassVar[str] = "memfit bench"
    HELP: ClassVar[str] = "memory and step time of each strategy on a real architecture"
    DESCRIPTION: ClassVar[str | None] = None

    strategies: tuple[str, ...] | None = field(
        default=None, metadata=flag(f"from {', '.join(STRATEGIES)} (default: all; one process only)", nargs="+")
    )
    budget: str | None = field(
        default=None, metadata=flag("memory budget of the planned strategy, e.g. 300MB (default: halfway)")
    )
    compare: bool = field(default=False, metadata=flag("add torch.utils.checkpoint (with --world-size: FSDP2)"))
    world_size: int = field(default=1, metadata=flag("N > 1: DDP vs memfit sharding on N spawned ranks"))
    device: str = field(default="auto", metadata=flag(DEVICE_HELP, choices=DEVICES))
    warmup: int = field(default=2, metadata=flag("untimed steps per strategy first"))
    repeats: int = field(default=5, metadata=flag("timed steps per strategy (the median is reported)"))
    json: str | None = field(default=None, metadata=flag("write the results here"))
    plot: str | None = field(default=None, metadata=flag("write a PNG of peak memory against step time here"))
    spec: ModelSpec = field(init=False, compare=False, repr=False)  # derived from the fields above

    def __post_init__(self) -> None:
        self.check_sizes()
        if self.world_size > 1 and (self.strategies is not None or self.budget is not None):
            raise ValueError(
                f"memfit bench: --strategies and --budget apply to one process; --world-size {self.world_size} "
                "compares DDP with memfit sharding (add --compare for torch FSDP2). Drop them, or drop --world-size"
            )
        self.strategies = tuple(STRATEGIES if self.strategies is None else map(decision_kind, self.strategies))
        self.spec = resolve(
            self.model, layers=self.layers, hidden=self.hidden, seq=self.seq, batch=self.batch, command=self.COMMAND
        )
        bad = [s for s in self.strategies if s not in STRATEGIES]
        if bad:
            raise ValueError(f"memfit bench: unknown strategies {bad}; choose from {list(STRATEGIES)}")
        if self.world_size < 1:
            raise ValueError("memfit bench: --world-size must be >= 1")
        # --device cuda without a GPU, or more ranks than GPUs, fails here
        spawned = self.world_size if self.world_size > 1 else None
        choose_device(self.device, env={"LOCAL_RANK": str(self.world_size - 1)}, spawned=spawned, where=self.COMMAND)
        if self.warmup < 1 or self.repeats < 1:
            raise ValueError("memfit bench: --warmup and --repeats must be >= 1")
        if self.budget is not None:
            check_budget(self.COMMAND, self.budget)


@dataclass
class PlanConfig(ModelConfig):
    """What `memfit plan` plans (each field is a command-line flag)."""

    COMMAND: ClassVar[str] = "memfit plan"
    HELP: ClassVar[str] = "the plan and forecast for a memory budget (measures one batch)"
    DESCRIPTION: ClassVar[str | None] = (
        "Plan per-block activation checkpointing for a memory budget, from shapes only (the model on the meta "
        "device, one batch on fake tensors). Prints the decision per block, whether it fits, the terms that add up "
        "to the peak, every lever ranked by time per GiB saved, and the `memfit train` command that runs it. "
        f"Budgets: {_BUDGETS}."
    )

    budget: str = field(kw_only=True, metadata=flag(f"the memory per rank to plan for, {_BUDGETS}"))
    world_size: int = field(default=1, metadata=flag("forecast per rank for a model sharded over N ranks"))
    shard_size: int | None = field(
        default=None, metadata=flag("hybrid sharding: shard over groups of S ranks, replicated N/S times")
    )
    dtype: str = field(default="fp32", metadata=flag("parameters, gradients and optimizer state", choices=list(DTYPES)))
    mixed_precision: str = field(
        default="no",
        metadata=flag(
            "bf16: forecast memfit train --mixed-precision bf16 (bf16 compute, fp32 master weights, gradients "
            "reduced in fp32, fp32 optimizer state)",
            choices=list(MIXED),
        ),
    )
    device_profile: str | None = field(
        default=None,
        metadata=flag(
            "price time on: h100, h200, a100, cpu, calibrated (memfit calibrate); default: this machine's "
            "accelerator's named profile, else cpu"
        ),
    )
    json: str | None = field(default=None, metadata=flag("write the plan here"))
    host_budget: str | None = _host_budget_field()
    disk: str | None = _disk_field()
    disk_budget: str | None = _disk_budget_field()
    disk_bandwidth: str | None = _disk_bandwidth_field()
    clip: float = field(
        default=1.0,
        metadata=flag(
            "the max global gradient norm memfit train clips at: with --disk, the disk tier's bytes a step are "
            "those of a clipped step"
        ),
    )
    auto: bool = field(
        default=False,
        metadata=flag(
            "search micro-batch, gradient accumulation, sharding layout and checkpointing for the most tokens/s "
            "that fits --budget per rank on --world-size ranks (memfit.autoconfigure); --batch is the example batch"
        ),
    )
    global_batch: int | None = field(
        default=None, metadata=flag("with --auto: samples per optimizer step (default: free)")
    )
    emit: str | None = field(
        default=None, metadata=flag("write the run for `memfit train --config RUN.toml` here", metavar="RUN.toml")
    )
    plot: str | None = field(
        default=None, metadata=flag("draw the predicted memory over one step, by term, here", metavar="F.png")
    )

    def __post_init__(self) -> None:
        self.check_sizes()
        self.spec()  # an unknown model fails here
        if self.plot is not None and not self.plot.endswith(".png"):
            raise ValueError(f"memfit plan: --plot {self.plot!r}: name a .png file")
        if self.emit is not None and not self.emit.endswith(".toml"):
            raise ValueError(f"memfit plan: --emit {self.emit!r}: name a .toml file (memfit train --config reads it)")
        check_budget(self.COMMAND, self.budget)
        tier_options(self)
        if not self.clip > 0:
            raise ValueError(f"memfit plan: --clip {self.clip} must be > 0 (the max global gradient norm)")
        if self.world_size < 1:
            raise ValueError("memfit plan: --world-size must be >= 1")
        if self.shard_size is not None and (self.shard_size < 1 or self.world_size % self.shard_size):
            raise ValueError(
                f"memfit plan: --shard-size {self.shard_size} must divide --world-size {self.world_size} "
                "(hybrid sharding: world size = replicas x shard size)"
            )
        if self.global_batch is not None and not self.auto:
            raise ValueError("memfit plan: --global-batch is for --auto (the search over micro-batches)")
        if self.global_batch is not None:
            _at_least(self.COMMAND, 1, global_batch=self.global_batch)
        if self.dtype not in DTYPES:
            raise ValueError(f"memfit plan: unknown --dtype {self.dtype!r}; choose one of {sorted(DTYPES)}")
        if self.mixed_precision not in MIXED:
            raise ValueError(f"memfit plan: --mixed-precision takes {list(MIXED)}, got {self.mixed_precision!r}")
        if self.mixed_precision != "no" and self.dtype != "fp32":
            raise ValueError(
                f"memfit plan: --mixed-precision {self.mixed_precision} keeps fp32 master weights and computes in "
                f"{self.mixed_precision}: drop --dtype {self.dtype}"
            )
        from memfit._plan._time import PROFILES

        if self.device_profile not in (None, "calibrated", *PROFILES):
            raise ValueError(
                f"memfit plan: unknown --device-profile {self.device_profile!r}; choose one of "
                f"{sorted(PROFILES)} or 'calibrated'"
            )

    def spec(self) -> ModelSpec:
        return resolve(
            self.model, layers=self.layers, hidden=self.hidden, seq=self.seq, batch=self.batch, command=self.COMMAND
        )


@dataclass
class CalibrateConfig:
    """What `memfit calibrate` measures (each field is a command-line flag)."""

    COMMAND: ClassVar[str] = "memfit calibrate"
    HELP: ClassVar[str] = "measure this machine's rates for the planner's time model; cached"
    DESCRIPTION: ClassVar[str | None] = None

    device: str = field(default="cpu", metadata=flag("the device to measure: cpu, cuda, cuda:1, ..."))
    cpu_time: bool = field(
        default=False,
        metadata=flag(
            "one thread, timed in process CPU time: steady rates on a shared, loaded machine (the planner "
            "benchmark's setting); by default all threads and the wall clock"
        ),
    )
    world_size: int = field(
        default=1,
        metadata=flag(
            "spawn this many ranks (gloo on the CPU, one GPU each with NCCL) that calibrate together: each "
            "rank's share of the machine, the links' latency and bandwidth and each collective's host cost, for "
            "`memfit plan --auto --world-size N` (1: one process, no link figures)"
        ),
    )

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"memfit calibrate: --world-size must be >= 1, got {self.world_size}")
        if self.world_size > 1 and self.device not in ("cpu", "cuda"):
            raise ValueError(
                f"memfit calibrate: --world-size {self.world_size} runs on --device cpu (gloo) or cuda (rank r on "
                f"GPU r, NCCL), got {self.device!r}"
            )
        if self.world_size > 1 and self.cpu_time:
            raise ValueError(
                "memfit calibrate: --cpu-time measures one thread alone, --world-size the ranks sharing the "
                "machine: choose one"
            )


@dataclass
class TrainConfig(ModelConfig):
    """What `memfit train` runs: each field is a command-line flag (its metadata the flag's help
    and argparse keywords; See [Note: Flags from the config]) and a config-file key."""

    COMMAND: ClassVar[str] = "memfit train"
    HELP: ClassVar[str] = "train a model on your data (one process, or under torchrun); resumable"
    DESCRIPTION: ClassVar[str | None] = (
        "Train a preset, a local HF config.json or a factory pkg.module:function on local data. Every flag can "
        "also come from --config FILE (TOML or YAML, keys are the flag names); flags override it."
    )

    data: str | None = field(
        default=None, metadata=flag("text file or directory, or .npy/.bin token ids (default: stdlib sources)")
    )
    tokenizer: str | None = field(default=None, metadata=flag("a local tokenizer.json for text data (default: bytes)"))
    val_fraction: float = field(default=0.05, metadata=flag("tail of the tokens held out for evaluation"))
    eval_every: int = field(default=0, metadata=flag("evaluate every K steps and at the end (0: never)"))
    eval_batches: int = field(default=4, metadata=flag("micro-batches per evaluation"))
    steps: int = field(default=20, metadata=flag("optimizer steps in all"))
    lr: float = field(default=3e-4, metadata=flag("peak learning rate"))
    warmup: int = field(default=2, metadata=flag("linear warm-up steps, then cosine decay"))
    accumulate: int = field(default=1, metadata=flag("micro-batches per step"))  # each of --batch rows per rank
    global_batch: int | None = field(
        default=None,
        metadata=flag(
            "sequences per step over all ranks: sets --accumulate to N / (--batch x world size) (default: "
            "--batch x --accumulate x world size; a run resumed at another world size keeps its checkpoint's)",
            metavar="N",
        ),
    )
    clip: float = field(default=1.0, metadata=flag("max global gradient norm"))
    checkpointing: str | None = field(
        default=None, metadata=flag("per block (default: full)", choices=CHECKPOINTING, type=decision_kind)
    )
    budget: str | None = field(
        default=None,
        metadata=flag("plan checkpointing per block to fit SIZE per rank (e.g. 70GiB; memfit.plan)", metavar="SIZE"),
    )
    plan: str | None = field(
        default=None, metadata=flag("apply the per-block checkpointing of a saved plan (memfit plan --json FILE)")
    )
    host_budget: str | None = _host_budget_field()
    disk: str | None = _disk_field()
    disk_budget: str | None = _disk_budget_field()
    disk_bandwidth: str | None = _disk_bandwidth_field()
    auto: bool = field(
        default=False,
        metadata=flag(
            "with --budget: choose --batch, the accumulation, the sharding layout and per-block checkpointing "
            "for the most predicted tokens/s (memfit.autoconfigure; --global-batch, or a resumed checkpoint's, "
            "fixes the global batch)"
        ),
    )
    trials: int = field(
        default=0,
        metadata=flag(
            "with --auto: build each of the K fastest-predicted configurations afresh, time 5 steps after 2 "
            "warm-up, and train the fastest expected: the measured steps blended with the predictions rescaled "
            "to this machine (AutoConfig.measure, docs/planning.md; on a GPU, one over --budget there is "
            "refused); 0: the fastest predicted",
            metavar="K",
        ),
    )
    mixed_precision: str = field(
        default="no",
        metadata=flag(
            "bf16: gather and compute in bf16, reduce gradients in fp32, fp32 master weights", choices=list(MIXED)
        ),
    )
    hybrid_shards: int = field(
        default=0,
        metadata=flag(
            "hybrid sharding: shard over groups of N consecutive ranks (a node), replicate across them (0: over all)",
            metavar="N",
        ),
    )
    seed: int = field(default=0, metadata=flag("initialisation, dropout and masking"))
    checkpoint_dir: str | None = field(
        default=None, metadata=flag("checkpoints go to DIR/step-N: at the end, on SIGTERM/SIGINT and --save-every")
    )
    save_every: int = field(default=0, metadata=flag("also save a checkpoint every K steps (0: at the end only)"))
    keep_last: int = field(default=0, metadata=flag("keep only the newest N checkpoints (0: all)"))
    async_save: bool = field(
        default=False,
        metadata=flag(
            "write --save-every checkpoints in the background while training goes on (the last one is waited for)"
        ),
    )
    resume: str = field(
        default="no",
        metadata=flag(
            "continue from the newest checkpoint in --checkpoint-dir (auto: only if there is one)",
            nargs="?",
            const="yes",
            choices=["no", "yes", "auto"],
        ),
    )
    overwrite: bool = field(
        default=False,
        metadata=flag("start afresh in a --checkpoint-dir that holds another run's checkpoints, deleting them"),
    )
    export: str | None = field(
        default=None, metadata=flag("write a safetensors export (from_pretrained loads it) here at the end")
    )
    log_every: int = field(default=1, metadata=flag("print and record metrics every N steps"))
    metrics: str | None = field(default=None, metadata=flag("append metrics here as JSON lines, as the run goes"))
    tensorboard: str | None = field(
        default=None, metadata=flag("TensorBoard log directory (needs the tensorboard package)")
    )
    json: str | None = field(default=None, metadata=flag("write the log and a digest of the final parameters here"))
    device: str = field(default="auto", metadata=flag(DEVICE_HELP, choices=DEVICES))

    def check_rates(self) -> None:
        """A clip, learning rate or held-out share that would train wrongly without an error."""
        if not self.clip > 0:  # a negative clip flips every gradient, 0 zeroes them
            raise ValueError(f"memfit train: --clip {self.clip} must be > 0 (the max global gradient norm)")
        if not self.lr > 0:
            raise ValueError(f"memfit train: --lr {self.lr} must be > 0")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"memfit train: --val-fraction {self.val_fraction} must be in [0, 1)")

    def __post_init__(self) -> None:
        self.check_sizes()
        self.check_rates()
        choose_device(self.device, where="memfit train")  # --device cuda without a GPU fails here
        # None: not given (full, unless --budget or --plan chooses); "none": the old spelling of "keep"
        self.checkpointing = None if self.checkpointing is None else decision_kind(self.checkpointing)
        if self.checkpointing is not None and self.checkpointing not in CHECKPOINTING:
            raise ValueError(f"memfit train: unknown checkpointing {self.checkpointing!r}; choose from {CHECKPOINTING}")
        if self.resume not in ("no", "yes", "auto"):
            raise ValueError("memfit train: --resume takes no, yes or auto")
        if (self.resume != "no" or self.save_every or self.overwrite) and not self.checkpoint_dir:
            raise ValueError("memfit train: --resume, --save-every and --overwrite need --checkpoint-dir")
        if self.overwrite and self.resume != "no":
            raise ValueError(
                "memfit train: --overwrite starts afresh, deleting the checkpoints; --resume continues from them: "
                "pass one of the two"
            )
        if min(self.steps, self.accumulate, self.log_every, self.eval_batches) < 1 or self.warmup < 0:
            raise ValueError("memfit train: --steps, --accumulate, --log-every, --eval-batches >= 1, --warmup >= 0")
        if self.global_batch is not None and (self.global_batch < 1 or self.accumulate != 1):
            raise ValueError("memfit train: --global-batch must be >= 1, and sets --accumulate: pass one of the two")
        self._check_choice()
        if min(self.save_every, self.keep_last, self.eval_every, self.hybrid_shards) < 0:
            raise ValueError("memfit train: --save-every, --keep-last, --eval-every and --hybrid-shards must be >= 0")
        self.spec()  # an unknown model fails here, before any process group forms

    def _check_choice(self) -> None:
        """--checkpointing, --budget and --plan each choose the checkpointing: one at most."""
        chosen = [f for f, on in (("--budget", self.budget), ("--plan", self.plan)) if on]
        chosen += ["--checkpointing"] * (self.checkpointing is not None)
        if len(chosen) > 1:
            raise ValueError(f"memfit train: {' and '.join(chosen)} each choose the checkpointing: pass one")
        if self.budget:
            check_budget(self.COMMAND, self.budget)  # a bad size fails here
        tier_options(self)
        if self.auto and not self.budget:
            raise ValueError("memfit train: --auto searches configurations that fit a --budget: pass one")
        if self.auto and (self.batch or self.accumulate != 1 or self.hybrid_shards):
            raise ValueError("memfit train: --auto chooses --batch, --accumulate and --hybrid-shards: leave them out")
        if self.trials < 0:
            raise ValueError(f"memfit train: --trials takes 0 (none) or more configurations to try, not {self.trials}")
        if self.trials and not self.auto:
            raise ValueError("memfit train: --trials K tries --auto's top configurations: pass --auto (and --budget)")
        if self.mixed_precision not in MIXED:
            raise ValueError(f"memfit train: --mixed-precision takes {list(MIXED)}")

    @property
    def kind(self) -> str:
        """The checkpointing kind for every block when neither --budget nor --plan chooses."""
        return self.checkpointing or "full"

    def spec(self) -> ModelSpec:
        return resolve(self.model, layers=self.layers, hidden=self.hidden)

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
