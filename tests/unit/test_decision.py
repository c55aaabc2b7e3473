"""memfit.Decision (keep / selective / full / offload as a value) and the every_nth policy."""

import dataclasses

import pytest
from torch import nn

import memfit
from memfit import Decision
from memfit._plan._profile import DECISIONS


def small():
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Linear(4, 2))


def names(m):
    return [n for n, _ in m.named_parameters()], list(m.state_dict()), [n for n, _ in m.named_modules()]


def checkpointed(m):
    return [n for n, sub in m.named_modules() if "forward" in sub.__dict__]


def test_kinds_and_names():
    assert DECISIONS == ("keep", "selective", "full", "offload")
    assert [str(Decision(k)) for k in DECISIONS] == list(DECISIONS)
    assert [Decision(k).checkpointed for k in DECISIONS] == [False, True, True, True]


def test_parse_fills_defaults_and_drops_options_the_kind_does_not_take():
    assert Decision.parse("none") == Decision("keep")  # the CLI's name for keep
    assert Decision.parse("selective") == Decision("selective", save="linear")
    assert Decision.parse("offload") == Decision("offload", offload="disk")
    assert Decision.parse("full", save="linear", offload="cpu") == Decision("full")
    assert Decision.parse("selective", save="matmul", offload="cpu") == Decision("selective", save="matmul")
    assert Decision.parse("offload", save="all", offload="cpu") == Decision("offload", offload="cpu")
    assert Decision.parse("selective", save=None).save == "linear"  # None means the default
    d = Decision("full")
    assert Decision.parse(d) is d
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.kind = "keep"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "fast"}, r"unknown kind 'fast'; choose from \('keep', 'selective', 'full', 'offload'\)"),
        ({"kind": "none"}, r"unknown kind 'none'"),  # only parse() reads the CLI's name
        ({"kind": "full", "save": "linear"}, r"save= is only for kind 'selective', not 'full'"),
        ({"kind": "keep", "save": "all"}, r"save= is only for kind 'selective', not 'keep'"),
        ({"kind": "selective", "offload": "cpu"}, r"offload= is only for kind 'offload', not 'selective'"),
        ({"kind": "keep", "offload": "disk"}, r"offload= is only for kind 'offload', not 'keep'"),
    ],
)
def test_invalid_decisions_say_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Decision(**kwargs)
    with pytest.raises(ValueError, match="unknown kind 'fast'"):
        Decision.parse("fast")


def test_apply_and_remove_keep_names():
    model = small()
    before = names(model)
    block = model[2]
    assert Decision("full").apply(block) is block
    assert checkpointed(model) == ["2"]
    assert Decision("selective", save="matmul").apply(block) is block  # replaces, no "already" error
    assert block.forward.save == "matmul"
    assert Decision("keep").apply(block) is block  # keep removes checkpointing
    assert checkpointed(model) == []
    assert names(model) == before


def test_apply_to_selects_by_policy():
    model = small()
    before = names(model)
    assert Decision("full").apply_to(model, nn.Linear) == ["0", "2.0", "3"]
    assert checkpointed(model) == ["0", "2.0", "3"]
    assert Decision("keep").apply_to(small(), nn.Linear) == []  # keep checkpoints nothing
    assert names(model) == before
    assert memfit.remove_checkpointing(model) == 3
    assert checkpointed(model) == []


def test_every_nth_counts_matches_in_named_modules_order():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(7)])
    paths = lambda policy: [n for n, _ in policy.select(model)]  # noqa: E731
    assert paths(memfit.every_nth(1, nn.Linear)) == [str(i) for i in range(7)]
    assert paths(memfit.every_nth(3, nn.Linear)) == ["0", "3", "6"]  # the 0th, 3rd, 6th match
    assert paths(memfit.every_nth(8, nn.Linear)) == ["0"]  # n beyond the count: the first only
    assert paths(memfit.every_nth(2, nn.ReLU)) == []
    nested = small()  # Linear at 0, 2.0, 3; Tanh at 2.1; ReLU at 1
    assert [n for n, _ in memfit.every_nth(2, (nn.Linear, nn.Tanh)).select(nested)] == ["0", "2.1"]


@pytest.mark.parametrize(
    ("n", "classes", "error", "message"),
    [
        (0, nn.Linear, ValueError, r"n must be an integer >= 1, got 0"),
        (2.0, nn.Linear, ValueError, r"n must be an integer >= 1, got 2\.0"),
        (1, "Linear", TypeError, r"every_nth: expected a module class or a tuple of module classes"),
        (1, (), TypeError, r"every_nth: expected a module class"),
        (1, (nn.Linear, 3), TypeError, r"every_nth: expected a module class"),
    ],
)
def test_every_nth_validation(n, classes, error, message):
    with pytest.raises(error, match=message):
        memfit.every_nth(n, classes)


def test_each_kind_is_declared_once_and_the_lists_derive_from_it():
    """See [Note: Decision kinds as data]: every DecisionKind has its KindSpec; the kinds memfit
    train applies, the options Decision takes and the kinds the profile derives read it."""
    from memfit._checkpoint._decision import SPECS, TRAIN_KINDS
    from memfit.cli._choose import PLANNED_KINDS
    from memfit.cli._train import CHECKPOINTING

    assert list(SPECS) == list(memfit.DecisionKind)
    assert TRAIN_KINDS == PLANNED_KINDS == CHECKPOINTING == ("keep", "selective", "full")
    assert [k.spec.train_applies for k in memfit.DecisionKind] == [True, True, True, False]
    for kind, spec in SPECS.items():
        d = Decision(kind)
        assert {"save": d.save, "offload": d.offload} == {o: spec.default if o == spec.option else None
                                                         for o in ("save", "offload")}  # fmt: skip
        if spec.traced_as is not None:  # derived from a kind the profile runs itself
            assert SPECS[memfit.DecisionKind(spec.traced_as)].traced_as is None
    assert [k for k, s in SPECS.items() if s.traced_as] == ["offload"]
    with pytest.raises(ValueError, match="save= is only for kind 'selective', not 'full'"):
        Decision("full", save="linear")
    with pytest.raises(ValueError, match="offload= is only for kind 'offload', not 'selective'"):
        Decision("selective", offload="cpu")
    assert Decision.parse("offload", save="all", offload="cpu") == Decision("offload", offload="cpu")
