"""The CLI's flags declared once: `memfit train`'s parser is generated from TrainConfig's fields
(memfit.cli._flags.add_flags), and the decision-kind choices come from memfit.DecisionKind."""

import argparse
import dataclasses
import json

import pytest

import memfit
from memfit.cli import BenchConfig, PlanConfig, TrainConfig, _parser, main, parse_config
from memfit.cli._bench import STRATEGIES
from memfit.cli._config import CalibrateConfig
from memfit.cli._flags import add_flags, flag, flag_name


def train_parser() -> argparse.ArgumentParser:
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["train"]


def test_every_field_is_a_flag_and_every_flag_a_field():
    fields = {f.name: f for f in dataclasses.fields(TrainConfig) if f.init}
    actions = {a.dest: a for a in train_parser()._actions if a.dest not in ("help", "config")}
    assert set(actions) == set(fields)
    for name, f in fields.items():
        action = actions[name]
        assert action.option_strings == [flag_name(name)]
        assert action.default == f.default, name
        assert action.help == f.metadata["help"], name
    assert parse_config(["train"]) == TrainConfig()  # the parser's defaults are the fields'


def test_help_shows_every_flag_with_its_help(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = "".join(capsys.readouterr().out.split())  # without the line breaks (argparse breaks at hyphens)
    for f in dataclasses.fields(TrainConfig):
        assert flag_name(f.name) in text
        assert "".join(f.metadata["help"].split()) in text, f.name


def test_a_config_round_trips_through_its_flags():
    cfg = TrainConfig(
        model="gpt2",
        data="corpus.txt",
        tokenizer="tok.json",
        val_fraction=0.25,
        eval_every=3,
        eval_batches=2,
        steps=9,
        lr=1e-3,
        warmup=1,
        accumulate=2,
        clip=0.5,
        checkpointing="selective",
        hybrid_shards=2,
        layers=2,
        hidden=32,
        seq=16,
        batch=4,
        seed=7,
        checkpoint_dir="ck",
        save_every=3,
        keep_last=2,
        async_save=True,
        resume="auto",
        export="out",
        log_every=2,
        metrics="m.jsonl",
        tensorboard="tb",
        json="run.json",
        device="cpu",
    )
    # --overwrite and --resume exclude each other, and so do --global-batch and --accumulate
    fresh = dataclasses.replace(cfg, resume="no", overwrite=True, accumulate=1, global_batch=8)
    # --auto chooses --batch, --accumulate and --hybrid-shards; --budget and --plan exclude --checkpointing
    auto = dataclasses.replace(
        fresh, checkpointing=None, budget="1GB", auto=True, batch=None, hybrid_shards=0, trials=3
    )
    planned = dataclasses.replace(fresh, checkpointing=None, plan="plan.json", mixed_precision="bf16")
    # the tiers of the model state are planned for a --budget (the disk: a directory that exists)
    tiered = dataclasses.replace(
        fresh, checkpointing=None, budget="1GB", host_budget="2GB", disk=".", disk_budget="3GB", disk_bandwidth="1GB"
    )
    defaults = TrainConfig()
    exercised = set()
    for config in (cfg, fresh, auto, planned, tiered):
        changed = [
            f.name for f in dataclasses.fields(TrainConfig) if getattr(config, f.name) != getattr(defaults, f.name)
        ]
        exercised.update(changed)
        argv = []
        for name in changed:
            value = getattr(config, name)
            argv += [flag_name(name)] if value is True else [flag_name(name), str(value)]  # a bool is a switch
        assert parse_config(["train", *argv]) == config
    assert exercised == {f.name for f in dataclasses.fields(TrainConfig)}  # every field is exercised


def test_checkpointing_choices_are_the_decision_kinds(capsys):
    (action,) = [a for a in train_parser()._actions if a.dest == "checkpointing"]
    kinds = [k.value for k in memfit.DecisionKind]
    assert list(action.choices) == [k for k in kinds if k != "offload"]
    assert list(STRATEGIES) == [*kinds, "planned"]
    assert parse_config(["train", "--checkpointing", "keep"]).checkpointing == "keep"
    with pytest.raises(SystemExit):
        parse_config(["train", "--checkpointing", "recompute"])
    assert "invalid choice: 'recompute' (choose from keep, selective, full)" in capsys.readouterr().err.replace(
        "'keep', 'selective', 'full'", "keep, selective, full"
    )


def test_the_old_none_spelling_still_works_with_a_warning(tmp_path):
    with pytest.warns(FutureWarning, match="'none' is now spelt 'keep'"):
        assert parse_config(["train", "--checkpointing", "none"]).checkpointing == "keep"
    with pytest.warns(FutureWarning, match="'none' is now spelt 'keep'"):
        assert TrainConfig(checkpointing="none").checkpointing == "keep"
    (tmp_path / "run.toml").write_text('checkpointing = "none"\n')
    with pytest.warns(FutureWarning, match="'none' is now spelt 'keep'"):
        assert parse_config(["train", "--config", str(tmp_path / "run.toml")]).checkpointing == "keep"
    with pytest.warns(FutureWarning, match="'none' is now spelt 'keep'"):
        assert BenchConfig(strategies=("none", "full")).strategies == ("keep", "full")


def test_decision_kinds_are_strings():
    kind = memfit.DecisionKind.FULL
    assert kind == "full" and str(kind) == f"{kind}" == "full" and json.dumps({"k": kind}) == '{"k": "full"}'
    assert memfit.Decision("full").kind is kind and memfit.Decision.parse("none").kind is memfit.DecisionKind.KEEP
    assert {"full": 1}[kind] == 1


def test_add_flags_reads_types_and_metadata():
    @dataclasses.dataclass
    class Config:
        name: str = dataclasses.field(default="a", metadata=flag("a name", choices=["a", "b"]))
        count: int | None = dataclasses.field(default=None, metadata=flag("how many"))
        rate: float = dataclasses.field(default=0.5, metadata=flag("how fast"))
        loud: bool = dataclasses.field(default=False, metadata=flag("say more"))

    p = argparse.ArgumentParser()
    add_flags(p, Config)
    args = p.parse_args(["--name", "b", "--count", "3", "--rate", "2", "--loud"])
    assert Config(**vars(args)) == Config(name="b", count=3, rate=2.0, loud=True)
    assert Config(**vars(p.parse_args([]))) == Config()

    @dataclasses.dataclass
    class Bad:
        names: list = dataclasses.field(default_factory=list, metadata=flag("names"))

    with pytest.raises(TypeError, match=r"the flag of Bad\.names needs a str, int, float or bool field"):
        add_flags(argparse.ArgumentParser(), Bad)


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_commands_parser_is_its_config_read_back():
    """Each subcommand's flags are its config's fields and nothing else: the flag's name, default
    (a field without one is a required flag), help and choices are the field's, so every default
    is declared once, in memfit/cli/_config.py."""
    from memfit.cli import COMMANDS

    parsers = _subparsers()
    assert set(parsers) == set(COMMANDS)
    for name, (config, _) in COMMANDS.items():
        fields = {f.name: f for f in dataclasses.fields(config) if f.init}
        actions = {a.dest: a for a in parsers[name]._actions if a.dest not in ("help", "config")}
        assert set(actions) == set(fields), name
        for dest, f in fields.items():
            action, where = actions[dest], f"{name} {flag_name(dest)}"
            assert action.option_strings == [flag_name(dest)], where
            assert action.help == f.metadata["help"], where
            required = f.default is dataclasses.MISSING
            assert action.required is required, where
            assert required or action.default == f.default, where
            assert action.choices == f.metadata.get("choices"), where
    plan = parse_config(["plan", "--budget", "2GB"])
    assert plan == PlanConfig(budget="2GB")  # the parser's defaults are the fields'
    assert parse_config(["bench"]) == BenchConfig() and parse_config(["calibrate"]) == CalibrateConfig()
    assert parse_config(["bench", "--strategies", "keep", "full"]).strategies == ("keep", "full")


def test_the_parser_declares_no_flag_of_its_own():
    """memfit/cli/__init__.py calls add_flags only: no add_argument, no literal default."""
    import ast
    import pathlib

    import memfit.cli

    tree = ast.parse(pathlib.Path(memfit.cli.__file__).read_text())
    calls = [ast.unparse(n.func).rsplit(".", 1)[-1] for n in ast.walk(tree) if isinstance(n, ast.Call)]
    assert "add_argument" not in calls and "add_flags" in calls


def test_no_import_cycle_in_the_cli_counting_type_only_imports():
    """The commands import their configs from memfit/cli/_config.py, which imports no command:
    no cycle among memfit.cli's modules even with the imports under TYPE_CHECKING (train ->
    choose -> train and train -> checkpoints -> train closed two)."""
    import ast
    import pathlib

    import memfit.cli

    root = pathlib.Path(memfit.cli.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in root.glob("*.py"):
        name = f"memfit.cli.{path.stem}" if path.stem != "__init__" else "memfit.cli"
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):  # every import, TYPE_CHECKING ones too
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("memfit.cli"):
                for a in node.names:  # `from memfit.cli import _checkpoints` imports the submodule
                    sub = f"{node.module}.{a.name}"
                    targets.add(sub if (root / f"{a.name}.py").exists() else node.module)
        graph[name] = {t for t in targets if t != name}
    graph = {m: {t for t in ts if t in graph} for m, ts in graph.items()}
    assert "memfit.cli._config" in graph["memfit.cli._train"]  # the scan sees imports

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(t == goal or (t not in seen and not seen.add(t) and reaches(t, goal, seen)) for t in graph[start])

    cyclic = sorted(m for m in graph if m != "memfit.cli" and reaches(m, m, set()))
    assert cyclic == [], cyclic
