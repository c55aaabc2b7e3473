"""Sharding's pure logic: a parameter's row layout ([Note: Sharded parameter layout]) without a
process group, and the errors raised before any communication."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import memfit
from memfit._shard._param import ShardedParam
from tests._parity import my_rows


def layout(p, world):
    """One ShardedParam per rank of ``world`` (no process group: rank and world are given)."""
    return [ShardedParam(p, [], "p", rank, world) for rank in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(5,), (13, 6), (7, 13), (6, 2), (3, 4), (1, 4), ()], ids=str)
def test_chunks_are_torch_chunk_and_cover_the_parameter(shape, world):
    p = nn.Parameter(torch.randn(shape))
    shards = layout(p, world)
    for rank, sp in enumerate(shards):
        want = my_rows(p.detach(), rank, world)
        assert sp.sharded.shape == want.shape, (rank, sp.sharded.shape, want.shape)
        assert torch.equal(sp.sharded.detach(), want)
        assert sp.local_rows == sp.rows_of(rank) == (want.shape[0] if want.dim() else 1)
        assert sp.local_numel == want.numel()
    # The chunks laid end to end, in rank order, are the parameter.
    assert torch.equal(torch.cat([sp.sharded.detach().reshape(-1) for sp in shards]), p.detach().reshape(-1))


@pytest.mark.parametrize(
    ("rows", "world", "per_rank"),
    [
        # ceil(13 / 4) = 4 rows per slot: ranks 0-2 hold 4 each, rank 3 the remaining 13 - 3 * 4.
        (13, 4, [4, 4, 4, 13 - 3 * 4]),
        # ceil(5 / 4) = 2: ranks 0 and 1 hold 2, rank 2 the remaining 5 - 2 * 2, rank 3 nothing
        # (torch.chunk(5 rows, 4) makes only 3 chunks).
        (5, 4, [2, 2, 5 - 2 * 2, 0]),
        # ceil(6 / 4) = 2: three full slots hold all 6 rows; rank 3 is empty although 6 >= 4.
        (6, 4, [2, 2, 2, 0]),
        # Fewer rows than ranks: one row each, then empty chunks.
        (3, 4, [1, 1, 1, 0]),
        # ceil(7 / 2) = 4: rank 1 holds 7 - 4.
        (7, 2, [4, 7 - 4]),
    ],
)
def test_uneven_and_empty_chunks(rows, world, per_rank):
    p = nn.Parameter(torch.randn(rows, 6))
    shards = layout(p, world)
    assert [sp.local_rows for sp in shards] == per_rank
    assert [tuple(sp.sharded.shape) for sp in shards] == [(n, 6) for n in per_rank]  # empty is (0, 6)
    assert all(isinstance(sp.sharded, nn.Parameter) for sp in shards)


def test_zero_dim_parameter_is_one_row():
    p = nn.Parameter(torch.tensor(1.5))
    first, second = layout(p, 2)
    assert (first.rows, first.row_numel, first.chunk_rows) == (1, 1, 1)
    assert first.sharded.shape == (1,) and first.sharded.item() == 1.5  # rank 0 holds the one row
    assert second.sharded.shape == (0,)  # rank 1 an empty chunk
    assert first.full.shape == ()  # the full parameter keeps its 0-dim shape


def test_slots_are_padded_to_equal_rows():
    rows, cols, world = 7, 13, 2
    p = nn.Parameter(torch.arange(rows * cols, dtype=torch.float32).view(rows, cols))
    shards = layout(p, world)
    chunk_rows = -(-rows // world)  # ceil(7 / 2) = 4 rows in every rank's slot
    assert all(sp.chunk_rows == chunk_rows for sp in shards)
    assert all(sp.slot_numel == chunk_rows * cols for sp in shards)  # 4 rows x 13 columns = 52
    padding = world * chunk_rows * cols - rows * cols  # 2 slots x 52 - 91 = 13: one row, on rank 1
    assert padding == (chunk_rows - shards[1].local_rows) * cols
    # What an all-gather produces: W slots, rank-major, each its chunk then padding (NaN here,
    # so that reading it would show); the full parameter is rows [0, 7) of the slots end to end.
    flat = torch.full((world * shards[0].slot_numel,), float("nan"))
    for rank, sp in enumerate(shards):
        start = rank * sp.slot_numel
        flat[start : start + sp.local_numel] = sp.sharded.detach().reshape(-1)
    assert torch.equal(flat.view(world * chunk_rows, cols)[:rows], p.detach())


def test_keep_rows_copies_this_ranks_rows_of_a_full_tensor():
    p = nn.Parameter(torch.randn(10, 3))
    new = torch.randn(10, 3)
    for rank, sp in enumerate(layout(p, 4)):  # ceil(10 / 4) = 3 rows: 3, 3, 3, 1
        sp.keep_rows(new, rank)
        assert torch.equal(sp.sharded.detach(), my_rows(new, rank, 4))


def test_full_tensor_is_allocated_only_while_gathered():
    rows, cols = 5, 4
    sp = ShardedParam(nn.Parameter(torch.randn(rows, cols)), [], "p", 0, 2)
    assert sp.full.untyped_storage().nbytes() == 0  # sharded: no storage
    view = sp.alloc_full()
    assert view.shape == (rows, cols)  # (rows, row_numel)
    assert sp.full.untyped_storage().nbytes() == 2 * 3 * cols * 4  # fp32, W slots of c = 3 rows (padding)
    sp.free_full()
    assert sp.full.untyped_storage().nbytes() == 0

    mixed = ShardedParam(nn.Parameter(torch.randn(rows, cols)), [], "p", 0, 2, compute_dtype=torch.bfloat16)
    mixed.alloc_full()
    assert mixed.full.dtype == torch.bfloat16 and mixed.sharded.dtype == torch.float32  # fp32 master shard
    assert mixed.full.untyped_storage().nbytes() == 2 * 3 * cols * 2  # bf16, padded


def test_meta_parameter_gets_an_unfilled_local_chunk():
    with torch.device("meta"):
        p = nn.Parameter(torch.empty(7, 13))
    sp = ShardedParam(p, [], "p", 1, 2)
    assert sp.deferred
    assert sp.sharded.device.type == "cpu" and sp.sharded.shape == (7 - 4, 13)  # rank 1 of ceil(7 / 2) = 4


def test_registered_under_every_use_with_its_requires_grad():
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight  # tied
    a.bias.requires_grad_(False)
    sp = ShardedParam(a.weight, [(a, "weight"), (b, "weight")], "a.weight", 0, 2)
    assert a.weight is b.weight is sp.sharded
    assert a.weight.shape == (2, 4) and a.weight.requires_grad
    frozen = ShardedParam(a.bias, [(a, "bias")], "a.bias", 1, 2)
    assert a.bias is frozen.sharded and not a.bias.requires_grad


def test_shard_without_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"no process group.*init_process_group"):
        memfit.shard(nn.Linear(2, 2))
