"""One module-selection policy ([Note: One module-selection policy]): every spelling selects
the same modules for activation checkpointing and for sharding's auto_wrap_policy."""

import pytest
from torch import nn

import memfit
from memfit._select import check, resolve, select
from memfit._shard._init import wrap_selector


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(self.fc(x))


def net():
    return nn.Sequential(nn.Linear(4, 4), *[Block() for _ in range(4)], nn.Linear(4, 2))


POLICIES = [
    Block,
    (Block, nn.LayerNorm),
    {Block},
    frozenset({nn.LayerNorm}),
    [nn.Linear],
    memfit.every_nth(2, Block),
    lambda m: isinstance(m, nn.LayerNorm),
    24,  # at least 24 parameters: a Block (20 + 8 = 28) and the Linear(4, 4)s (20), not a LayerNorm (8)
]
EXPECTED = [
    ["1", "2", "3", "4"],
    ["1", "1.norm", "2", "2.norm", "3", "3.norm", "4", "4.norm"],
    ["1", "2", "3", "4"],
    ["1.norm", "2.norm", "3.norm", "4.norm"],
    ["0", "1.fc", "2.fc", "3.fc", "4.fc", "5"],
    ["1", "3"],
    ["1.norm", "2.norm", "3.norm", "4.norm"],
    ["", "1", "2", "3", "4"],
]


@pytest.mark.parametrize("policy, expected", list(zip(POLICIES, EXPECTED)))
def test_checkpointing_and_sharding_select_the_same_modules(policy, expected):
    model = net()
    chosen = [n for n, _ in select(policy, model, "test", "policy")]
    assert chosen == expected
    unit = wrap_selector(resolve(policy, model))  # sharding: each selected submodule a unit
    assert [n for n, m in model.named_modules() if unit(m)] == expected
    outermost = [n for n in expected if not any(n.startswith(o + ".") or o == "" for o in expected if o != n)]
    assert memfit.apply_activation_checkpointing(net(), policy) == outermost


@pytest.mark.parametrize(
    "policy, error, message",
    [
        (True, TypeError, r"^w: policy must not be a bool"),
        (-1, ValueError, r"^w: policy=-1; an int is a minimum parameter count"),
        ("Block", TypeError, r"^w: policy must be a module class, a tuple of module classes"),
        ({"Block"}, TypeError, r"^w: policy must be a module class or a tuple of module classes"),
        ((), TypeError, r"^w: policy must be a module class or a tuple of module classes"),
        ((Block, "x"), TypeError, r"tuple of module classes"),
    ],
)
def test_one_refusal_per_bad_policy(policy, error, message):
    with pytest.raises(error, match=message):
        check(policy, "w", "policy")
    with pytest.raises(error, match=message.replace("^w: policy", "auto_wrap_policy")):
        memfit.ShardOptions(auto_wrap_policy=policy)
    with pytest.raises(error, match=message.replace("^w: ", "memfit.apply_activation_checkpointing: ")):
        memfit.apply_activation_checkpointing(net(), policy)
