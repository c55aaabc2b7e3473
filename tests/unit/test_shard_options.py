"""memfit.ShardOptions: every sharding option declared once; its validation, the keyword
spellings that become it (ShardOptions.from_kwargs), and the integrations that pass their
keyword arguments through to it (no process group: the sharding call is recorded instead)."""

import dataclasses

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import CPUOffload, MixedPrecisionPolicy, ShardingStrategy

import memfit
from memfit import MixedPrecision, ShardOptions
from memfit._shard._options import FIELDS, KEYWORDS, split_kwargs


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"offload": "disk"}, ValueError, r"offload must be None or 'cpu', got 'disk'"),
        ({"reshard_after_forward": 0}, ValueError, r"reshard_after_forward must be True, False or an int k >= 1"),
        ({"reshard_after_forward": "yes"}, ValueError, r"reshard_after_forward must be True, False or an int"),
        ({"device": "gpu9"}, ValueError, r"device='gpu9' is not a device"),
        ({"mixed_precision": "bf16"}, TypeError, r"mixed_precision must be a memfit.MixedPrecision"),
        ({"auto_wrap_policy": True}, TypeError, r"auto_wrap_policy must not be a bool"),
        ({"auto_wrap_policy": -1}, ValueError, r"auto_wrap_policy=-1; an int is a minimum parameter count"),
        ({"auto_wrap_policy": "Block"}, TypeError, r"auto_wrap_policy must be a module class"),
        ({"auto_wrap_policy": {"Block"}}, TypeError, r"auto_wrap_policy must be a module class"),
        ({"sync_module_states": 1}, TypeError, r"sync_module_states must be True or False"),
        ({"mesh": "2x4"}, TypeError, r"mesh must be a torch.distributed.device_mesh.DeviceMesh"),
    ],
    ids=lambda x: str(x)[:40],
)
def test_validation_errors_say_what_to_pass(kwargs, error, message):
    with pytest.raises(error, match=r"^memfit.ShardOptions: " + message):
        ShardOptions(**kwargs)
    with pytest.raises(error, match=message):  # the keyword spelling is checked the same way
        ShardOptions.from_kwargs(**kwargs)


def test_a_pair_of_groups_is_hybrid_sharding():
    with pytest.raises(ValueError, match=r"group= takes one process group; .* pass mesh=<2-D mesh>"):
        ShardOptions(group=(None, None))
    with pytest.raises(ValueError, match="a pair of process groups needs sharding_strategy=HYBRID_SHARD"):
        ShardOptions.from_kwargs(process_group=(None, None))


def test_frozen_and_normalised():
    opts = ShardOptions(device="cpu", mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    assert opts.device == torch.device("cpu")
    assert opts.mixed_precision == MixedPrecision(param_dtype=torch.bfloat16)
    assert ShardOptions(mixed_precision=True).mixed_precision == MixedPrecision(param_dtype=torch.float16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.offload = "cpu"
    for ok in (None, nn.Linear, {nn.Linear}, (nn.Linear, nn.ReLU), 1000, lambda m: True):
        assert ShardOptions(auto_wrap_policy=ok).auto_wrap_policy is ok


def test_keywords_are_the_fields():
    """from_kwargs reads exactly the fields: a new field is a new keyword everywhere."""
    assert set(FIELDS) == {f.name for f in dataclasses.fields(ShardOptions)}
    for name in FIELDS:
        assert name in ShardOptions.__doc__, f"ShardOptions' docstring does not document {name}"
    assert ShardOptions.from_kwargs() == ShardOptions()
    with pytest.raises(TypeError, match=r"unknown sharding option\(s\) \['reshard'\]; the options are"):
        ShardOptions.from_kwargs(reshard=False)
    with pytest.raises(TypeError, match=r"options must be a memfit\.ShardOptions, got dict"):
        ShardOptions.from_kwargs({"offload": "cpu"})


def test_keywords_replace_the_options_fields():
    base = ShardOptions(reshard_after_forward=False, offload="cpu")
    assert ShardOptions.from_kwargs(base) == base
    assert ShardOptions.from_kwargs(base, offload=None) == ShardOptions(reshard_after_forward=False)
    assert ShardOptions.from_kwargs(base, sync_module_states=False) == dataclasses.replace(
        base, sync_module_states=False
    )


@pytest.mark.parametrize(
    ("spelt", "native"),
    [
        ({"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}, {"reshard_after_forward": False}),
        ({"sharding_strategy": "NO_SHARD"}, {"reshard_after_forward": False}),
        ({"sharding_strategy": "FULL_SHARD", "reshard_after_forward": 2}, {"reshard_after_forward": 2}),
        ({"cpu_offload": CPUOffload(offload_params=True)}, {"offload": "cpu"}),
        ({"cpu_offload": CPUOffload(offload_params=False)}, {}),
        ({"move_params_to_cpu": True}, {"offload": "cpu"}),
        ({"device_id": torch.device("cpu")}, {"device": "cpu"}),
        ({"mixed_precision": True, "flatten_parameters": True}, {"mixed_precision": MixedPrecision(torch.float16)}),
        ({"use_orig_params": False}, {}),
    ],
    ids=lambda x: str(x)[:50],
)
def test_torch_and_fairscale_spellings_are_the_same_options(spelt, native):
    assert ShardOptions.from_kwargs(**spelt) == ShardOptions(**native)


def test_conflicting_spellings_are_refused():
    with pytest.raises(ValueError, match="sharding_strategy=SHARD_GRAD_OP means reshard_after_forward=False"):
        ShardOptions.from_kwargs(sharding_strategy="SHARD_GRAD_OP", reshard_after_forward=True)
    with pytest.raises(ValueError, match="device=cpu and device_id=meta differ; pass one"):
        ShardOptions.from_kwargs(device="cpu", device_id=torch.device("meta"))
    with pytest.raises(ValueError, match="cpu offload asked for, but offload='gpu'"):
        ShardOptions.from_kwargs(offload="gpu", move_params_to_cpu=True)


def test_split_kwargs_takes_the_sharding_options_only():
    mine, rest = split_kwargs({"offload": "cpu", "sharding_strategy": "FULL_SHARD", "timeout": 5, "callbacks": []})
    assert mine == {"offload": "cpu", "sharding_strategy": "FULL_SHARD"}
    assert rest == {"timeout": 5, "callbacks": []}
    assert set(mine) <= KEYWORDS


# -- the entry points: options= and the keywords give the same configuration --------------------

SAME = [
    (ShardOptions(reshard_after_forward=False, offload="cpu"), {"reshard_after_forward": False, "offload": "cpu"}),
    (ShardOptions(mixed_precision=MixedPrecision(torch.bfloat16)), {"mixed_precision": MixedPrecision(torch.bfloat16)}),
    (ShardOptions(auto_wrap_policy={nn.Linear}, device="cpu"), {"auto_wrap_policy": {nn.Linear}, "device": "cpu"}),
    (ShardOptions(reshard_after_forward=False), {"sharding_strategy": "SHARD_GRAD_OP"}),  # torch's spelling
]


class _RecordedError(Exception):
    pass


@pytest.fixture
def recorded(monkeypatch):
    """memfit.FullyShardedDataParallel replaced by a recorder of the options it is given."""
    calls = []

    def fake(module, *, options=None, **kwargs):
        calls.append(ShardOptions.from_kwargs(options, **kwargs))
        raise _RecordedError

    monkeypatch.setattr(memfit, "FullyShardedDataParallel", fake)
    return calls


@pytest.mark.parametrize(("options", "kwargs"), SAME, ids=lambda x: str(x)[:40])
def test_lightning_strategy_passes_options_and_keywords_through(recorded, options, kwargs):
    pytest.importorskip("lightning")
    from memfit.integrations.lightning import MemfitStrategy

    for strategy in (MemfitStrategy(options=options), MemfitStrategy(**kwargs, timeout=None)):
        with pytest.raises(_RecordedError):
            strategy._setup_model(nn.Linear(2, 2))
    assert recorded[0] == recorded[1] == options


def test_lightning_strategy_checks_the_options_when_built():
    pytest.importorskip("lightning")
    from memfit.integrations.lightning import MemfitStrategy

    with pytest.raises(ValueError, match="offload must be None or 'cpu'"):
        MemfitStrategy(offload="disk")


@pytest.mark.parametrize(("options", "kwargs"), SAME, ids=lambda x: str(x)[:40])
def test_hf_entry_points_pass_options_and_keywords_through(recorded, monkeypatch, options, kwargs):
    pytest.importorskip("transformers")
    import torch.distributed as dist

    from memfit.integrations import transformers as hf

    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # the recorder shards nothing
    for call in (
        lambda: hf.shard_pretrained_model(nn.Linear(2, 2), options=options),
        lambda: hf.shard_pretrained_model(nn.Linear(2, 2), **kwargs),
        lambda: hf.MemfitTrainer(nn.Linear(2, 2), options=options),
        lambda: hf.MemfitTrainer(nn.Linear(2, 2), **kwargs),
    ):
        with pytest.raises(_RecordedError):
            call()
    # shard_pretrained_model names the blocks when no auto_wrap_policy is given (a Linear has none)
    assert recorded[0] == recorded[1] == recorded[2] == recorded[3] == options


def test_shard_pretrained_model_takes_reshard_after_forward(recorded, monkeypatch):
    """It lacked it once (the options drifted apart); now every option reaches the sharding."""
    pytest.importorskip("transformers")
    import torch.distributed as dist

    from memfit.integrations.transformers import shard_pretrained_model

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    for name in FIELDS:  # each field's default, passed by name, is accepted
        with pytest.raises(_RecordedError):
            shard_pretrained_model(nn.Linear(2, 2), **{name: getattr(ShardOptions(), name)})
    with pytest.raises(_RecordedError):
        shard_pretrained_model(nn.Linear(2, 2), reshard_after_forward=False)
    assert recorded[-1].reshard_after_forward is False


def test_shard_refuses_a_wrap_policy_and_unknown_keywords():
    with pytest.raises(ValueError, match=r"memfit\.shard: shards one module and takes no auto_wrap_policy"):
        memfit.shard(nn.Linear(2, 2), auto_wrap_policy=nn.Linear)
    with pytest.raises(TypeError, match=r"unknown sharding option\(s\) \['reshard'\]"):
        memfit.shard(nn.Linear(2, 2), reshard=False)
    with pytest.raises(TypeError, match=r"unknown sharding option\(s\) \['reshard'\]"):
        memfit.FullyShardedDataParallel(nn.Linear(2, 2), reshard=False)


# -- torch FSDP1's constructor arguments ---------------------------------------------------------


def test_every_fsdp1_constructor_argument_is_a_keyword():
    """A script written for torch FSDP1 passes any of its constructor's arguments: each is a
    sharding option (mapped, validated, or documented as moot), none is an unknown keyword."""
    import inspect

    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    names = set(inspect.signature(TorchFSDP.__init__).parameters) - {"self", "module"}
    assert names <= KEYWORDS, sorted(names - KEYWORDS)
    defaults = {
        n: p.default for n, p in inspect.signature(TorchFSDP.__init__).parameters.items() if n in names
    }  # FSDP1's own defaults are accepted as they are, except sync_module_states (memfit keeps True)
    assert ShardOptions.from_kwargs(**defaults) == ShardOptions(sync_module_states=False)


def test_prefetch_and_rate_limit_are_accepted_and_checked(monkeypatch):
    from torch.distributed.fsdp import BackwardPrefetch

    from memfit._shard import _compat

    moot = {"backward_prefetch": BackwardPrefetch.BACKWARD_PRE, "forward_prefetch": True, "limit_all_gathers": False}
    assert ShardOptions.from_kwargs(**moot, use_orig_params=True) == ShardOptions()
    with pytest.raises(TypeError, match="forward_prefetch must be True or False, got 'yes'"):
        ShardOptions.from_kwargs(forward_prefetch="yes")
    with pytest.raises(TypeError, match="limit_all_gathers must be True or False"):
        ShardOptions.from_kwargs(limit_all_gathers=None)
    with pytest.raises(ValueError, match="unknown backward_prefetch 'SOON'"):
        ShardOptions.from_kwargs(backward_prefetch="SOON")
    monkeypatch.setattr(_compat, "_WARNED", set())
    for value in (None, BackwardPrefetch.BACKWARD_POST):
        name = getattr(value, "name", "None")
        with pytest.warns(UserWarning, match=f"backward_prefetch={name} is not available; memfit prefetches as"):
            assert ShardOptions.from_kwargs(backward_prefetch=value) == ShardOptions()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: no second warning
        ShardOptions.from_kwargs(backward_prefetch=None)


def test_fsdp1_mixed_precision_keep_low_precision_grads_warns(monkeypatch):
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision

    from memfit._shard import _compat

    monkeypatch.setattr(_compat, "_WARNED", set())
    spec = TorchMixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True)
    with pytest.warns(UserWarning, match=r"keep_low_precision_grads=True\) is not available"):
        opts = ShardOptions.from_kwargs(mixed_precision=spec)
    assert opts.mixed_precision == MixedPrecision(torch.bfloat16)


def test_ignored_modules_and_states_become_ignored_params():
    seq, extra = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2))), nn.Parameter(torch.zeros(3))
    assert ShardOptions.from_kwargs(ignored_modules=[seq[1]]).ignored_params == frozenset(seq[1].parameters())
    both = ShardOptions.from_kwargs(ignored_states=[extra, seq[0]], ignored_params={seq[1][0].bias})
    assert both.ignored_params == frozenset([extra, seq[1][0].bias, *seq[0].parameters()])
    for name in ("ignored_modules", "ignored_states"):
        assert ShardOptions.from_kwargs(**{name: None}) == ShardOptions.from_kwargs(**{name: []}) == ShardOptions()
        with pytest.raises(TypeError, match=f"{name}= takes a list"):
            ShardOptions.from_kwargs(**{name: seq})
    with pytest.raises(TypeError, match="ignored_modules= holds a Parameter; it takes modules"):
        ShardOptions.from_kwargs(ignored_modules=[extra])


def test_param_init_fn_is_a_field():
    def init(m):
        pass

    assert ShardOptions.from_kwargs(param_init_fn=init) == ShardOptions(param_init_fn=init)
    with pytest.raises(TypeError, match=r"^memfit.ShardOptions: param_init_fn must be a callable\(module\)"):
        ShardOptions(param_init_fn="reset")


def test_the_hf_trainer_ends_the_process_group_at_exit(monkeypatch, tmp_path):
    """A Trainer script ends with the group alive: MemfitTrainer has it ended by an exit handler
    while the interpreter lives (see [Note: Ending a process group]), registered once."""
    pytest.importorskip("transformers")
    import torch.distributed as dist
    from transformers import TrainingArguments

    from memfit.cli import _launch
    from memfit.integrations.transformers import MemfitTrainer

    handlers = []
    monkeypatch.setattr(_launch.atexit, "register", handlers.append)
    _launch.end_process_group_at_exit.cache_clear()
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for _ in range(2):
            MemfitTrainer(nn.Linear(2, 2), args=args)
        assert handlers.count(_launch._end_gloo_group) == 1  # (transformers may register its own)
        _launch._end_gloo_group()
        assert not dist.is_initialized()
    finally:
        _launch.end_process_group()
        _launch.end_process_group_at_exit.cache_clear()
