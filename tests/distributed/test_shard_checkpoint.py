"""Sharded checkpoints: saved at 2 ranks, loaded at 1, 3 and 4; export to safetensors; errors."""

import json
import os
import pickle

import torch
import torch.distributed as dist
from torch import nn

import memfit
from tests._dist import run_ranks
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


def save_at_two(rank, world, path):
    model, opt = build()
    train(model, opt, 2, rank, world)
    memfit.save_checkpoint(path, model, opt, step=2, data_position=24, seed=torch.tensor([7]))
    saved = full_state(model, opt)
    return saved, train(model, opt, 2, rank, world, first=2)


def load_and_continue(rank, world, path, saved, losses):
    model, opt = build()
    extra = memfit.load_checkpoint(path, model, opt)
    assert extra["step"] == 2 and extra["data_position"] == 24 and extra["seed"].tolist() == [7]
    state = full_state(model, opt)
    assert state.keys() == saved.keys()
    for k, v in saved.items():
        assert state[k] == v, k  # exact: the same bytes, re-chunked
    again = train(model, opt, 2, rank, world, first=2)
    for a, b in zip(again, losses):
        assert abs(a - b) <= 1e-6 * abs(b), (again, losses)
    return "ok"


def test_save_at_two_ranks_load_at_one_three_and_four(tmp_path):
    path = str(tmp_path / "ckpt")
    (saved, losses), _ = run_ranks(save_at_two, 2, path)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary directory left
    for world in (1, 3, 4):
        assert run_ranks(load_and_continue, world, path, saved, losses) == ["ok"] * world


def resave_over(rank, world, path):
    model, opt = build()
    train(model, opt, 1, rank, world)
    memfit.save_checkpoint(path, model, opt, step=1)
    train(model, opt, 1, rank, world, first=1)
    memfit.save_checkpoint(path, model, opt, step=2)  # replaces the first, atomically
    return memfit.load_checkpoint(path, *build())["step"]


def test_saving_over_a_checkpoint_replaces_it(tmp_path):
    path = str(tmp_path / "ckpt")
    assert run_ranks(resave_over, 2, path) == [2, 2]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def errors(rank, world, root):
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
    return out


def test_errors_name_what_differs(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    out = run_ranks(errors, 2, str(tmp_path))[0]
    msg = out["other model"]  # keys sorted, the first ten named
    assert "missing keys ['blocks.0.ff.0.bias', 'blocks.0.ff.0.weight'" in msg, msg
    assert "unexpected keys ['blocks.0.0.bias', 'blocks.0.0.weight'" in msg, msg
    assert "'blocks.0.0.bias' is torch.float32[7] in the checkpoint but torch.bfloat16[7] here" in out["dtype"]
    assert "cannot write to" in out["unwritable"] and "a-file" in out["unwritable"]
    assert sorted(os.listdir(tmp_path)) == ["a-file", "ckpt"]


def load_only(rank, world, path):
    try:
        memfit.load_checkpoint(path, build()[0])
    except (RuntimeError, FileNotFoundError) as e:
        return str(e)
    return "loaded"


def test_truncated_file_and_planted_pickle_are_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(save_at_two, 2, path)
    shard_file = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0]
    with open(os.path.join(path, shard_file), "r+b") as f:
        f.truncate(10)
    msg = run_ranks(load_only, 1, path)[0]
    assert f"{shard_file}' is truncated (10 of" in msg, msg

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(Evil(), f)
    msg = run_ranks(load_only, 1, path)[0]
    assert "refusing" in msg and ("posix.system" in msg or "os.system" in msg), msg


def export(rank, world, path):
    model, opt = build()
    train(model, opt, 1, rank, world)
    memfit.export_safetensors(model, path)
    return full_state(model, opt)


def test_export_safetensors_loads_in_a_plain_model(tmp_path):
    path = str(tmp_path / "export")
    saved = run_ranks(export, 3, path)[0]
    from safetensors.torch import load_file

    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    state = {}
    for f in sorted(set(index["weight_map"].values())):
        state.update(load_file(os.path.join(path, f)))
    plain = make_model("mlp")
    plain.load_state_dict(state)  # strict: every key, every shape
    for n, p in plain.named_parameters():
        assert p.detach().reshape(-1).tolist() == saved[n], n


def export_bert(rank, world, path):
    from transformers.models.bert.modeling_bert import BertLayer

    model = memfit.FullyShardedDataParallel(make_model("bert"), auto_wrap_policy={BertLayer})
    memfit.export_safetensors(model, path)
    with memfit.summon_full_params(model, writeback=False):
        return {n: p.detach().reshape(-1)[:5].tolist() for n, p in model.named_parameters()}


def test_export_hf_bert_loads_with_from_pretrained(tmp_path):
    from transformers import BertForMaskedLM

    path = str(tmp_path / "bert")
    want = run_ranks(export_bert, 2, path)[0]
    loaded = BertForMaskedLM.from_pretrained(path)
    got = {n: p.detach().reshape(-1)[:5].tolist() for n, p in loaded.named_parameters()}
    assert got == want
