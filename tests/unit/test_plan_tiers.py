"""Planned tiers (See [Note: Planned tiers]): memfit.plan's forecast of the host memory and the
disk tier's bytes (held, read and written a step) against what memfit.host_optimizer's tier
holds and moves, on a GPT-2 and a BERT preset at one rank; and the choice of tiers as the
budgets change. Counts of bytes only: no timing."""

import contextlib
import functools
import math
import warnings

import pytest
import torch

import memfit
from memfit._plan._tiers import unit_state
from memfit.models._spec import layer_class, resolve

PRESETS = ["gpt2", "bert"]


@functools.cache
def _built(preset: str):
    spec = resolve(preset, layers=3, hidden=128)
    model = spec.build(0)
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    paths = [p for p, m in model.named_modules() if isinstance(m, layer_class(model))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        profile = memfit.plan(model, batch, budget="100GB", candidates=paths).profile
    return spec, batch, paths, profile, model


def _state(preset: str) -> tuple[int, int]:
    """The model state per rank and one block's parameters and optimizer state (all equal)."""
    root, blocks = unit_state(_built(preset)[3], 1)
    return sum(map(sum, [root, *blocks])), blocks[0][0] + blocks[0][2]


def _plan(preset: str, **tiers):
    _, batch, paths, profile, model = _built(preset)  # (plan does not modify the model)
    return memfit.plan(model, batch, budget=tiers.pop("budget", "100GB"), candidates=paths, profile=profile, **tiers)


# the host step's paths (memfit.host_optimizer's max_norm, overlap, accumulate; no_sync): the
# step in backward; after it, clipped (memfit train's), or without overlap; accumulated, in
# backward and, clipped, after it, and in no_sync but the last (memfit train at one rank)
PATHS = {
    "in-backward": {},
    "clipped": {"max_norm": 0.5},
    "no-overlap": {"overlap": False},
    "accumulated": {"accumulate": 2},
    "clipped-accumulated": {"max_norm": 0.5, "accumulate": 2},
    "no-sync": {"accumulate": 2, "no_sync": True},
}


def _measured(preset: str, disk_blocks: tuple[str, ...], directory: str, no_sync=False, **path) -> dict[str, int]:
    """Host memory of the model state after the second step (shards, gradients, buffers and
    optimizer state outside the disk files), the disk files' bytes, and the second step's reads
    (bytes the tier dropped, to be read at their next use) and writes, on the host step's
    ``path``."""
    spec, batch = _built(preset)[:2]
    model = spec.build(0)
    model = memfit.FullyShardedDataParallel(model, auto_wrap_policy={layer_class(model)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = memfit.host_optimizer(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-3),
            **path,
            disk=directory,
            disk_modules=[model.get_submodule(p) for p in disk_blocks],
        )
    disk = opt._memfit_host_step.disk

    def files():
        return [*disk.param_files.values(), *disk.grad_files.values(), *disk.state_files.values()]

    for step in range(2):
        for f in files():
            f.written = f.dropped = 0
        micro = path.get("accumulate", 1)
        for i in range(micro):
            with model.no_sync() if no_sync and i < micro - 1 else contextlib.nullcontext():
                model(**batch).loss.backward()
        opt.step()
        if step == 1:
            tensors = [*model.parameters(), *model.buffers()]
            tensors += [p.grad for p in model.parameters() if p.grad is not None]
            tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            host = {
                t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors
                if not any(f.holds(t) for f in files())
            }
        opt.zero_grad(set_to_none=True)
    return {
        "host": sum(host.values()),
        "disk": sum(f.nbytes for f in files()),
        "reads": sum(f.dropped for f in files()),
        "writes": sum(f.written for f in files()),
        "room": disk.bytes,
    }


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("preset", PRESETS)
def test_the_forecast_of_host_and_disk_bytes_is_what_the_tier_holds_and_moves(one_rank, tmp_path, preset, path):
    total, block = _state(preset)
    plan = _plan(preset, host_budget=total - int(1.5 * block), disk=str(tmp_path), **PATHS[path])
    tiers = plan.tiers
    assert tiers is not None and len(tiers.disk_blocks) == 2  # two blocks leave host memory
    got = _measured(preset, tiers.disk_blocks, str(tmp_path), **PATHS[path])
    forecast = {
        "host": tiers.host_bytes,
        "disk": tiers.disk_bytes,
        "reads": tiers.disk_read_bytes,
        "writes": tiers.disk_write_bytes,
    }
    for what, value in forecast.items():  # the bytes moved: the same path's counts (alignment aside)
        within = 1e-5 if what in ("reads", "writes") else 0.03
        assert abs(value - got[what]) <= within * got[what], (preset, path, what, value, got[what])
    assert got["room"] == got["disk"]  # the room check asked for what the files take
    assert plan.to_dict()["tiers"]["disk_blocks"] == list(tiers.disk_blocks)
    assert "Tiers: model state in host memory" in plan.table() and "2 blocks on disk" in plan.table()


@pytest.mark.parametrize("preset", PRESETS)
def test_the_choice_follows_the_budgets(tmp_path, preset):
    total, block = _state(preset)
    disk = str(tmp_path)
    assert _plan(preset, disk=disk).tiers.disk_blocks == ()  # the disk only adds time: none there
    assert len(_plan(preset, host_budget=total - block // 2, disk=disk).tiers.disk_blocks) == 1
    two = _plan(preset, host_budget=total - int(1.5 * block), disk=disk)
    assert len(two.tiers.disk_blocks) == 2 and two.tiers.extra_time > 0
    assert two.predicted_step_time > _plan(preset, disk=disk).predicted_step_time
    with pytest.raises(ValueError, match="no tiers fit"):
        _plan(preset, host_budget=total - int(1.5 * block), disk=disk, disk_budget=block)  # room for one
    with pytest.raises(ValueError, match="no tiers fit"):
        _plan(preset, host_budget=total // 10, disk=disk)  # not even with every block on disk
    # planned for an accelerator: the state stays on the device where it fits there, else host memory
    on_device = _plan(preset, host_budget="1TB", device_profile="h100")
    assert on_device.tiers.state == "device" and on_device.tiers.host_bytes == 0
    floor = on_device.predicted_peak
    offloaded = _plan(preset, budget=floor - block, host_budget="1TB", device_profile="h100")
    assert offloaded.tiers.state == "host" and offloaded.tiers.host_bytes == total
    assert offloaded.predicted_peak <= floor - block < offloaded.predicted_peak + offloaded.tiers.device_saved


def test_memfit_train_applies_the_planned_tiers(one_rank, tmp_path, monkeypatch):
    """`memfit train --budget --host-budget --disk` plans the tiers on its first micro-batch and
    applies them: the host step with --accumulate and --clip, the planned blocks' units on the
    disk tier, reading and writing what the plan forecast a step (its path: clipped, after two
    micro-batches)."""
    import memfit.cli._train as train
    from memfit.cli._config import TrainConfig
    from memfit.cli._data import window_batch
    from memfit.cli._preempt import StopRequests
    from memfit.cli._train import _build, _step

    shape = {"model": "gpt2", "layers": 3, "hidden": 32, "seq": 16, "batch": 2, "accumulate": 2, "device": "cpu"}
    plain = _build(TrainConfig(**shape), torch.device("cpu"))
    assert getattr(plain.opt, "_memfit_host_step", None) is None  # no tiers asked: the optimizer as built
    micro = window_batch(plain.tokens.train, plain.spec.arch, plain.batch, plain.seq, 0, 0, plain.tokens.mask_id)
    kinds = ("keep", "selective", "full")
    planned = memfit.plan(plain.spec.build(0), micro, budget="1TB", decisions=kinds, chunk_head=False)
    root, blocks = unit_state(planned.profile, 1)
    total, block = sum(map(sum, [root, *blocks])), blocks[0][0] + blocks[0][2]
    tiers = {"host_budget": str(total - int(1.5 * block)), "disk": str(tmp_path)}
    chosen, choose = [], train.choose  # the run's choice: its plan's tiers
    monkeypatch.setattr(train, "choose", lambda *a, **k: chosen.append(choose(*a, **k)) or chosen[-1])
    run = _build(TrainConfig(budget="1TB", clip=0.5, **shape, **tiers), torch.device("cpu"))
    host = run.opt._memfit_host_step
    assert (host.accumulate, host.max_norm) == (2, 0.5)
    assert len(host.disk.units) == 2 and host.disk.directory == str(tmp_path)
    stop = StopRequests(rank=0)
    _step(run, 0, False, stop)
    for f in host.disk.files():
        f.written = f.dropped = 0
    entry, _ = _step(run, 1, False, stop)
    assert math.isfinite(entry["loss"]) and entry["grad_norm"] == pytest.approx(host.last_norm)
    forecast = chosen[0].tiers
    moved = {"reads": sum(f.dropped for f in host.disk.files()), "writes": sum(f.written for f in host.disk.files())}
    assert abs(forecast.disk_read_bytes - moved["reads"]) <= 1e-5 * moved["reads"], (forecast, moved)
    assert abs(forecast.disk_write_bytes - moved["writes"]) <= 1e-5 * moved["writes"], (forecast, moved)


def test_the_tier_flags_are_refused_without_what_they_need(tmp_path):
    from memfit.cli._config import TrainConfig

    with pytest.raises(ValueError, match="--host-budget plan the tiers of the model state for a --budget"):
        TrainConfig(host_budget="1GB")
    with pytest.raises(ValueError, match="--disk-budget is the room of the disk tier: pass --disk DIR"):
        TrainConfig(budget="1GB", disk_budget="1GB")
    with pytest.raises(ValueError, match="not a directory"):
        TrainConfig(budget="1GB", disk=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="the trials time no tiers yet"):
        TrainConfig(budget="1GB", auto=True, trials=2, disk=str(tmp_path))
    TrainConfig(budget="1GB", auto=True, disk=str(tmp_path))  # --auto plans the tiers of each configuration


def test_autoconfigure_plans_the_tiers_of_each_configuration(tmp_path):
    """autoconfigure's pick carries its plan's tiers; a host budget that only the disk meets puts
    blocks on disk there too, and one that nothing meets leaves no configuration."""
    _, batch, _, _, model = _built("gpt2")
    total, block = _state("gpt2")
    opts = {"budget": "100GB", "world_size": 1, "micro_batches": [2], "disk": str(tmp_path)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        free = memfit.autoconfigure(model, batch, **opts)
        tight = memfit.autoconfigure(model, batch, host_budget=total - int(1.5 * block), **opts)
        with pytest.raises(memfit.PlanError):
            memfit.autoconfigure(model, batch, host_budget=total // 10, **opts)
    assert free.plan.tiers is not None and free.plan.tiers.disk_blocks == ()
    assert len(tight.plan.tiers.disk_blocks) == 2
    assert tight.best.time["recompute"] == pytest.approx(tight.plan.predicted_overhead)  # accumulation 1
