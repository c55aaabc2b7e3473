"""The stream rules of sharding ([Note: Streams and buffer lifetimes]) checked in one process
on the meta test device: the ranks are simulated, the streams are traced (every record, wait,
and every use of a buffer written on one stream and read, added into or freed on another),
and the trace's checker finds a use not ordered after the stream that wrote the buffer.

Only a GPU shows that the recorded order is also the order the device runs (real CUDA
streams and events, NCCL writing the reduce output while compute runs).
"""

import contextlib

import torch
from torch import nn

import memfit
from memfit.testing import Trace, debug_collectives, meta_accelerator, sharded_units, trace_streams

META = torch.device("meta")


def sharded_net(**kw):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).to(META)
    memfit.shard(model[0], **kw)
    memfit.shard(model[2], **kw)
    memfit.shard(model, **kw)
    memfit.materialize(model)
    return model


def backward(model):
    model(torch.randn(3, 4, device=META)).sum().backward()


def test_gradients_accumulated_into_existing_shards_wait_for_the_reduce():
    """Point 1 of the GPU-correctness issue: a second backward without no_sync (also
    zero_grad(set_to_none=False), retain_graph) adds the reduced gradients into the shards'
    existing ones; the add must run after the reduce-scatter and division that write them."""
    with meta_accelerator(2), trace_streams() as trace:
        model = sharded_net()
        backward(model)
        backward(model)  # the shards have gradients: this one adds into them
        torch.optim.SGD(model.parameters(), lr=0.1).zero_grad(set_to_none=False)
        backward(model)
    assert trace.violations() == []
    adds = [e for e in trace.log if e[0] == "use" and e[1].endswith(":grad-shards") and e[2] == "reduce"]
    assert len(adds) == 2 * 3  # two accumulating backwards, three units: on the reduce stream, as FSDP2
    # the reduce outputs added are freed there, on the stream that wrote them (the first views them)
    frees = [e for e in trace.log if e[0] == "free" and e[1].endswith(":reduce-out")]
    assert frees == [("free", e[1].replace(":grad-shards", ":reduce-out"), "reduce") for e in adds], frees


def test_debug_checks_read_the_reduce_output_after_the_reduce():
    """Point 2: MEMFIT_DEBUG_COLLECTIVES=1 reads each reduce output's check values at once, on
    compute: only after compute waited for the reduce stream's post-reduce event."""
    with meta_accelerator(2), debug_collectives(), trace_streams() as trace:
        model = sharded_net()
        backward(model)
        backward(model)
    reads = [i for i, e in enumerate(trace.log) if e[0] == "use" and e[1].endswith(":reduce-out")]
    assert any(trace.log[i][2] == "compute" for i in reads)
    assert trace.violations() == []


def test_replicated_units_debug_checks_are_ordered():
    """A (4, 1) mesh with MEMFIT_DEBUG_COLLECTIVES=1: each unit's buffer is written on compute
    (the gradients copied in), all-reduced on the all-reduce stream and read at once on compute;
    every read follows a wait on what wrote it, across kept gradients and no_sync."""
    from torch.distributed.device_mesh import init_device_mesh

    with meta_accelerator(4, rank=1), debug_collectives(), trace_streams() as trace:
        mesh = init_device_mesh("meta", (4, 1), mesh_dim_names=("replicate", "shard"))
        model = sharded_net(mesh=mesh)
        backward(model)
        backward(model)  # the gradients of the first are kept: set aside, added after
        with model.no_sync():
            backward(model)
        backward(model)
    assert trace.violations() == []
    assert any(e[0] == "use" and e[1].endswith(":reduce-out") and e[2] == "compute" for e in trace.log)


def test_hybrid_all_reduce_runs_on_its_own_stream():
    """Point 12: with replicas, each unit's all-reduce (and the division and accumulation after
    it) runs on an all-reduce stream that waited for the reduce-scatter; the reduce stream never
    waits for it inside a backward, so the next units' reduce-scatters do not queue behind it;
    compute waits for it at the end of backward. Gradients accumulate over a second backward."""
    from torch.distributed.device_mesh import init_device_mesh

    with meta_accelerator(4, rank=2), trace_streams() as trace:
        mesh = init_device_mesh("meta", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = sharded_net(mesh=mesh)
        backward(model)
        backward(model)
        names = [u.name for u in sharded_units(model)]
    assert trace.violations() == []
    log = trace.log
    on_all_reduce = {e[2] for e in log if e[0] == "record" and e[1] == "all_reduce"}
    for name in names:
        assert ("use", f"{name}:reduce-out", "all_reduce") in log, name
        assert ("use", f"{name}:grad-shards", "all_reduce") in log, name  # the second backward adds
    # the reduce stream waits for the all-reduce stream only after a backward's last reduce-scatter,
    # before the outputs the second backward added into existing shards are freed
    waits = [i for i, e in enumerate(log) if e[0] == "wait" and e[1] in ("reduce", "gather") and e[2] in on_all_reduce]
    assert [log[i][1] for i in waits] == ["reduce"], waits
    assert not any(e[0] == "use" and e[2] == "reduce" for e in log[waits[0] :])
    assert sorted(e[1] for e in log[waits[0] :] if e[0] == "free") == sorted(f"{n}:reduce-out" for n in names)
    assert sum(e[0] == "wait" and e[1] == "compute" and e[2] in on_all_reduce for e in log) == 2  # per backward


def test_a_partial_reshards_kept_piece_is_sent_and_freed_in_order():
    """reshard_after_forward=2 over 4 ranks: the piece a unit keeps after forward (its rows of
    the gathered buffer, copied on compute) is what backward's all-gather sends on the gather
    stream; it is freed on compute only after compute waited for that all-gather."""
    with meta_accelerator(4, rank=1), trace_streams() as trace:
        model = sharded_net(reshard_after_forward=2)
        backward(model)
        backward(model)
        names = [u.name for u in sharded_units(model)][1:]  # the root keeps no piece
    assert trace.violations() == []
    for name in names:
        kinds = [(e[0], e[2]) for e in trace.log if e[1] == f"{name}:piece"]
        assert kinds == [("alloc", "compute"), ("use", "gather"), ("free", "compute")] * 2, (name, kinds)


def test_the_checker_finds_an_unordered_read_of_the_reduce_output():
    """The accumulation race as the old code traced it: compute waited only for the copy-in's
    event, recorded before the reduce-scatter wrote the output."""
    trace = Trace()
    trace.log = [
        ("alloc", "u:full-grads", "compute"),
        ("record", "compute", 0),
        ("wait", "reduce", 0),
        ("use", "u:full-grads", "reduce"),
        ("record", "reduce", 1),  # `copied`
        ("alloc", "u:reduce-out", "reduce"),
        ("use", "u:reduce-out", "reduce"),  # the reduce-scatter and division write it
        ("record", "reduce", 2),  # the post-reduce event, dropped by the old code
        ("wait", "compute", 1),
        ("free", "u:full-grads", "compute"),
        ("use", "u:reduce-out", "compute"),  # _foreach_add_ into the old gradients
    ]
    bad = trace.violations()
    assert bad and all(b.startswith("u:reduce-out used on compute at 10") for b in bad)
    trace.log.insert(-1, ("wait", "compute", 2))
    assert trace.violations() == []


def test_sharding_and_activation_offload_trace_into_one_log():
    """One trace mechanism: a sharded model (a gloo group of one) whose blocks offload their
    saved activations to the host records both kinds of buffers into one log, which one
    checker checks; gradients accumulate over two backwards."""
    import torch.distributed as dist

    from memfit.testing import host_offload_on_cpu

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with trace_streams() as trace, host_offload_on_cpu() as same:
            assert same is trace
            torch.manual_seed(0)
            model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(3)])
            blocks = list(model)
            memfit.apply_activation_checkpointing(model, lambda m: m in blocks, save="all", offload="cpu")
            for block in model:
                memfit.shard(block)
            memfit.shard(model)
            for _ in range(2):
                model(torch.randn(8, 64)).square().sum().backward()
    finally:
        dist.destroy_process_group()
    names = {e[1] for e in trace.log if e[0] in ("alloc", "use", "free")}
    assert any(n.startswith("host#") for n in names) and any(n.endswith(":reduce-out") for n in names)
    assert trace.violations() == []


def _alive(log, suffix):
    """Buffers named ``*suffix`` the trace allocated and has not freed."""
    return Trace(log).alive(lambda name: name.endswith(suffix))[1]


def test_buffers_are_freed_as_early_as_fsdp2_frees_them():
    """Point 11: a unit's full gradients are copied into the send buffer on compute and freed
    there at once (a copy-in on the reduce stream held them until the next unit's post-backward:
    two units' full gradients at once); the send buffer goes when compute has waited for the
    reduce-scatter; in backward an all-gather output goes right after its copy-out, and the one
    forward holds for the next all-gather goes when the root's forward ends."""
    with meta_accelerator(2), trace_streams() as trace:
        model = sharded_net()
        loss = model(torch.randn(3, 4, device=META)).sum()
        assert _alive(trace.log, ":gather-out") == set()  # the root's forward ended
        forward_end = len(trace.log)
        loss.backward()
    log = trace.log
    assert trace.violations() == []
    for suffix in (":gather-out", ":full-grads", ":send"):
        assert _alive(log, suffix) == set(), suffix
    names = [u.name for u in sharded_units(model)]
    for name in names:  # nothing of another unit happens while its full gradients are alive
        start = log.index(("alloc", f"{name}:full-grads", "compute"))
        end = log.index(("free", f"{name}:full-grads", "compute"))
        between = {e[1].split(":")[0] for e in log[start:end] if e[0] != "record" and e[0] != "wait"}
        assert between == {name}, (name, between)
    copy_outs = [i for i, e in enumerate(log) if i > forward_end and e[0] == "use" and e[1].endswith(":gather-out")]
    assert copy_outs  # (the units gathered again in backward)
    for i in copy_outs:  # the next buffer event frees it, after the gather stream waited
        after = [e for e in log[i + 1 :] if e[0] not in ("record", "wait")]
        assert after[0] == ("free", log[i][1], "gather"), after[:2]


def test_offloaded_shards_free_the_reduce_output_once_copied_to_the_host():
    """Shards in host memory take a copy of the reduce output: it is freed on the reduce stream
    after the copy is queued, each backward (See [Note: Releasing the reduce output])."""
    with meta_accelerator(2), trace_streams() as trace:
        model = sharded_net(offload="cpu")
        backward(model)
        backward(model)
    assert trace.violations() == []
    frees = [e for e in trace.log if e[0] == "free" and e[1].endswith(":reduce-out")]
    assert len(frees) == 2 * 3 and {e[2] for e in frees} == {"reduce"}, frees


class FakeCuda:
    """torch.cuda's stream and event calls, recording which stream each record and wait used."""

    class Stream:
        def __init__(self, device=None, priority=0, name="side"):
            self.name, self.log = name, []

        @staticmethod
        def priority_range():
            return (0, -1)

        def wait_event(self, event):
            self.log.append(("wait", event))

    class Event:
        def record(self, stream):
            stream.log.append(("record", self))

    def __init__(self):
        self.current = self.Stream(name="default")

    def current_stream(self, device=None):
        return self.current

    @contextlib.contextmanager
    def stream(self, s):
        saved, self.current = self.current, s
        try:
            yield
        finally:
            self.current = saved


def test_the_compute_stream_is_the_one_current_at_each_use():
    """Issue 48 bug 3: a step run under another stream than the root's first (a second model's
    stream, a capture stream) has the side streams wait for that stream, not the one current
    when the root was set up; inside a side stream "compute" is the stream current at entry."""
    from memfit._shard._streams import Streams

    cuda = FakeCuda()
    streams = Streams(torch.device("cuda"), api=cuda)
    first, other = cuda.current, cuda.Stream(name="other")
    streams.after("gather", "compute")
    with cuda.stream(other):
        streams.after("gather", "compute")  # the step runs on `other`
        with streams.on("reduce"):
            streams.wait("compute", streams.record("reduce"))  # compute, from inside the reduce stream
    assert [k for k, _ in first.log] == ["record"]
    assert [k for k, _ in other.log] == ["record", "wait"]
