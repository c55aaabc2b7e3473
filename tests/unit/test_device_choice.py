"""`--device` of `memfit train` and `memfit bench`: which device, backend and local rank a
process gets (availability injected, so the CUDA cases run on the CPU), and the errors."""

import pytest
import torch

from memfit.cli import BenchConfig, TrainConfig, main, parse_config
from memfit.cli._launch import choose_device


@pytest.mark.parametrize(
    ("requested", "env", "gpus", "want"),
    [
        ("auto", {}, 0, ("cpu", "gloo", 0)),
        ("auto", {"LOCAL_RANK": "1"}, 0, ("cpu", "gloo", 1)),
        ("auto", {}, 1, ("cuda:0", "nccl", 0)),
        ("auto", {"LOCAL_RANK": "3"}, 8, ("cuda:3", "nccl", 3)),
        ("cuda", {"LOCAL_RANK": "1"}, 2, ("cuda:1", "nccl", 1)),
        ("cpu", {"LOCAL_RANK": "1"}, 8, ("cpu", "gloo", 1)),
        ("cuda", {"LOCAL_RANK": "3"}, 1, ("cuda:0", "nccl", 3)),  # one visible GPU per task
    ],
)
def test_device_backend_and_local_rank(requested, env, gpus, want):
    p = choose_device(requested, env=env, cuda_devices=gpus)
    assert (str(p.device), p.backend, p.local_rank) == want


def test_cuda_without_a_gpu_or_for_a_rank_without_one():
    with pytest.raises(ValueError, match=r"memfit train: --device cuda, but .* sees no CUDA device; pass --device cpu"):
        choose_device("cuda", env={}, cuda_devices=0, where="memfit train")
    with pytest.raises(ValueError, match=r"--device auto: local rank 2 has no GPU \(2 CUDA device\(s\) here\)"):
        choose_device("auto", env={"LOCAL_RANK": "2"}, cuda_devices=2)
    with pytest.raises(ValueError, match=r"unknown --device 'tpu'; choose from auto, cpu, cuda"):
        choose_device("tpu", env={}, cuda_devices=0)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("command", ["train", "bench"])
def test_device_cuda_without_cuda_is_a_clear_error(no_cuda, command, capsys):
    assert main([command, "--device", "cuda", "--layers", "1"]) == 2
    err = capsys.readouterr().err
    assert f"memfit {command}: --device cuda" in err and "pass --device cpu" in err


def test_device_flag_and_defaults(no_cuda):
    assert parse_config(["train"]).device == "auto"
    assert parse_config(["train", "--device", "cpu"]).device == "cpu"
    assert parse_config(["bench", "--device", "cpu"]).device == "cpu"
    with pytest.raises(ValueError, match="unknown --device 'gpu'"):
        TrainConfig(device="gpu")
    with pytest.raises(ValueError, match="unknown --device 'gpu'"):
        BenchConfig(device="gpu")
    with pytest.raises(SystemExit):
        parse_config(["train", "--device", "gpu"])


@pytest.mark.parametrize("requested", ["auto", "cpu", "cuda"])
@pytest.mark.parametrize("raw", ["x", "", "-1", "1.0"])
def test_bad_local_rank_is_named(requested, raw):
    # not int()'s bare "invalid literal", nor torch's "Device index must not be negative"
    with pytest.raises(ValueError, match=rf"memfit train: LOCAL_RANK={raw!r} is not a rank"):
        choose_device(requested, env={"LOCAL_RANK": raw}, cuda_devices=2, where="memfit train")


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


@pytest.mark.parametrize("requested", ["cuda", "auto"])
def test_spawning_more_ranks_than_gpus_is_refused_before_any_starts(one_gpu, requested, monkeypatch):
    """With one visible GPU every spawned rank would take cuda:0 and NCCL would fail ("Duplicate
    GPU detected"): spawn and `memfit bench --world-size 2` refuse at once, naming the count."""
    import torch.multiprocessing as mp

    from memfit.testing import spawn

    def started(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(mp, "start_processes", started)
    want = rf"--device {requested}: 2 ranks on this machine but torch sees 1 CUDA device\(s\).*--device cpu"
    with pytest.raises(ValueError, match=want):
        spawn(print, 2, device=requested)
    with pytest.raises(ValueError, match="memfit bench: " + want):
        BenchConfig(world_size=2, device=requested)
    assert choose_device(requested, env={}, spawned=1).device == torch.device("cuda", 0)
    assert choose_device("cpu", env={}, spawned=2).device == torch.device("cpu")
