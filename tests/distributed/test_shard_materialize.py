"""memfit.materialize on models built on the meta device: transformers models get their own init
(statistically the eager build's: See [Note: Initialised like eager] in tests/_archs.py), the
same on every rank; modules that nothing initialises are refused by name.

One spawned group of 2 ranks runs every case; the transformers cases loop over tiny configs of
several architectures.
"""

import hashlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

import memfit
from tests._archs import assert_like_eager
from tests._dist import Subtests, case_id

# Tiny configs, one per architecture: (config class, model class, extra config fields).
ARCHS = [
    (
        "GPT2Config",
        "GPT2LMHeadModel",
        {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64, "bos_token_id": 0, "eos_token_id": 0},
    ),
    ("LlamaConfig", "LlamaForCausalLM", {}),
    ("BertConfig", "BertForMaskedLM", {}),
    ("MistralConfig", "MistralForCausalLM", {}),
    ("Qwen2Config", "Qwen2ForCausalLM", {}),
    ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    ("OPTConfig", "OPTForCausalLM", {"ffn_dim": 128, "word_embed_proj_dim": 64}),
    ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}),
]
COMMON = {
    "vocab_size": 301,  # uneven shards
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 64,
}


def hf_model(arch, meta):
    import transformers

    cfg_name, model_name, extra = arch
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **extra})
    model_cls = getattr(transformers, model_name)
    if meta:
        with torch.device("meta"):
            return model_cls(cfg)
    torch.manual_seed(0)
    return model_cls(cfg)


def block_classes(model):
    names = set(model._no_split_modules or ())
    return {type(m) for m in model.modules() if type(m).__name__ in names}


def digest(model):
    h = hashlib.sha256()
    with memfit.summon_full_params(model, writeback=False):
        for n, t in model.state_dict().items():
            h.update(n.encode() + t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def check_like_eager(arch, rank, world):
    eager = hf_model(arch, meta=False)
    model = memfit.FullyShardedDataParallel(hf_model(arch, meta=True), auto_wrap_policy=block_classes(eager))
    memfit.materialize(model)
    digests = [None] * world
    dist.all_gather_object(digests, digest(model))
    assert len(set(digests)) == 1, f"{arch[1]}: ranks hold different values"
    with memfit.summon_full_params(model, writeback=False):
        assert_like_eager(eager.state_dict(), model.state_dict(), arch[1])  # [Note: Initialised like eager]
    ids = torch.randint(301, (2, 8))
    out = model(input_ids=ids, labels=ids)
    assert torch.isfinite(out.loss), arch[1]
    out.loss.backward()


def case_transformers_models_get_their_own_init(rank, world):
    failures = []
    for arch in ARCHS:
        try:
            check_like_eager(arch, rank, world)
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, "\n".join(failures)


class Scale(nn.Module):  # no reset_parameters
    def __init__(self, d):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * self.gain


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.scale = Scale(6)
        self.register_buffer("offset", torch.ones(6))

    def forward(self, x):
        return self.scale(self.fc(x)) + self.offset


def sharded_on_meta():
    with torch.device("meta"):
        return memfit.FullyShardedDataParallel(Net())


def case_uninitialised_module_is_refused_by_name(rank, world):
    with pytest.raises(RuntimeError, match=r"parameter 'scale\.gain' of Scale.*buffer 'offset' of Net.*init=fn"):
        memfit.materialize(sharded_on_meta())


def case_user_init_fills_every_tensor(rank, world):
    def init(m):
        if isinstance(m, nn.Linear):
            m.reset_parameters()
        elif isinstance(m, Scale):
            nn.init.ones_(m.gain)
        elif isinstance(m, Net):
            m.offset.fill_(0.5)

    for spelling in ("init", "param_init_fn"):
        model = memfit.materialize(sharded_on_meta(), **{spelling: init})
        with memfit.summon_full_params(model, writeback=False):
            assert torch.equal(model.scale.gain, torch.ones(6)) and torch.equal(model.offset, torch.full((6,), 0.5))
            bound = 1 / 6**0.5
            assert 0 < model.fc.weight.abs().max() <= bound
        model(torch.randn(3, 6)).sum().backward()


def case_partial_user_init_is_refused(rank, world):
    def init(m):  # forgets the buffer and leaves half of the gain
        if isinstance(m, nn.Linear):
            m.reset_parameters()
        elif isinstance(m, Scale):
            m.gain[:3].fill_(1.0)

    with pytest.raises(RuntimeError, match=r"parameter 'scale\.gain' of Scale, buffer 'offset' of Net: the init"):
        memfit.materialize(sharded_on_meta(), init=init)


CASES = [
    case_transformers_models_get_their_own_init,
    case_uninitialised_module_is_refused_by_name,
    case_user_init_fills_every_tensor,
    case_partial_user_init_is_refused,
]
GROUP = Subtests(CASES, timeout=600)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_materialize(case):
    GROUP.check(case, 2)
