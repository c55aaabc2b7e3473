"""checkpoint_module / checkpoint_wrapper / apply_activation_checkpointing: in place, names kept."""

import copy

import pytest
import torch
from torch import nn

import memfit
from tests._models import tiny_bert
from tests._parity import assert_same, grads


class Block(nn.Module):
    def __init__(self, h=8):
        super().__init__()
        self.fc = nn.Linear(h, h)
        self.drop = nn.Dropout(0.2)
        self.norm = nn.LayerNorm(h)

    def forward(self, x, *, scale=1.0):
        return self.norm(x + self.drop(self.fc(x).relu()) * scale)


class Net(nn.Module):
    def __init__(self, n=4, h=8):
        super().__init__()
        self.inp = nn.Linear(h, h)
        self.blocks = nn.ModuleList(Block(h) for _ in range(n))
        self.head = nn.Linear(h, 2)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x, scale=0.5)
        return self.head(x)


def names(m):
    return (
        [n for n, _ in m.named_parameters()],
        list(m.state_dict().keys()),
        [n for n, _ in m.named_modules()],
    )


def step(model, x, seed=3):
    torch.manual_seed(seed)
    loss = model(x).square().mean()
    loss.backward()
    return loss


def test_names_unchanged_and_parity():
    ref = Net()
    model = copy.deepcopy(ref)
    before = names(model)
    for b in model.blocks:
        assert memfit.checkpoint_module(b) is b
    assert names(model) == before
    x = torch.randn(5, 8)
    assert torch.equal(step(model, x), step(ref, x))
    assert_same(grads(model), grads(ref))
    model.load_state_dict(ref.state_dict())  # keys load both ways


def test_remove_checkpointing_restores_plain_forward():
    model = Net()
    memfit.apply_activation_checkpointing(model, Block)
    assert memfit.remove_checkpointing(model) == 4
    assert all("forward" not in b.__dict__ for b in model.blocks)
    calls = []
    model.blocks[0].fc.register_forward_hook(lambda *a: calls.append(1))
    step(model, torch.randn(2, 8))
    assert len(calls) == 1  # no recompute any more


def test_idempotent_and_conflicting_options():
    b = Block()
    memfit.checkpoint_module(b)
    fwd = b.forward
    memfit.checkpoint_module(b)
    assert b.forward is fwd
    with pytest.raises(ValueError, match=r"already checkpointed.*remove_checkpointing"):
        memfit.checkpoint_module(b, offload="cpu")
    with pytest.raises(TypeError, match=r"expected an nn\.Module"):
        memfit.checkpoint_module(lambda x: x)


def test_checkpoint_wrapper_is_fairscale_compatible():
    ref = Net()
    model = copy.deepcopy(ref)
    before = names(model)
    for i, b in enumerate(model.blocks):
        model.blocks[i] = memfit.checkpoint_wrapper(b, offload_to_cpu=(i % 2 == 0))
    assert names(model) == before
    x = torch.randn(3, 8)
    assert torch.equal(step(model, x), step(ref, x))
    assert_same(grads(model), grads(ref))


def test_module_hooks_run_once_and_inner_modules_recompute():
    model = Net()
    memfit.checkpoint_module(model.blocks[1])
    outer, inner = [], []
    model.blocks[1].register_forward_hook(lambda *a: outer.append(memfit.is_recomputing()))
    model.blocks[1].fc.register_forward_hook(lambda *a: inner.append(memfit.is_recomputing()))
    step(model, torch.randn(2, 8))
    assert outer == [False]  # the checkpointed module's own hooks are not part of recompute
    assert inner == [False, True]


def test_apply_policies():
    def chosen(policy):
        model = Net()
        return memfit.apply_activation_checkpointing(model, policy)

    assert chosen(Block) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert chosen((Block, nn.Linear)) == ["inp", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    assert chosen(memfit.every_nth(2, Block)) == ["blocks.0", "blocks.2"]
    assert chosen(lambda m: isinstance(m, nn.LayerNorm)) == [f"blocks.{i}.norm" for i in range(4)]
    assert chosen(lambda m: True) == [""]  # the outermost selected module wins
    with pytest.raises(TypeError, match="policy must be a module class"):
        chosen("Block")
    with pytest.raises(TypeError, match="tuple of module classes"):
        chosen((Block, "x"))
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        memfit.every_nth(0, Block)


def test_disable_checkpointing_for_modules():
    model = Net()
    memfit.apply_activation_checkpointing(model, Block)
    calls = []
    model.blocks[0].fc.register_forward_hook(lambda *a: calls.append(1))
    with memfit.disable_checkpointing():
        step(model, torch.randn(2, 8))
    assert len(calls) == 1


def test_deepcopy_of_checkpointed_model_is_independent():
    model = Net()
    memfit.apply_activation_checkpointing(model, Block)
    clone = copy.deepcopy(model)
    assert clone.blocks[0].forward.module is clone.blocks[0]
    x = torch.randn(3, 8)
    assert torch.equal(step(model, x), step(clone, x))
    assert_same(grads(model), grads(clone))


def test_error_names_the_module_path():
    model = Net()
    memfit.apply_activation_checkpointing(model, Block)
    blk = model.blocks[2]
    state = {"n": 0}
    orig = type(blk).forward

    def flaky(self, x, *, scale=1.0):  # a forward whose shapes depend on a call counter
        state["n"] += 1
        return orig(self, x[: 3 - state["n"] + 1], scale=scale)

    blk.forward.inner = flaky.__get__(blk)
    with pytest.raises(memfit.CheckpointError, match=r"blocks\.2 \(Block\).*diverged"):
        step(model, torch.randn(3, 8))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_hf_bert_bitwise_equal_with_dropout(attn):
    from transformers.models.bert.modeling_bert import BertLayer

    ref = tiny_bert()
    ref.config._attn_implementation = attn
    model = copy.deepcopy(ref)
    paths = memfit.apply_activation_checkpointing(model, BertLayer)
    assert paths == [f"bert.encoder.layer.{i}" for i in range(3)]
    ids = torch.randint(0, 120, (2, 16))
    labels = ids.clone()
    model.train()
    ref.train()
    calls = []
    model.bert.encoder.layer[0].intermediate.register_forward_hook(lambda *a: calls.append(1))
    losses = []
    for m in (model, ref):
        torch.manual_seed(11)
        out = m(input_ids=ids, labels=labels)
        out.loss.backward()
        losses.append(out.loss)
    assert torch.equal(losses[0], losses[1])
    assert len(calls) == 2  # forward and recompute
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), n


def test_hf_bert_peak_equals_torch_checkpoint():
    # Same decisions as torch's non-reentrant checkpoint: the same tensors live at every
    # moment, so MemoryMeter's peaks must be equal, byte for byte.
    import warnings

    from transformers.models.bert.modeling_bert import BertLayer

    base = tiny_bert()
    ids = torch.randint(0, 120, (4, 32))
    peaks = []
    for use_memfit in (True, False):
        model = copy.deepcopy(base)
        if use_memfit:
            memfit.apply_activation_checkpointing(model, BertLayer)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        with memfit.MemoryMeter(model=model) as meter:
            model(input_ids=ids, labels=ids).loss.backward()
        peaks.append(meter.peak_bytes)
    assert peaks[0] == peaks[1]


@pytest.mark.parametrize("save", [None, "linear"])
def test_hf_decoder_key_value_cache_dropped_in_training(save):
    # GPT-2 and Llama configs default to use_cache=True: the layers appended their keys and
    # values to the cache in forward and again in recompute. Selective recompute failed in
    # backward ("aten.slice.Tensor encountered during backward but not found in storage") and
    # full recompute kept the cache alive all step (a higher peak than transformers' own
    # checkpointing, which drops the cache). Now: gradients bitwise equal to the plain model,
    # peak equal to transformers' gradient checkpointing.
    import warnings

    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from tests._models import tiny_gpt2

    ref = tiny_gpt2()
    assert ref.config.use_cache
    ids = torch.randint(0, 97, (2, 16))
    hf = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = copy.deepcopy(ref)
    memfit.apply_activation_checkpointing(model, GPT2Block, save=save)
    peaks = []
    for m in (model, hf, ref):
        m.train()
        with memfit.MemoryMeter(model=m) as meter:
            m(input_ids=ids, labels=ids).loss.backward()
        peaks.append(meter.peak_bytes)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
    if save is None:
        assert peaks[0] == peaks[1]


@pytest.mark.parametrize("save", [None, "linear"])
def test_a_cache_built_in_training_is_updated_once(save):
    # XLM's forward builds a key/value cache even in training and passes it to every attention
    # module; recompute appended to it again (keys twice as long: "recompute diverged from
    # forward at saved tensor #6"). Now recompute runs on a snapshot of the cache as forward saw
    # it: loss and gradients bitwise equal to the plain model with dropout on, and the model's
    # cache holds each layer's keys once. See [Note: Key/value caches under recompute].
    from transformers import XLMConfig, XLMWithLMHeadModel
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    cfg = XLMConfig(vocab_size=99, emb_dim=32, n_layers=2, n_heads=4, dropout=0.1, attention_dropout=0.1)
    ref = XLMWithLMHeadModel(cfg).train()
    ids = torch.randint(5, 99, (2, 12))
    model = copy.deepcopy(ref)
    assert len(memfit.apply_activation_checkpointing(model, lambda m: m in set(model.transformer.attentions))) == 2
    caches = []
    for m in (ref, model):
        cache = EncoderDecoderCache(DynamicCache(config=cfg), DynamicCache(config=cfg))
        torch.manual_seed(1)
        loss = m(input_ids=ids, labels=ids, cache=cache).loss
        loss.backward()
        caches.append((loss, cache))
    assert torch.equal(caches[0][0], caches[1][0])
    assert_same(grads(model), grads(ref))
    layers = caches[1][1].self_attention_cache.layers
    assert [tuple(layer.keys.shape) for layer in layers] == [(2, 4, 12, 8)] * 2
