"""Where sharding puts tensors and how they cross between host and device, checked without a
GPU on the meta test device (memfit.testing.meta_accelerator): a pretend accelerator whose
process group, like NCCL, takes only its tensors, whose ops refuse CPU operands as CUDA's do,
and whose values cannot be read on the host except through memfit's one counted read. One
process simulates the ranks; nothing is computed (meta tensors hold no values): the values
are checked by the gloo parity tests (tests/distributed/test_shard_init.py, test_shard_mixed.py).

Only a real GPU covers: CUDA streams and events, pinned host memory (False here: no
accelerator to pin for), the overlap of copies with compute, and the allocator's peaks.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import memfit
from memfit.testing import (
    HostSyncCounter,
    device_audit,
    fake_allocator,
    meta_accelerator,
    placed_optimizer_state,
    sharded_units,
)

META = torch.device("meta")


def net(device="cpu"):
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).to(device)


def sharded(model, **kw):
    memfit.shard(model[0], **kw)
    return memfit.shard(model, **kw)


def train_step(model, opt):
    model(torch.randn(3, 4, device=META)).sum().backward()
    opt.step()
    opt.zero_grad()


def devices(tensors):
    return {t.device.type for t in tensors}


def test_the_meta_accelerator_refuses_what_nccl_and_cuda_refuse():
    with meta_accelerator(2):
        with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
            dist.broadcast(torch.zeros(2), src=0)
        with pytest.raises(RuntimeError, match="expected device"):
            torch.zeros(2) + torch.zeros(2, device=META)
        with pytest.raises(RuntimeError, match="meta"):
            torch.zeros((), device=META).item()  # a hidden host sync cannot pass


def test_deferred_init_defaults_to_the_process_groups_accelerator():
    """Point 5: a model built on the meta device gets its chunks and buffers on the device
    the process group communicates on (NCCL: the current GPU), not the CPU."""
    with meta_accelerator(2):
        model = sharded(net(META))
        assert devices(model.parameters()) == {"meta"} and devices(model.buffers()) == {"meta"}
        memfit.materialize(model)
        train_step(model, torch.optim.AdamW(model.parameters()))


def test_a_group_with_a_host_backend_beside_the_accelerators_computes_on_the_accelerator():
    """Point 5: a group of two backends (``init_process_group("cpu:gloo,cuda:nccl")``, as
    torchtitan makes for host-side collectives) computes on its accelerator, not the CPU."""
    with meta_accelerator(with_gloo=True):
        model = sharded(net())
        assert devices(model.parameters()) == {"meta"} and devices(model.buffers()) == {"meta"}
        model = sharded(net(META), offload="cpu")
        assert {sp.full.device.type for u in sharded_units(model) for sp in u.params} == {"meta"}


@pytest.mark.parametrize("explicit", [False, True])
def test_a_model_built_on_the_host_moves_to_the_compute_device(explicit):
    """Point 4: parameters (their chunks) and buffers built on the CPU go to the compute
    device (``device=`` or the group's), and sync_module_states broadcasts them there."""
    with meta_accelerator(2):
        model = sharded(net(), **({"device": META} if explicit else {}))
        assert devices(model.parameters()) == {"meta"} and devices(model.buffers()) == {"meta"}
        train_step(model, torch.optim.AdamW(model.parameters()))


class Tied(nn.Module):
    """A head tied to the embedding, each sharded on its own: the root adopts the tied weight."""

    def __init__(self):
        super().__init__()
        self.emb, self.mid, self.head = nn.Embedding(8, 4), nn.Linear(4, 4), nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.mid(self.emb(x)))


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_a_root_built_on_the_host_adopts_a_tie_already_on_the_compute_device(offload):
    """Point 4: the units below moved their chunks to the compute device; the root's own
    parameters, still on the host, follow them there (not "live on several devices")."""
    with meta_accelerator(2):
        model = Tied()
        for m in (model.emb, model.head, model):
            memfit.shard(m, offload=offload)
        assert {sp.full.device.type for u in sharded_units(model) for sp in u.params} == {"meta"}
        model(torch.zeros(3, dtype=torch.long, device=META)).sum().backward()


@pytest.mark.parametrize("below", [None, "cpu"])
def test_a_tie_adopted_across_offload_settings_is_refused_when_sharding(below):
    """A root adopting a tie whose shard lives elsewhere than its own (offloaded below, not
    here, or the reverse) would land that tie's gradient on the other device in backward:
    refused by ``shard``, naming the tie."""
    with meta_accelerator(2):
        model = Tied()
        memfit.shard(model.emb, offload=below)
        memfit.shard(model.head, offload=below)
        with pytest.raises(ValueError, match=r"emb\.weight.*offload"):
            memfit.shard(model, offload="cpu" if below is None else None)


def test_a_device_this_process_lacks_is_a_clear_error():
    with meta_accelerator(1), pytest.raises(ValueError, match=r"memfit.shard: device='cuda', but .* no cuda device"):
        memfit.shard(net(), device="cuda")


def test_offload_of_a_model_built_on_the_host():
    """Point 1: shards in host memory, copied from the parameters' rows (never from a freed
    full tensor), full parameters and buffers on the compute device, and a training step."""
    with meta_accelerator(2, rank=1):
        model = sharded(net(), offload="cpu", sync_module_states=False)
        assert devices(model.parameters()) == {"cpu"} and devices(model.buffers()) == {"meta"}
        assert {sp.full.device.type for u in sharded_units(model) for sp in u.params} == {"meta"}
        train_step(model, torch.optim.AdamW(model.parameters()))
        assert devices(p.grad for p in model.parameters() if p.grad is not None) <= {"cpu"}


def test_offload_keeps_the_values_of_the_host_parameters():
    """Point 1: each rank's chunk holds its rows of the parameter it replaced."""
    torch.manual_seed(0)
    full = {k: v.clone() for k, v in net().state_dict().items()}
    with meta_accelerator(2, rank=1):
        torch.manual_seed(0)
        model = memfit.shard(net(), offload="cpu", sync_module_states=False)
        for name, p in model.named_parameters():
            assert torch.equal(p, full[name].chunk(2)[1]), name


def test_offloaded_shards_cross_once_each_way_per_unit_and_the_host_waits_once():
    """Point 8: one non-blocking host-to-device copy per gather (the unit's chunks packed into
    one staging buffer, whatever its parameter count), one device-to-host copy of each unit's
    reduced gradients, one host wait for them and one host read per step."""
    with meta_accelerator(2):
        model = sharded(net(), offload="cpu")
        opt = torch.optim.AdamW(model.parameters())
        train_step(model, opt)
        with device_audit() as audit:
            train_step(model, opt)
        # forward gathers the root and the block; backward gathers the block again (the root kept its)
        assert len(audit.to_device) == 3 and all(nb for _, _, nb in audit.to_device)
        assert len(audit.to_host) == 2 and all(nb for _, _, nb in audit.to_host)
        assert audit.host_waits == 1 and audit.host_reads == 1


def test_backward_blocks_the_host_on_no_upload():
    """Issue 23 point 7: the reduce-scatter's flags and check values (built in the first
    backward, per pattern of gradients) cross from pinned memory without blocking the host,
    not as ``torch.tensor(values, device=...)`` (a pageable copy the host waits for); nothing
    else in a step waits for the host either. Only a GPU shows the copy overlapping compute."""
    with meta_accelerator(2):
        model = sharded(net(META))
        memfit.materialize(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            with HostSyncCounter() as syncs, device_audit() as audit:
                train_step(model, opt)
            assert syncs.calls == [] and syncs.in_backward == []
        assert audit.host_reads == 1  # the checks of the step before, at the root's forward


def test_the_host_sync_counter_sees_blocking_uploads():
    with HostSyncCounter() as syncs:
        torch.tensor([1.0, 2.0], device=META)
        torch.zeros(2).to(META)
        torch.empty(2, device=META).copy_(torch.zeros(2))
        torch.zeros(2).to(META, non_blocking=True)
        torch.tensor([1.0])  # on the host: nothing crosses
    assert len(syncs.calls) == 3, syncs.calls


def test_hybrid_shard_from_local_world_size_meshes_the_accelerator(monkeypatch):
    """Issue 23 point 13: HYBRID_SHARD with no mesh or groups builds its (nodes, per node) mesh
    from LOCAL_WORLD_SIZE on the device the process group's backend talks to (NCCL: cuda; here
    the pretend accelerator), not a CPU mesh holding accelerator DTensors; state dicts then
    name that device. Only a GPU shows NCCL's subgroups on it."""
    from torch.distributed.fsdp import ShardingStrategy

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with meta_accelerator(4, rank=1):
        model = memfit.FullyShardedDataParallel(net(META), sharding_strategy=ShardingStrategy.HYBRID_SHARD)
        mesh = sharded_units(model)[0].layout.mesh
        assert mesh is not None and mesh.device_type == "meta" and mesh.shape == (2, 2)
        memfit.materialize(model)
        assert {t.device_mesh.device_type for t in model.state_dict().values() if hasattr(t, "device_mesh")} == {"meta"}


def test_the_audit_records_only_inside_its_context():
    """Outside ``device_audit()`` nothing is kept: a long offloaded run must not grow a log of
    every copy (two or three entries per unit and step)."""
    with meta_accelerator(2):
        model = sharded(net(), offload="cpu")
        opt = torch.optim.AdamW(model.parameters())
        with device_audit() as audit:
            train_step(model, opt)
        seen = (len(audit.to_device), len(audit.to_host), audit.host_waits, audit.host_reads)
        train_step(model, opt)
        assert (len(audit.to_device), len(audit.to_host), audit.host_waits, audit.host_reads) == seen


def test_load_full_state_dict_broadcasts_on_the_compute_device():
    """Point 2: NCCL refuses host tensors, so rank 0's tensors travel on the compute device."""
    for offload in (None, "cpu"):
        with meta_accelerator(2):
            model = sharded(net(META), offload=offload)
            memfit.load_full_state_dict(model, net().state_dict())
            assert not any(sp.deferred for u in sharded_units(model) for sp in u.params)


def test_load_full_state_dict_refuses_tensors_without_values():
    """A state dict of meta tensors (a model built for deferred init) has nothing to load:
    refused on every rank, naming the tensors, instead of loading uninitialised memory."""
    with meta_accelerator(2):
        model = sharded(net(META))
        with pytest.raises(RuntimeError, match=r"on the meta device.*'0\.weight'"):
            memfit.load_full_state_dict(model, net(META).state_dict())


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize("offload", [None, "cpu"])
def test_clip_grad_norm_reduces_on_the_compute_device_with_one_host_read(norm_type, offload):
    """Point 3: the all-reduce runs on the compute device even when the shards are offloaded
    or the root owns no parameter, and the norm is read on the host once (inf-norm too)."""
    with meta_accelerator(2):
        model = nn.Sequential(net())  # the root owns no parameter
        memfit.shard(model[0][0], offload=offload)
        memfit.shard(model[0], offload=offload)
        memfit.shard(model, offload=offload)
        model(torch.randn(3, 4, device=META)).sum().backward()
        with device_audit() as audit:
            memfit.clip_grad_norm_(model, 1.0, norm_type=norm_type)
        assert audit.host_reads == 1


def test_loaded_optimizer_state_goes_where_torch_puts_it():
    """Point 6: ``step`` on the parameter's device (fp32) for fused and capturable optimizers,
    in host memory for the others (read there without a sync); other state on the parameter's
    device."""
    p = torch.zeros(3, device=META)
    step = torch.tensor(4.0)
    for flags in ({"fused": True}, {"capturable": True}):
        got = placed_optimizer_state(step, p, flags, "step")
        assert got.device == META and got.dtype == torch.float32
    assert placed_optimizer_state(step, p, {}, "step").device.type == "cpu"
    assert placed_optimizer_state(torch.ones(2), p, {}, "max_exp_avg_sq").device == META


def test_memory_meter_measures_the_compute_device_of_an_offloaded_model():
    """Point 11: the default device is where the units gather, not the host shards'."""
    with meta_accelerator(1):
        model = memfit.shard(net(), offload="cpu")
        assert memfit.MemoryMeter(model=model).device == META


class FakeAllocator:
    """Stands in for torch.cuda's allocator statistics."""

    def __init__(self):
        self.calls = []

    def is_available(self):
        return True

    def synchronize(self, device):
        self.calls.append("synchronize")

    def reset_peak_memory_stats(self, device):
        self.calls.append("reset")

    def max_memory_allocated(self, device):
        return 3 << 20

    def max_memory_reserved(self, device):
        return 8 << 20


def test_memory_meter_reports_the_allocator_peaks_beside_live_bytes():
    """Point 11: allocated and reserved peaks, read after syncs outside the region."""
    fake = FakeAllocator()
    with fake_allocator(fake), memfit.MemoryMeter(device="cpu") as meter:
        torch.ones(1024)
    assert meter.peak_bytes == 4096
    assert (meter.allocator_peak_bytes, meter.allocator_reserved_peak_bytes) == (3 << 20, 8 << 20)
    assert fake.calls == ["synchronize", "reset", "synchronize"]
    assert "reserved=8.00MiB" in repr(meter)
    with memfit.MemoryMeter(device="cpu") as plain:
        pass
    assert plain.allocator_peak_bytes is None and plain.allocator_reserved_peak_bytes is None


def test_summon_full_params_writes_back_to_offloaded_shards():
    """Full parameters on the device, written back into host shards (outside the hot path)."""
    with meta_accelerator(2):
        model = memfit.shard(net(), offload="cpu")
        with memfit.summon_full_params(model):
            assert devices(model.parameters()) == {"meta"}
        assert devices(model.parameters()) == {"cpu"}


def test_async_save_stages_dtensors_in_host_memory():
    """Issue 48 bug 1: a DTensor's staged copy stays in host memory (``DTensor.from_local``
    moved it back to the mesh's device: a blocking upload of the whole state), keeps the
    spec, and staging leaves no device wait behind on the meta device (a GPU records an event
    the writer thread waits for; not run here)."""
    from torch.distributed.tensor import DTensor

    from memfit._persist._async_save import Saves

    with meta_accelerator(2):
        model = sharded(net(META))
        memfit.materialize(model)
        state = model.state_dict()
        saves = Saves()
        staged = saves.stage(state)
        assert set(staged) == set(state)
        for key, v in state.items():
            got = staged[key]
            local = got.to_local() if isinstance(got, DTensor) else got
            assert local.device.type == "cpu", key
            if isinstance(v, DTensor):
                assert got._spec == v._spec and got.shape == v.shape, key
        assert saves._staged == []


def test_offloaded_state_dict_meshes_the_compute_device():
    """Issue 48 bug 2: an offloaded shard's DTensor keeps its host chunk but is placed on a
    mesh of the compute device (NCCL's), as FSDP2's are: a CPU mesh over an NCCL group would
    send host tensors into NCCL (``full_tensor``, a reshard on load)."""
    from torch.distributed.tensor import DTensor

    from memfit._shard._state_dict import _full

    with meta_accelerator(2):
        model = sharded(net(), offload="cpu", sync_module_states=False)
        state = model.state_dict()
        dts = [v for v in state.values() if isinstance(v, DTensor)]
        assert dts and {v.device_mesh.device_type for v in dts} == {"meta"}
        assert {v.to_local().device.type for v in dts} == {"cpu"}
        model.load_state_dict(state)
        full = {k: _full(v) for k, v in state.items() if isinstance(v, DTensor)}  # gathered on the device
        assert {v.device.type for v in full.values()} == {"meta"}  # (meta: no values to load back)


def test_offloaded_gradients_that_accumulate_make_the_host_wait_once_per_backward():
    """Issue 48 bug 2: backwards that add into offloaded gradient shards (accumulation without
    no_sync) wait on the host once, at the end of backward, not once per unit inside it
    (which stalled the host until the device drained, every unit)."""
    with meta_accelerator(2):
        model = sharded(net(), offload="cpu")
        opt = torch.optim.AdamW(model.parameters())
        train_step(model, opt)
        with device_audit() as audit:
            for _ in range(3):  # three micro-batches, each adding into the gradients before
                model(torch.randn(3, 4, device=META)).sum().backward()
        assert audit.host_waits == 3
        assert devices(p.grad for p in model.parameters()) == {"cpu"}


def test_offloaded_checkpoint_files_mesh_the_compute_device():
    """Issue 48: save_checkpoint's DTensors of offloaded shards (model and optimizer state)
    sat on a CPU mesh over the process group, so DCP's save and load of them ran host
    collectives on NCCL. Now, as in state_dict(), each is on a mesh of the compute device with
    the host chunk itself as its local part (no copy to the device either)."""
    from torch.distributed.tensor import DTensor

    from memfit._persist._checkpoint_files import _meshes, _model_state, _optim_state, _shard_params

    with meta_accelerator(2):
        model = sharded(net(), offload="cpu", sync_module_states=False)
        opt = torch.optim.AdamW(model.parameters())
        train_step(model, opt)
        shards, _ = _shard_params(model)
        meshes = _meshes(shards)
        state = _model_state(model, meshes, shards)
        state.update(_optim_state(opt, model, meshes, shards)[0])
        dts = {k: v for k, v in state.items() if isinstance(v, DTensor)}
        assert any(k.startswith("optim/") for k in dts) and any(k.startswith("model/") for k in dts)
        assert {v.device_mesh.device_type for v in dts.values()} == {"meta"}
        assert {v.to_local().device.type for v in dts.values()} == {"cpu"}
        chunks = {id(sp.sharded): sp.sharded for sp in shards.values()}
        ptrs = {t.data_ptr() for t in chunks.values()}
        assert all(
            dts[f"model/{n}"].to_local().data_ptr() in ptrs
            for n, t in model.state_dict(keep_vars=True).items()
            if id(t) in chunks and t.numel()
        )
