"""ShardGrad, the gradient type that makes torch's clip_grad_norm_ match FSDP2 (See [Note:
Sharded gradients and torch's clip_grad_norm_]), at one gloo rank in this process: pickling
and copying, _foreach_norm over mixed lists, norms of empty shards. The norms' values across
ranks are checked at two ranks in tests/distributed/test_fully_shard.py."""

import copy
import io
import math

import pytest
import torch
import torch.distributed as dist

from memfit._shard._grad import PartialNorm, ShardGrad


def shard_grad(values) -> torch.Tensor:
    g = torch.as_tensor(values, dtype=torch.float32).as_subclass(ShardGrad)
    g._memfit_spec = (dist.group.WORLD, torch.device("cpu"))
    return g


def test_torch_save_writes_the_rows_and_deepcopy_keeps_the_type(one_rank):
    out = torch.zeros(8)
    g = out[2:5].as_subclass(ShardGrad)
    g._memfit_spec = (dist.group.WORLD, torch.device("cpu"))
    g.copy_(torch.tensor([1.0, 2.0, 3.0]))
    buf = io.BytesIO()
    torch.save(g, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()))
    assert type(loaded) is torch.Tensor and torch.equal(loaded, torch.tensor([1.0, 2.0, 3.0]))
    assert loaded.untyped_storage().nbytes() == 12  # the rows, not the reduce output they view
    twin = copy.deepcopy(g)
    assert type(twin) is ShardGrad and twin._memfit_spec == g._memfit_spec
    assert torch.equal(twin, g) and twin.data_ptr() != g.data_ptr()


def test_foreach_norm_of_a_mixed_list_is_partial_for_the_shards(one_rank):
    sg, plain = shard_grad([3.0, 4.0]), torch.tensor([1.0, 2.0, 2.0])
    norms = torch._foreach_norm([sg, plain], 2.0)
    assert type(norms[0]) is PartialNorm and type(norms[1]) is torch.Tensor
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    assert float(total) == pytest.approx(math.sqrt(25 + 9))


@pytest.mark.parametrize("order", [math.inf, -math.inf, 2.0, 0.0])
def test_an_empty_shard_takes_the_same_path_into_the_reduction(one_rank, order):
    """A rank whose shard is empty raised on the inf-norm (torch refuses it on an empty tensor)
    while the others waited in the reduction; now it answers the reduction's identity."""
    empty, full = shard_grad([]), shard_grad([-3.0, 4.0])
    for norm in (torch.linalg.vector_norm(empty, order), torch._foreach_norm([empty, full], order)[0]):
        assert type(norm) is PartialNorm
        assert float(norm) == (math.inf if order == -math.inf else 0.0)
    assert float(torch._foreach_norm([empty, full], order)[1]) == float(torch.linalg.vector_norm(full.detach(), order))
