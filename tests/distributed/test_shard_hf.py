"""A sharded HF model where transformers meets it: unwrap_model, save_pretrained /
from_pretrained (full weights, tied once, one dtype), and what state_dict() holds (DTensors).
One group of 2 ranks runs every case, on a tiny GPT-2 whose LM head is tied."""

import glob
import json
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import memfit
from tests._dist import Subtests, case_id
from tests._models import tiny_gpt2


def sharded_gpt2(use_shard=False, mixed_precision=None):
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    model = tiny_gpt2()
    if use_shard:  # memfit.shard bottom-up: blocks, then the root
        for block in model.transformer.h:
            memfit.shard(block, mixed_precision=mixed_precision)
        return memfit.shard(model, mixed_precision=mixed_precision)
    return memfit.FullyShardedDataParallel(model, auto_wrap_policy={GPT2Block}, mixed_precision=mixed_precision)


def train_step(model):
    g = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, 97, (2, 16), generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def full_params(model):
    with memfit.summon_full_params(model, writeback=False):
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def case_unwrap_model_terminates(rank, world, root):
    from accelerate.utils import extract_model_from_parallel
    from transformers.modeling_utils import unwrap_model

    model = sharded_gpt2()
    assert unwrap_model(model) is model
    assert unwrap_model(model, recursive=True) is model
    assert extract_model_from_parallel(model, recursive=True) is model


def check_saved_dir(path):
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    files = set(index["weight_map"].values())
    assert files == {os.path.basename(p) for p in glob.glob(os.path.join(path, "*.safetensors"))}
    from safetensors import safe_open

    dtypes = set()
    for name in files:
        with safe_open(os.path.join(path, name), "pt") as f:
            assert list(f.keys()), f"{name} is empty"
            dtypes |= {str(f.get_slice(k).get_dtype()) for k in f.keys()}
    assert "lm_head.weight" not in index["weight_map"]  # tied: written once, as transformer.wte.weight
    assert index["metadata"]["tied"] == {"lm_head.weight": "transformer.wte.weight"}
    return dtypes


def _save_and_load(rank, root, use_shard):
    from transformers import AutoModelForCausalLM

    model = sharded_gpt2(use_shard=use_shard)
    train_step(model)
    path = os.path.join(root, f"save-{use_shard}")
    model.save_pretrained(path)
    want = full_params(model)
    if rank == 0:
        assert check_saved_dir(path) == {"F32"}
        loaded = AutoModelForCausalLM.from_pretrained(path)  # config.json names the class
        assert type(loaded).__name__ == "GPT2LMHeadModel"
        assert loaded.lm_head.weight is loaded.transformer.wte.weight
        got = dict(loaded.named_parameters())
        for n, p in got.items():
            torch.testing.assert_close(p.detach(), want[n], rtol=0, atol=0, msg=n)


def case_save_pretrained_fsdp(rank, world, root):
    _save_and_load(rank, root, use_shard=False)


def case_save_pretrained_shard(rank, world, root):
    _save_and_load(rank, root, use_shard=True)


def case_export_one_dtype(rank, world, root):
    from transformers import GPT2LMHeadModel

    model = sharded_gpt2(mixed_precision=memfit.MixedPrecision(torch.bfloat16))
    train_step(model)
    # The fp32 master weights (the shards), not the bf16 copies the units compute with.
    master = {k: v.full_tensor() for k, v in model.state_dict().items() if isinstance(v, DTensor)}
    assert {v.dtype for v in master.values()} == {torch.float32}
    path = os.path.join(root, "export")
    memfit.export_safetensors(model, path)  # default: the parameters' dtype, fp32
    bf16 = os.path.join(root, "export-bf16")
    model.save_pretrained(bf16, dtype=torch.bfloat16)
    if rank == 0:
        assert check_saved_dir(path) == {"F32"}
        assert check_saved_dir(bf16) == {"BF16"}
        loaded = GPT2LMHeadModel.from_pretrained(bf16)
        assert loaded.dtype == torch.bfloat16
        assert all(torch.equal(p, master[n].bfloat16()) for n, p in loaded.named_parameters())
        loaded = GPT2LMHeadModel.from_pretrained(path)
        assert loaded.dtype == torch.float32
        assert all(torch.equal(p, master[n]) for n, p in loaded.named_parameters())


def case_state_dict_is_dtensors(rank, world, root):
    model = sharded_gpt2()
    train_step(model)
    sd = model.state_dict()
    full = full_params(model)
    for name in full:
        assert isinstance(sd[name], DTensor), name
        assert sd[name].shape == full[name].shape, name
        assert torch.equal(sd[name].full_tensor(), full[name]), name
    assert isinstance(sd["lm_head.weight"], DTensor)
    # Loads back: into another sharded model, from DTensors or from full tensors.
    other = sharded_gpt2()
    other.load_state_dict(sd)
    assert all(torch.equal(p, full[n]) for n, p in full_params(other).items())
    third = sharded_gpt2()
    third.load_state_dict({k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()})
    assert all(torch.equal(p, full[n]) for n, p in full_params(third).items())
    # torch's own API gives the full state dict from it.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    plain = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    assert all(torch.equal(plain[n], full[n]) for n in full)
    # A chunk posing as the full tensor is refused.
    chunk = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in sd.items()}
    with pytest.raises(RuntimeError, match="shape of this rank's chunk"):
        sharded_gpt2().load_state_dict(chunk)
    # Inside summon_full_params, state_dict() holds the full tensors.
    with memfit.summon_full_params(model, writeback=False):
        inside = {k: v.clone() for k, v in model.state_dict().items()}  # views of storage freed on exit
    assert not any(isinstance(v, DTensor) for v in inside.values())
    assert all(torch.equal(inside[n], full[n]) for n in full)
    with memfit.summon_full_params(other):  # loads into the full tensors, written back to the shards
        other.load_state_dict(sd)
    assert all(torch.equal(p, full[n]) for n, p in full_params(other).items())
    # While the root unit computes (its full parameters registered), state_dict() is exact too.
    seen = {}
    model.register_forward_hook(lambda m, a, out: seen.update(m.state_dict()))
    model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    for n in full:
        v = seen[n].full_tensor() if isinstance(seen[n], DTensor) else seen[n]
        assert torch.equal(v, full[n]), n


CASES = [
    case_unwrap_model_terminates,
    case_save_pretrained_fsdp,
    case_save_pretrained_shard,
    case_export_one_dtype,
    case_state_dict_is_dtensors,
]
GROUP = Subtests(CASES)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf"))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_hf(root, case):
    GROUP.check(case, 2, root)
