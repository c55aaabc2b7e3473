"""What `memfit train` checkpoints, and at which batch and layout: one --checkpointing kind for
every block, a plan for a --budget (memfit.plan), a saved plan (--plan FILE), or the whole
configuration (--auto: memfit.autoconfigure). See [Note: Choosing a run's configuration]."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

import memfit
from memfit._plan._autoconfig import AutoConfig, Candidate, Layout, held_gradients
from memfit._plan._budget import format_bytes
from memfit._plan._tiers import TierChoice
from memfit._plan._time import default_profile
from memfit.cli._config import MIXED, tier_options
from memfit.cli._data import window_batch

if TYPE_CHECKING:
    from memfit.cli._config import TrainConfig
    from memfit.cli._data import Tokens

# [Note: Choosing a run's configuration]
# `memfit train` builds the model in host memory, then decides before sharding it:
# - --checkpointing KIND (default full): that kind for every block;
# - --budget SIZE: memfit.plan on the first micro-batch of the data, sharded over the world size
#   (hybrid with --hybrid-shards), whole head (the trainer computes its loss whole), the kinds
#   keep / selective / full (offload is untested under sharding): its per-block decisions;
# - --plan FILE: the per-block decisions of a saved plan (`memfit plan --json FILE`), every path
#   checked against the model before anything runs;
# - --auto with --budget: memfit.autoconfigure over micro-batch sizes (the global batch fixed
#   when --global-batch is given), accumulation, shard group sizes and reshard_after_forward,
#   and the per-block decisions at each; the pick (most predicted tokens/s within the budget)
#   sets --batch, the accumulation, the layout and the decisions. With --trials K the top K are
#   timed first and the fastest expected trains; its checkpoints record it, and a restart at the
#   same world size trains it again without trying (picked_before).
# Time is priced on the named profile of the device the run computes on. With --mixed-precision
# bf16 both plan the step as memfit's units compute it (bf16 copies and activations beside fp32
# shards and optimizer state, gradients summed in fp32: [Note: Forecasts under mixed
# precision]), replicated layouts too.
PLANNED_KINDS = tuple(k.value for k in memfit.DecisionKind if k.spec.train_applies)
_TRAIN_ADVICE = "a smaller --batch, more ranks (torchrun --nproc-per-node), or a larger --budget."


@dataclass
class Choice:
    """The configuration a run trains with (See [Note: Choosing a run's configuration])."""

    decisions: dict[str, str]  # block path -> kind
    batch: int  # rows per rank per micro-batch
    accumulate: int | None  # micro-batches per step (None: from --accumulate / --global-batch)
    hybrid_shards: int  # shard group size (0: all ranks)
    reshard_after_forward: bool
    about: str  # what the start line says of it
    forecast: float | None = None  # the planner's peak per rank, bytes (with --budget or --auto)
    search: AutoConfig | None = None  # --auto's (memfit train --trials measures its top)
    tiers: TierChoice | None = None  # where the model state lives (--host-budget, --disk: memfit.plan's tiers)

    def apply(self, model: nn.Module, rule: str = "linear") -> None:
        for path, kind in self.decisions.items():
            memfit.Decision.parse(kind, save=rule).apply(model.get_submodule(path), name=path)


def choose(
    cfg: TrainConfig,
    model: nn.Module,
    block: type,
    data: tuple[Tokens, str, int, int],
    world: int,
    device: str,
    accumulate: int = 1,
    global_batch: int | None = None,
) -> Choice:
    """The run's configuration from the flags; ``model`` (in host memory, not yet sharded) is
    planned on its first micro-batch when --budget asks, never changed here. ``data``: the
    tokens, the model's arch, the sequence length and --batch; ``device``: the device type the
    run computes on; ``accumulate``: micro-batches per step (a --budget plan holds their
    gradients); ``global_batch``: the one --auto keeps (--global-batch, or a resumed
    checkpoint's; None: free)."""
    tokens, arch, seq, batch = data
    paths = [p for p, m in model.named_modules() if isinstance(m, block)]
    layout = (cfg.hybrid_shards, True)
    if cfg.plan:
        decisions, note = _saved_decisions(cfg.plan, model, paths, world)
        return Choice(decisions, batch, None, *layout, f"from the plan {cfg.plan}: {_counts(decisions)}{note}")
    if not cfg.budget:
        return Choice(dict.fromkeys(paths, cfg.kind), batch, None, *layout, cfg.kind)
    example = window_batch(tokens.train, arch, batch, seq, 0, cfg.seed, tokens.mask_id)
    profile = default_profile("cuda" if device == "cuda" else "cpu")
    if cfg.auto:
        return _auto(cfg, model, example, world, profile, paths, global_batch)
    opts: dict[str, Any] = {"world_size": world, "shard_size": cfg.hybrid_shards or None}
    opts.update(decisions=PLANNED_KINDS, candidates=paths, chunk_head=False, device_profile=profile)
    opts.update(mixed_precision=mixed_precision(cfg.mixed_precision), **tier_options(cfg))
    if "max_norm" in opts:  # the tiers' disk path: the run's micro-batches (See [Note: Planned tiers])
        replicated = (cfg.hybrid_shards or world) == 1  # See [Note: Reducing accumulated gradients]
        opts.update(accumulate=accumulate, no_sync=accumulate > 1 and replicated)
    try:
        plan = memfit.plan(model, example, budget=cfg.budget if accumulate == 1 else 2**62, **opts)
        if accumulate > 1:  # the gradients accumulated over the micro-batches: solved with them held
            held = held_gradients(plan.profile, Layout(world, cfg.hybrid_shards or world), accumulate)
            plan = memfit.plan(model, example, budget=cfg.budget, profile=held, **opts)
    except memfit.PlanError as e:
        raise memfit.PlanError(
            f"{e} memfit train computes the head and loss whole (`memfit plan`'s smallest budget may chunk them: "
            f"its line says so); for memfit train: {_TRAIN_ADVICE}"
        ) from None
    about = f"planned for {cfg.budget} per rank: {_counts(plan.decisions)}, forecast peak {_gib(plan.predicted_peak)}"
    if plan.tiers is not None:
        about += f"; {plan.tiers.line()}"
    return Choice(dict(plan.decisions), batch, None, *layout, about, plan.predicted_peak, tiers=plan.tiers)


def _auto(
    cfg: TrainConfig,
    model: nn.Module,
    example: dict,
    world: int,
    device,
    paths: list[str],
    global_batch: int | None,
) -> Choice:
    # Every layout, replicated too: train runs a replicated one on memfit's units over a (W, 1)
    # mesh, which compute on their parameters and all-reduce once per unit, as the planner
    # prices it (benchmarks/results/autoconfig_memfit_replicated_cpu.md).
    result = memfit.autoconfigure(
        model, example, budget=str(cfg.budget), world_size=world, global_batch=global_batch,
        device_profile=device, decisions=PLANNED_KINDS, chunk_head=False,
        mixed_precision=mixed_precision(cfg.mixed_precision), **tier_options(cfg),
    )  # fmt: skip
    return dataclasses.replace(_choice(result.best, paths, world, cfg, result.device), search=result)


def tried(
    cfg: TrainConfig, search: AutoConfig, paths: list[str], world: int, step_of: Callable, device: torch.device
) -> Choice:
    """--trials K: the Choice of the fastest expected of ``search``'s top K (AutoConfig.measure;
    ``step_of(choice)`` builds one afresh and returns a training step of it, on ``device``), the
    tried listed."""
    build = lambda c: step_of(_choice(c, paths, world, cfg, search.device))  # noqa: E731
    result = search.measure(build, top=cfg.trials, device=device)
    choice = _choice(result.best, paths, world, cfg, search.device)
    said = []
    for c in result.candidates:
        refused = c.lost if c.lost.startswith(("memory: measured", "memory: out of memory")) else ""
        took = f"{c.measured * 1e3:.1f} ms" if c.measured is not None else ""
        took += f" (expected {c.expected * 1e3:.1f} ms)" if took and c.expected is not None else ""
        what = f"{took} ({refused})" if took and refused else took or refused
        if what:
            said.append(f"{c.micro_batch} x {c.accumulation} {c.layout.describe()}: {what}")
    scale = ""
    if result.trial_scale is not None and result.trial_weight is not None:  # See [Note: Trying configurations]
        scale = (
            f"; trial scale {result.trial_scale:.2f} (the median measured / predicted), measured-time weight "
            f"{result.trial_weight:.2f}"
        )
    return dataclasses.replace(choice, about=f"{choice.about}; tried {', '.join(said)}{scale}")


def trials_record(choice: Choice, world: int, timed: dict) -> dict:
    """What a checkpoint records of the configuration --trials picked, and ``timed``: what it was
    timed under (See :func:`picked_before`)."""
    shards = choice.hybrid_shards or world
    return _trials_key(world, choice.batch, choice.accumulate, shards, choice.reshard_after_forward, timed)


def _trials_key(world: int, micro: int, accumulation: int | None, shards: int, reshard: bool, timed: dict) -> dict:
    """A configuration as --trials' record names it (one spelling for the record and its match)."""
    key: dict[str, object] = {"world": world, "micro_batch": micro, "accumulation": accumulation}
    return key | {"shard_size": shards, "reshard_after_forward": reshard, **timed}


def picked_before(
    record: object, search: AutoConfig, paths: list[str], world: int, cfg: TrainConfig, timed: dict
) -> Choice | None:
    """The configuration an earlier --trials picked (``record``: what the resumed checkpoint
    recorded), where this run's search has it and it fits: a restart at the same world size and
    ``timed`` (precision, sequence length, device type: what :func:`trials_record` recorded)
    trains it again without trying (None: try; another world size searches other layouts,
    another precision, length or device times other steps)."""
    if not isinstance(record, dict) or record.get("world") != world:
        return None
    for c in search.candidates:
        key = _trials_key(
            world, c.micro_batch, c.accumulation, c.layout.shard_size, c.layout.reshard_after_forward, timed
        )
        if c.fits and key == record:
            choice = _choice(c, paths, world, cfg, search.device)
            return dataclasses.replace(choice, about=f"{choice.about}; picked by --trials before, not tried again")
    return None


def _choice(best: Candidate, paths: list[str], world: int, cfg: TrainConfig, priced_on: str) -> Choice:
    """The Choice that trains ``best``, one of autoconfigure's configurations."""
    assert best.plan is not None  # autoconfigure raises when nothing fits, and measures only those that fit
    decisions = {p: best.plan.decisions.get(p, "keep") for p in paths}
    shards = best.layout.shard_size if best.layout.shard_size < world else 0
    measured = ""
    if best.measured is not None:
        expected = "" if best.expected is None else f", picked by its expected step {best.expected * 1e3:.1f} ms"
        measured = f", {best.measured * 1e3:.1f} ms a step measured (--trials{expected})"
    about = (
        f"--auto for {cfg.budget} per rank: micro-batch {best.micro_batch} x accumulation {best.accumulation}, "
        f"{best.layout.describe()}, {_counts(decisions)}, forecast peak {_gib(best.peak)}, "
        f"{best.tokens_per_second:,.0f} tokens/s predicted on {priced_on}{measured}"
    )
    reshard = best.layout.reshard_after_forward
    tiers = best.plan.tiers
    about += f"; {tiers.line()}" if tiers is not None else ""
    return Choice(decisions, best.micro_batch, best.accumulation, shards, reshard, about, best.peak, tiers=tiers)


def _saved_decisions(path: str, model: nn.Module, paths: list[str], world: int) -> tuple[dict[str, str], str]:
    """The decisions of the plan saved at ``path`` for every block of ``model`` (``paths``), and a
    note for the start line when it was made for another world size."""
    try:
        with open(path) as f:
            saved = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"memfit train: --plan {path!r}: no such file (relative paths start from here)") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"memfit train: --plan {path!r}: cannot read it as JSON ({e})") from None
    saved = saved.get("plan", saved) if isinstance(saved, dict) else saved  # `memfit plan --auto --json` nests it
    decisions = saved.get("decisions") if isinstance(saved, dict) else None
    if not isinstance(decisions, dict) or not decisions:
        raise ValueError(f"memfit train: --plan {path!r} has no 'decisions' (write one with memfit plan --json FILE)")
    names = dict(model.named_modules())
    missing = [p for p in decisions if p not in names]
    if missing:
        raise ValueError(
            f"memfit train: --plan {path!r} decides for blocks this model lacks ({', '.join(missing[:4])}): "
            "plan the same --model, --layers and --hidden"
        )
    undecided = [p for p in paths if p not in decisions]
    if undecided:
        raise ValueError(
            f"memfit train: --plan {path!r} decides for {len(decisions)} of this model's {len(paths)} blocks "
            f"(not {', '.join(undecided[:4])}): plan the same --model, --layers and --hidden"
        )
    bad = [k for k in decisions.values() if k not in PLANNED_KINDS]
    if bad:
        raise ValueError(f"memfit train: --plan {path!r}: kind {bad[0]!r}; memfit train applies {PLANNED_KINDS}")
    planned_for = saved.get("world_size")
    note = (
        ""
        if planned_for in (None, world)
        else f" (planned for world size {planned_for}: its forecast is not this run's)"
    )
    return {str(p): str(k) for p, k in decisions.items()}, note


def _counts(decisions: dict[str, str]) -> str:
    counts = {k: sum(v == k for v in decisions.values()) for k in PLANNED_KINDS}
    return ", ".join(f"{n} {k}" for k, n in counts.items() if n)


def _gib(n: float) -> str:
    return format_bytes(int(n))


def mixed_precision(name: str) -> memfit.MixedPrecision | None:
    """--mixed-precision: bf16 gathers and computes in bf16 (norm layers in fp32), sums gradients
    across ranks in fp32 and keeps fp32 master weights and optimizer state (FSDP2's
    MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), torchtitan's default)."""
    dtype = MIXED[name]
    return None if dtype is None else memfit.MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32)
