"""Sharded checkpoints: saved at 2 ranks, loaded at 1, 3 and 4; export to safetensors; errors.

One spawned group per world size. The group of 2 runs first (a module fixture): it saves the
checkpoint that the groups of 1, 3 and 4 load, and what it expects them to find, under one
directory; every case works in its own subdirectory.
"""

import json
import os
import pickle
import shutil
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import memfit
import memfit.testing
from tests._dist import Subtests, case_id
from tests._models import make_model

ROWS = 12  # the global batch: divisible by 1, 2, 3 and 4 ranks


def global_batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 3, generator=g)


def local_batch(step, rank, world):
    x, y = global_batch(step)
    per = ROWS // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def build():
    model = memfit.FullyShardedDataParallel(make_model("mlp"), auto_wrap_policy=nn.Sequential)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, opt, steps, rank, world, first=0):
    losses = []
    for step in range(first, first + steps):
        x, y = local_batch(step, rank, world)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append((t / world).item())
    return losses


def full_state(model, opt):
    """Full parameters and full AdamW state, by name (gathered), as lists."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    with memfit.summon_full_params(model, writeback=False):
        out.update({n: p.detach().reshape(-1).tolist() for n, p in model.named_parameters()})
    world = dist.get_world_size()
    for p, st in opt.state.items():
        for k, v in st.items():
            if v.dim() == 0:
                out[f"{names[id(p)]}/{k}"] = [v.item()]
                continue
            gathered = [None] * world
            dist.all_gather_object(gathered, v.reshape(-1).tolist())
            out[f"{names[id(p)]}/{k}"] = [x for part in gathered for x in part]
    return out


def case_save_at_two(rank, world, root):
    path = os.path.join(root, "saved", "ckpt")
    model, opt = build()
    train(model, opt, 2, rank, world)
    memfit.save_checkpoint(path, model, opt, extra={"step": 2, "data_position": 24, "seed": torch.tensor([7])})
    saved = full_state(model, opt)
    losses = train(model, opt, 2, rank, world, first=2)
    if rank == 0:
        assert sorted(os.listdir(os.path.dirname(path))) == ["ckpt"]  # no temporary directory left
        with open(os.path.join(root, "saved.json"), "w") as f:
            json.dump({"state": saved, "losses": losses}, f)  # floats round-trip exactly


def case_load_and_continue(rank, world, root):
    with open(os.path.join(root, "saved.json")) as f:
        expected = json.load(f)
    saved, losses = expected["state"], expected["losses"]
    model, opt = build()
    extra = memfit.load_checkpoint(os.path.join(root, "saved", "ckpt"), model, opt)
    assert extra["step"] == 2 and extra["data_position"] == 24 and extra["seed"].tolist() == [7]
    state = full_state(model, opt)
    assert state.keys() == saved.keys()
    for k, v in saved.items():
        assert state[k] == v, k  # exact: the same bytes, re-chunked
    again = train(model, opt, 2, rank, world, first=2)
    for a, b in zip(again, losses):
        # saved at W=2, continued at this W: the gradient sums run over other ranks, fp32 order
        assert abs(a - b) <= 1e-6 * abs(b), (again, losses)


def case_saving_over_a_checkpoint_replaces_it(rank, world, root):
    path = os.path.join(root, "resaved", "ckpt")
    model, opt = build()
    train(model, opt, 1, rank, world)
    memfit.save_checkpoint(path, model, opt, extra={"step": 1})
    train(model, opt, 1, rank, world, first=1)
    memfit.save_checkpoint(path, model, opt, extra={"step": 2})  # replaces the first, atomically
    assert memfit.load_checkpoint(path, *build())["step"] == 2
    dist.barrier()
    if rank == 0:
        assert sorted(os.listdir(os.path.dirname(path))) == ["ckpt"]


def case_async_save_while_training(rank, world, root):
    path = os.path.join(root, "async", "ckpt")
    model, opt = build()
    train(model, opt, 2, rank, world)
    saved = full_state(model, opt)
    future = memfit.save_checkpoint(path, model, opt, extra={"step": 2}, async_=True)
    train(model, opt, 2, rank, world, first=2)  # the model's collectives while memfit's thread writes
    assert future.result() is None
    model2, opt2 = build()
    assert memfit.load_checkpoint(path, model2, opt2)["step"] == 2
    assert full_state(model2, opt2) == saved  # exact: the state at the call, not the steps after it
    later = memfit.save_checkpoint(path, model, opt, extra={"step": 4}, async_=True)
    memfit.save_checkpoint(path, model, opt, extra={"step": 4})  # waits for the one in flight first
    assert later.done() and later.exception() is None
    assert full_state(model, opt) == full_state(*_loaded(path))


def _loaded(path):
    model, opt = build()
    memfit.load_checkpoint(path, model, opt)
    return model, opt


def case_errors_name_what_differs(rank, world, root):
    root = os.path.join(root, "errors")
    if rank == 0:
        os.makedirs(root)
        with open(os.path.join(root, "a-file"), "w") as f:
            f.write("not a directory")
    dist.barrier()
    out = {}
    model, opt = build()
    path = os.path.join(root, "ckpt")
    memfit.save_checkpoint(path, model, opt)

    other = memfit.FullyShardedDataParallel(make_model("lm"), auto_wrap_policy=nn.Sequential)
    try:
        memfit.load_checkpoint(path, other)
    except RuntimeError as e:
        out["other model"] = str(e)

    bf16 = make_model("mlp").to(torch.bfloat16)
    try:
        memfit.load_checkpoint(path, memfit.FullyShardedDataParallel(bf16, auto_wrap_policy=nn.Sequential))
    except RuntimeError as e:
        out["dtype"] = str(e)

    try:
        memfit.save_checkpoint(os.path.join(root, "a-file", "ckpt"), model, opt)
    except OSError as e:
        out["unwritable"] = str(e)
    dist.barrier()
    if rank != 0:
        return
    msg = out["other model"]  # keys sorted, the first ten named
    assert "missing keys ['blocks.0.ff.0.bias', 'blocks.0.ff.0.weight'" in msg, msg
    assert "unexpected keys ['blocks.0.0.bias', 'blocks.0.0.weight'" in msg, msg
    assert "'blocks.0.0.bias' is torch.float32[7] in the checkpoint but torch.bfloat16[7] here" in out["dtype"]
    assert "cannot write to" in out["unwritable"] and "a-file" in out["unwritable"]
    assert sorted(os.listdir(root)) == ["a-file", "ckpt"]


def load_only(path):
    try:
        memfit.load_checkpoint(path, build()[0])
    except (RuntimeError, FileNotFoundError) as e:
        return str(e)
    return "loaded"


def case_truncated_file_and_planted_pickle_are_refused(rank, world, root):
    path = os.path.join(root, "corrupted", "ckpt")
    shutil.copytree(os.path.join(root, "saved", "ckpt"), path)  # what the group of 2 saved
    shard_file = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0]
    with open(os.path.join(path, shard_file), "r+b") as f:
        f.truncate(10)
    msg = load_only(path)
    assert f"{shard_file}' is truncated (10 of" in msg, msg

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(Evil(), f)
    msg = load_only(path)
    assert "refusing" in msg and ("posix.system" in msg or "os.system" in msg), msg


def case_corruption_is_refused_naming_file_and_tensor(rank, world, root):
    saved = os.path.join(root, "saved", "ckpt")
    chunks = memfit.testing.checkpoint_chunks(saved)

    def damaged(name, at, data=b"\xff\xff\x7f\x7f"):
        path = os.path.join(root, "damaged", name)
        shutil.copytree(saved, path)
        rel, off, n = chunks["model/blocks.0.0.weight"]
        with open(os.path.join(path, rel), "r+b") as f:
            f.seek(off + (n // 2 if at == "data" else 0))  # inside the tensor's bytes, or its zip header
            f.write(data)
        return path, rel

    path, rel = damaged("bytes", "data")  # a weight would read back as 3.4e38
    msg = load_only(path)
    assert f"{rel}' is corrupt" in msg and "tensor 'model/blocks.0.0.weight'" in msg, msg

    path, rel = damaged("header", "header", b"XXXX")
    assert f"{rel}' is corrupt" in load_only(path)
    with open(os.path.join(path, "memfit.json")) as f:
        info = json.load(f)
    del info["checksums"]  # a checkpoint written before checksums: torch's reader meets the header
    with open(os.path.join(path, "memfit.json"), "w") as f:
        json.dump(info, f)
    msg = load_only(path)
    assert "corrupt or not a memfit checkpoint" in msg and "weights_only" not in msg, msg

    path, _ = damaged("metadata", "data")
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(os.urandom(64))
    msg = load_only(path)
    assert "corrupt or not a memfit checkpoint" in msg and "arbitrary code" not in msg, msg

    path, _ = damaged("json", "data")
    open(os.path.join(path, "memfit.json"), "w").close()
    msg = load_only(path)
    assert "memfit.json' is empty" in msg and "corrupt or not a memfit checkpoint" in msg, msg


def case_checksums_do_not_rely_on_what_dcp_save_returns(rank, world, root):
    # torch 2.11's dcp.save returns its metadata without storage_data: memfit wrote no checksums
    # there and then refused every such checkpoint ("memfit.json has no checksum for tensor ...").
    path = os.path.join(root, "dcp-2.11", "ckpt")
    real_save = dcp.save

    def save_as_in_2_11(*args, **kwargs):
        meta = real_save(*args, **kwargs)
        meta.storage_data = None
        return meta

    model, opt = build()
    train(model, opt, 1, rank, world)
    with mock.patch.object(dcp, "save", save_as_in_2_11):
        memfit.save_checkpoint(path, model, opt)
    with open(os.path.join(path, "memfit.json")) as f:
        recorded = json.load(f)["checksums"]
    assert set(recorded) == set(memfit.testing.checkpoint_chunks(path)), recorded
    model2, opt2 = build()
    memfit.load_checkpoint(path, model2, opt2)
    assert full_state(model2, opt2) == full_state(model, opt)

    # what the old code wrote there (an empty record) loads, unverified, with a warning
    with open(os.path.join(path, "memfit.json")) as f:
        info = json.load(f)
    info["checksums"] = {}
    with open(os.path.join(path, "memfit.json"), "w") as f:
        json.dump(info, f)
    with pytest.warns(UserWarning, match="records no checksums"):
        memfit.load_checkpoint(path, *build())


def case_export_safetensors_loads_in_a_plain_model(rank, world, root):
    path = os.path.join(root, "export")
    model, opt = build()
    train(model, opt, 1, rank, world)
    memfit.export_safetensors(model, path)
    saved = full_state(model, opt)
    dist.barrier()
    if rank != 0:
        return
    from safetensors.torch import load_file

    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    state = {}
    for name in sorted(set(index["weight_map"].values())):
        state.update(load_file(os.path.join(path, name)))
    plain = make_model("mlp")
    plain.load_state_dict(state)  # strict: every key, every shape
    for n, p in plain.named_parameters():
        assert p.detach().reshape(-1).tolist() == saved[n], n


def case_export_hf_bert_loads_with_from_pretrained(rank, world, root):
    from transformers import BertForMaskedLM
    from transformers.models.bert.modeling_bert import BertLayer

    path = os.path.join(root, "bert")
    model = memfit.FullyShardedDataParallel(make_model("bert"), auto_wrap_policy={BertLayer})
    memfit.export_safetensors(model, path)
    with memfit.summon_full_params(model, writeback=False):
        want = {n: p.detach().reshape(-1)[:5].tolist() for n, p in model.named_parameters()}
    dist.barrier()
    if rank != 0:
        return
    loaded = BertForMaskedLM.from_pretrained(path)
    got = {n: p.detach().reshape(-1)[:5].tolist() for n, p in loaded.named_parameters()}
    assert got == want


CASES = {  # world size -> its group's cases; the group of 2 saves what the others load
    2: [
        case_save_at_two,
        case_saving_over_a_checkpoint_replaces_it,
        case_async_save_while_training,
        case_errors_name_what_differs,
        case_export_hf_bert_loads_with_from_pretrained,
    ],
    1: [
        case_load_and_continue,
        case_truncated_file_and_planted_pickle_are_refused,
        case_corruption_is_refused_naming_file_and_tensor,
        case_checksums_do_not_rely_on_what_dcp_save_returns,
    ],
    3: [case_load_and_continue, case_export_safetensors_loads_in_a_plain_model],
    4: [case_load_and_continue],
}
GROUPS = {world: Subtests(cases) for world, cases in CASES.items()}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("checkpoints"))
    GROUPS[2].report(2, root)  # first: the other groups load what it saved
    return root


@pytest.mark.parametrize(
    ("world", "case"),
    [(w, c) for w, cases in CASES.items() for c in cases],
    ids=[f"{case_id(c)}-{w}" for w, cases in CASES.items() for c in cases],
)
def test_checkpoint(root, world, case):
    GROUPS[world].check(case, world, root)
