"""The disk tier at one rank (a gloo group of one, in this process): the cases of
tests/_disk_tier.py; and the read-ahead depth from the disk's measured bandwidth (pure). Two
ranks: tests/distributed/test_disk_tier.py (See [Note: The disk tier]).

Not tested here: the read-ahead's effect on a step's time (benchmarks/disk_tier_train.py)."""

import pytest

from memfit._tiers import measured_bandwidth, read_ahead
from memfit._tiers._disk import MAX_READ_AHEAD, READ_AHEAD_BYTES, READ_AHEAD_S
from tests._disk_tier import CASES
from tests._dist import case_id


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.filterwarnings("ignore:memfit.host_optimizer")
def test_one_rank(one_rank, tmp_path, case):
    case(0, 1, str(tmp_path))


def test_read_ahead_keeps_a_fixed_time_of_the_disk_in_flight_within_the_bound():
    assert read_ahead(1e9, 10**9) == 1  # a unit longer than the window: the next one only
    assert read_ahead(2e9, 20 * 10**6) == -(-int(2e9 * READ_AHEAD_S) // (20 * 10**6)) == 5
    assert read_ahead(4e9, 10**6) == MAX_READ_AHEAD  # tiny units: capped in units
    assert read_ahead(1e12, READ_AHEAD_BYTES // 2) == 2  # a fast disk: capped in bytes
    assert read_ahead(1e12, 2 * READ_AHEAD_BYTES) == 1  # (never none)
    assert read_ahead(1e9, 0) == MAX_READ_AHEAD


def test_the_bandwidth_is_measured_once_per_directory_and_sizes_the_tier(one_rank, tmp_path):
    import torch
    from torch import nn

    import memfit

    measured_bandwidth.cache_clear()
    read, write = measured_bandwidth(str(tmp_path))
    assert read > 0 and write > 0
    assert measured_bandwidth(str(tmp_path)) == (read, write) and measured_bandwidth.cache_info().hits == 1
    model = memfit.FullyShardedDataParallel(
        nn.Sequential(*[nn.Sequential(nn.Linear(64, 64)) for _ in range(3)]), auto_wrap_policy=nn.Sequential
    )
    with pytest.warns(UserWarning, match="memfit.host_optimizer"):
        opt = memfit.host_optimizer(model, torch.optim.AdamW(model.parameters()), disk=str(tmp_path))
    tier = opt._memfit_host_step.disk
    assert measured_bandwidth.cache_info().hits == 2  # not measured again
    biggest = max(sum(p.numel() * p.element_size() for p in tier.params[u]) for u in tier.units)
    assert tier.bandwidth == (read, write) and tier.depth == read_ahead(read, biggest)
    opt._memfit_host_step.close()
