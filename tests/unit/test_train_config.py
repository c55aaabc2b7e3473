"""`memfit train`'s configuration: a TOML or YAML file equivalent to the flags, flags override
it; --help shows defaults; --version; what --model accepts."""

import pytest

import memfit
from memfit.cli import TrainConfig, main, parse_config

TOML = """
model = "gpt2"
steps = 50
lr = 1e-3
checkpoint-dir = "ck"
save_every = 10
resume = "auto"
"""


def test_toml_and_yaml_files_equal_the_flags_and_flags_override(tmp_path):
    toml, yaml = tmp_path / "run.toml", tmp_path / "run.yaml"
    toml.write_text(TOML)
    yaml.write_text(
        "train:\n  model: gpt2\n  steps: 50\n  lr: 1.0e-3\n  checkpoint-dir: ck\n  save_every: 10\n  resume: auto\n"
    )
    flags = ["--model", "gpt2", "--steps", "50", "--lr", "1e-3", "--checkpoint-dir", "ck", "--save-every", "10"]
    want = parse_config(["train", *flags, "--resume", "auto"])
    assert parse_config(["train", "--config", str(toml)]) == want
    assert parse_config(["train", "--config", str(yaml)]) == want
    assert parse_config(["train", "--config", str(toml), "--steps", "7"]).steps == 7  # the flag wins


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("stepz = 3", "unknown key 'stepz' for `memfit train`"),
        ('resume = "maybe"', "resume must be one of"),
        ("steps = ", "is not valid"),
    ],
)
def test_config_file_errors(tmp_path, capsys, text, message):
    (tmp_path / "bad.toml").write_text(text)
    assert main(["train", "--config", str(tmp_path / "bad.toml")]) == 2
    assert message in capsys.readouterr().err


def test_help_shows_defaults_and_version(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--steps STEPS optimizer steps in all (default: 20)" in text
    assert "(default: 3e-4)" in text or "(default: 0.0003)" in text
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"memfit {memfit.__version__}"


def test_model_names_a_preset_a_config_or_a_factory(tmp_path):
    assert TrainConfig(model="gpt2").spec().arch == "causal"
    assert TrainConfig(model="bert").spec().arch == "bert"
    with pytest.raises(ValueError, match=r"unknown model 't5'; choose one of .*config\.json path.*, or a factory"):
        TrainConfig(model="t5")
    with pytest.raises(ValueError, match=r"cannot import the model factory 'nowhere\.at_all:build'"):
        TrainConfig(model="nowhere.at_all:build")
    with pytest.raises(ValueError, match="no such file"):
        TrainConfig(model=str(tmp_path / "config.json"))
