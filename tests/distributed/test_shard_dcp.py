"""torch's state-dict API and DCP on a sharded model: get_state_dict -> dcp.save -> a fresh model
and optimizer -> dcp.load -> set_state_dict resumes bitwise at the same world size and loads at
others (2 -> 1 -> 3); full_state_dict=True equals an unsharded (DDP-equivalent) run's state.

Configurations: Adam and SGD with momentum, an even and an uneven vocabulary, two parameter
groups (weight decay on matrices only) and a frozen parameter in the optimizer. One spawned group
per world size; the group of 2 runs first (a module fixture) and saves what the others load.
"""

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

import memfit
from tests._dist import Subtests, case_id

ROWS, SEQ = 12, 5  # the global batch: divisible by 1, 2 and 3 ranks
CONFIGS = [(opt, vocab) for opt in ("adam", "sgd") for vocab in (256, 301)]  # 301: uneven at 2 and 3 ranks
FULL = StateDictOptions(full_state_dict=True)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc, self.norm = nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, h):
        return h + torch.tanh(self.fc(self.norm(h)))


class LM(nn.Module):
    def __init__(self, vocab, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(Block(d), Block(d))
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        h = self.blocks(self.emb(ids))
        return self.head(h + self.frozen(h))


def make_opt(model, kind):
    decay = [p for _, p in model.named_parameters() if p.dim() > 1]
    rest = [p for _, p in model.named_parameters() if p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 2e-2}]
    if kind == "adam":
        return torch.optim.AdamW(groups, lr=1e-2)
    return torch.optim.SGD(groups, lr=5e-2, momentum=0.9)


def build(kind, vocab, seed=0, sharded=True):
    torch.manual_seed(seed)
    model = LM(vocab)
    if sharded:
        model = memfit.FullyShardedDataParallel(model, auto_wrap_policy={Block})
    return model, make_opt(model, kind)


def batch(step, vocab, rank=0, world=1):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(vocab, (ROWS, SEQ + 1), generator=g)
    per = ROWS // world
    return ids[rank * per : (rank + 1) * per]


def train(model, opt, steps, first, rank, world, vocab):
    """Mean loss over the global batch, each step."""
    losses = []
    for step in range(first, first + steps):
        ids = batch(step, vocab, rank, world)
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        if dist.is_initialized() and world > 1:
            dist.all_reduce(t)
        losses.append((t / world).item())
    return losses


def full(model, opt):
    """Full model and optimizer state dicts (every rank), copied (torch hands out the optimizer's
    own scalar tensors, which later steps change in place)."""
    return tree_map_only(torch.Tensor, torch.clone, get_state_dict(model, opt, options=FULL))


def assert_same(a, b, what, **tol):
    """Equal nested state dicts: tensors bitwise (or within ``tol``), the rest ==."""
    if isinstance(a, dict):
        assert set(a) == set(b), f"{what}: keys {sorted(set(a) ^ set(b))} differ"
        for k in a:
            assert_same(a[k], b[k], f"{what}.{k}", **tol)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{what}[{i}]", **tol)
    elif isinstance(a, torch.Tensor):
        assert not isinstance(a, DTensor) and not isinstance(b, DTensor), f"{what}: a DTensor in a full state dict"
        if tol:
            torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{what}: {m}")
        else:
            assert torch.equal(a, b), f"{what}: differs (max {(a.double() - b.double()).abs().max().item():.3g})"
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


def tag(kind, vocab):
    return f"{kind}-{vocab}"


def load_into(path, model, opt, **kw):
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"], **kw)


# -- the group of 2 --------------------------------------------------------------------------


def case_state_is_dtensors_sharded_like_the_parameters(rank, world, root):
    model, opt = build("adam", 301)
    train(model, opt, 1, 0, rank, world, 301)
    msd, osd = get_state_dict(model, opt)
    for name, st in osd["state"].items():
        if name.startswith("frozen."):
            raise AssertionError(f"a frozen parameter has optimizer state: {name}")
        for k in ("exp_avg", "exp_avg_sq"):
            v, p = st[k], msd[name]
            assert isinstance(v, DTensor), f"{name}.{k} is {type(v).__name__}"
            assert v.shape == p.shape and v.placements == p.placements, name
            assert v.to_local().shape == p.to_local().shape, name
        assert not isinstance(st["step"], DTensor)
    assert {"frozen.weight", "frozen.bias"} <= {n for g in osd["param_groups"] for n in g["params"]}
    # The optimizer's own state is untouched: still this rank's chunks.
    assert all(not isinstance(v, DTensor) for st in opt.state.values() for v in st.values())


def case_save_and_resume_bitwise(rank, world, root):
    expect = {}
    for kind, vocab in CONFIGS:
        path = os.path.join(root, tag(kind, vocab))
        model, opt = build(kind, vocab)
        train(model, opt, 3, 0, rank, world, vocab)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        fm, fo = full(model, opt)
        if rank == 0:
            torch.save({"model": fm, "optim": fo}, path + ".full.pt")
        cont = train(model, opt, 3, 3, rank, world, vocab)
        expect[tag(kind, vocab)] = cont
        after = full(model, opt)

        model2, opt2 = build(kind, vocab, seed=1)  # other values: the load must set them all
        load_into(path, model2, opt2)
        assert_same(full(model2, opt2), (fm, fo), f"{tag(kind, vocab)} loaded")
        assert train(model2, opt2, 3, 3, rank, world, vocab) == cont, tag(kind, vocab)
        assert_same(full(model2, opt2), after, f"{tag(kind, vocab)} resumed")
    if rank == 0:
        with open(os.path.join(root, "continued.json"), "w") as f:
            json.dump(expect, f)


def case_full_state_equals_unsharded_run(rank, world, root):
    for kind, vocab in CONFIGS:
        model, opt = build(kind, vocab)
        ref, ref_opt = build(kind, vocab, sharded=False)
        train(model, opt, 3, 0, rank, world, vocab)
        train(ref, ref_opt, 3, 0, 0, 1, vocab)  # the global batch in one process: what DDP computes
        fm, fo = full(model, opt)
        rm, ro = get_state_dict(ref, ref_opt)
        assert_same(fm, rm, f"{tag(kind, vocab)} model", rtol=1e-5, atol=1e-6)
        assert_same(fo, ro, f"{tag(kind, vocab)} optim", rtol=1e-5, atol=1e-6)
        # The full state dicts load back: the same values, exactly.
        model2, opt2 = build(kind, vocab, seed=1)
        set_state_dict(model2, opt2, model_state_dict=fm, optim_state_dict=fo, options=FULL)
        assert_same(full(model2, opt2), (fm, fo), f"{tag(kind, vocab)} full load")


def case_memfit_checkpoint_files_and_dcp_files(rank, world, root):
    kind, vocab = "adam", 301
    model, opt = build(kind, vocab)
    train(model, opt, 2, 0, rank, world, vocab)
    own = os.path.join(root, "memfit-ckpt")
    memfit.save_checkpoint(own, model, opt)
    fm, fo = full(model, opt)
    cont = train(model, opt, 2, 2, rank, world, vocab)
    # memfit's own files, as before
    model2, opt2 = build(kind, vocab, seed=1)
    memfit.load_checkpoint(own, model2, opt2)
    assert_same(full(model2, opt2), (fm, fo), "memfit.load_checkpoint of its own files")
    assert train(model2, opt2, 2, 2, rank, world, vocab) == cont
    # DCP's files, written through torch's state-dict API, read by memfit.load_checkpoint
    path = os.path.join(root, tag(kind, vocab))
    model3, opt3 = build(kind, vocab, seed=1)
    memfit.load_checkpoint(path, model3, opt3)
    saved = torch.load(path + ".full.pt", weights_only=True)
    assert_same(full(model3, opt3), (saved["model"], saved["optim"]), "memfit.load_checkpoint of DCP files")
    # Another layout: refused, naming the directory, what it holds and what memfit reads.
    other = os.path.join(root, "other-layout")
    dcp.save({"weights": get_state_dict(model3, opt3)[0]}, checkpoint_id=other)
    with pytest.raises(RuntimeError, match=r"other-layout.*without memfit\.json.*\['weights'\].*'model' and 'optim'"):
        memfit.load_checkpoint(other, model3, opt3)


def case_plain_load_state_dict_before_any_step(rank, world, root):
    """optimizer.state_dict() / load_state_dict() of torch's own, on an optimizer that has not
    stepped yet (no hooks): its DTensors are made local at the first step."""
    for kind in ("adam", "sgd"):
        model, opt = build(kind, 301)
        train(model, opt, 2, 0, rank, world, 301)
        # Copies: loading shares tensors with what is loaded, as torch's own load_state_dict does.
        msd, osd = tree_map_only(torch.Tensor, torch.clone, (model.state_dict(), opt.state_dict()))
        assert isinstance(osd["state"][0][next(k for k in osd["state"][0] if k != "step")], DTensor)
        model2, opt2 = build(kind, 301, seed=1)
        model2.load_state_dict(msd)
        opt2.load_state_dict(osd)
        assert train(model2, opt2, 2, 2, rank, world, 301) == train(model, opt, 2, 2, rank, world, 301), kind


def case_gpt2_with_tied_head_resumes_bitwise(rank, world, root):
    """The issue's scenario: a sharded HF GPT-2 (LM head tied to the embedding), vocabulary 301."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from tests._models import tiny_gpt2

    def gpt2(seed):
        model = memfit.FullyShardedDataParallel(tiny_gpt2(vocab=301, seed=seed), auto_wrap_policy=GPT2Block)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def steps(model, opt, first, n):
        for step in range(first, first + n):
            ids = batch(step, 301, rank, world)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()

    path = os.path.join(root, "gpt2")
    model, opt = gpt2(0)
    steps(model, opt, 0, 2)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    steps(model, opt, 2, 2)
    model2, opt2 = gpt2(1)
    load_into(path, model2, opt2)
    steps(model2, opt2, 2, 2)
    assert_same(full(model2, opt2), full(model, opt), "GPT-2 resumed")


FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # torchtitan's layout


def case_save_flattened_optimizer_state(rank, world, root):
    model, opt = build("adam", 301)
    train(model, opt, 3, 0, rank, world, 301)
    msd, osd = get_state_dict(model, opt, options=FLAT)
    assert isinstance(osd["state.emb.weight.exp_avg"], DTensor)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, "flat"))
    saved = full(model, opt)
    if rank == 0:
        torch.save(saved, os.path.join(root, "flat.full.pt"))


# -- the groups of 1 and 3 -------------------------------------------------------------------


def check_loads(rank, world, root, source):
    with open(os.path.join(root, "continued.json")) as f:
        continued = json.load(f)
    for kind, vocab in CONFIGS:
        path = os.path.join(root, source(kind, vocab))
        saved = torch.load(os.path.join(root, tag(kind, vocab)) + ".full.pt", weights_only=True)
        model, opt = build(kind, vocab, seed=1)
        load_into(path, model, opt)
        assert_same(full(model, opt), (saved["model"], saved["optim"]), f"{source(kind, vocab)} at {world}")
        if world == 1:  # saved again for the group of 3
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path + ".at1")
        losses = train(model, opt, 3, 3, rank, world, vocab)
        torch.testing.assert_close(losses, continued[tag(kind, vocab)], rtol=1e-5, atol=0)


def case_load_saved_at_two(rank, world, root):
    check_loads(rank, world, root, tag)


def case_load_saved_at_one(rank, world, root):
    check_loads(rank, world, root, lambda kind, vocab: tag(kind, vocab) + ".at1")


def case_load_flattened_saved_at_two(rank, world, root):
    model, opt = build("adam", 301, seed=1)
    msd, osd = get_state_dict(model, opt, options=FLAT)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=os.path.join(root, "flat"))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=FLAT)
    assert_same(full(model, opt), torch.load(os.path.join(root, "flat.full.pt"), weights_only=True), "flattened")


CASES = {
    2: [
        case_state_is_dtensors_sharded_like_the_parameters,
        case_save_and_resume_bitwise,
        case_full_state_equals_unsharded_run,
        case_memfit_checkpoint_files_and_dcp_files,
        case_plain_load_state_dict_before_any_step,
        case_gpt2_with_tied_head_resumes_bitwise,
        case_save_flattened_optimizer_state,
    ],
    1: [case_load_saved_at_two],
    3: [case_load_saved_at_two, case_load_saved_at_one, case_load_flattened_saved_at_two],
}
GROUPS = {world: Subtests(cases, timeout=600) for world, cases in CASES.items()}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dcp"))
    GROUPS[2].report(2, root)  # first: the others load what it saved
    GROUPS[1].report(1, root)  # then 1, which saves what 3 loads
    return root


@pytest.mark.parametrize(
    ("world", "case"),
    [(w, c) for w, cs in CASES.items() for c in cs],
    ids=lambda x: x if isinstance(x, int) else case_id(x),
)
def test_dcp(root, world, case):
    GROUPS[world].check(case, world, root)
