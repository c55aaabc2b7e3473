"""Planned tiers (See [Note: Planned tiers]): memfit.plan's forecast of the host memory and the
disk tier's bytes (held, read and written a step) against what memfit.host_optimizer's tier
holds and moves, on a GPT-2 and a BERT preset at one rank; and the choice of tiers as the
budgets change. Counts of bytes only: no timing."""

import functools
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


def _measured(preset: str, disk_blocks: tuple[str, ...], directory: str) -> dict[str, int]:
    """Host memory of the model state after the second step (shards, gradients, buffers and
    optimizer state outside the disk files), the disk files' bytes, and the second step's reads
    (bytes the tier dropped, to be read at their next use) and writes."""
    spec, batch = _built(preset)[:2]
    model = spec.build(0)
    model = memfit.FullyShardedDataParallel(model, auto_wrap_policy={layer_class(model)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = memfit.host_optimizer(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-3),
            disk=directory,
            disk_modules=[model.get_submodule(p) for p in disk_blocks],
        )
    disk = opt._memfit_host_step.disk

    def files():
        return [*disk.param_files.values(), *disk.state_files.values()]

    for step in range(2):
        for f in files():
            f.written = f.dropped = 0
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


@pytest.mark.parametrize("preset", PRESETS)
def test_the_forecast_of_host_and_disk_bytes_is_what_the_tier_holds_and_moves(one_rank, tmp_path, preset):
    total, block = _state(preset)
    plan = _plan(preset, host_budget=total - int(1.5 * block), disk=str(tmp_path))
    tiers = plan.tiers
    assert tiers is not None and len(tiers.disk_blocks) == 2  # two blocks leave host memory
    got = _measured(preset, tiers.disk_blocks, str(tmp_path))
    forecast = {
        "host": tiers.host_bytes,
        "disk": tiers.disk_bytes,
        "reads": tiers.disk_read_bytes,
        "writes": tiers.disk_write_bytes,
    }
    for what, value in forecast.items():
        assert abs(value - got[what]) <= 0.03 * got[what], (preset, what, value, got[what])
    assert got["room"] == got["disk"]  # the room check asked for what the files take
    assert plan.to_dict()["tiers"]["disk_blocks"] == list(tiers.disk_blocks)
    assert "blocks on disk" in plan.table()


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
