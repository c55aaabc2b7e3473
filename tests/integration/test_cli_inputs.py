"""Bad inputs to `memfit plan`, `train` and `bench`: each is refused with one line on stderr
that names the flag and says what to pass, exit status 2, before anything runs (See [Note: One
line per bad input] in memfit/cli/_config.py). Never a traceback, never a default in its place."""

import pytest
import torch.distributed as dist

from memfit.cli import main

TINY = ["--layers", "2", "--hidden", "32"]
COMMANDS = {
    "plan": ["plan", "--budget", "1GB"],
    "train": ["train", "--steps", "1", "--device", "cpu"],
    "bench": ["bench", "--strategies", "keep", "--repeats", "1", "--warmup", "1", "--device", "cpu"],
}


def _refused(argv: list[str], capsys) -> str:
    """The one line ``argv`` is refused with (exit status 2)."""
    try:
        assert main(argv) == 2, argv
    finally:
        if dist.is_initialized():  # train joined a group of one before its model was built
            dist.destroy_process_group()
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    return lines[0]


def _gpt2_config(directory, positions: int = 64):
    from transformers import GPT2Config

    config = dict(n_positions=positions, n_embd=32, n_layer=2, n_head=2, vocab_size=300, bos_token_id=0, eos_token_id=0)
    GPT2Config(**config).save_pretrained(directory)
    return str(directory / "config.json")


@pytest.mark.parametrize("command", [*COMMANDS, "bench --world-size 2"])
def test_a_sequence_longer_than_the_learned_positions_is_refused_without_a_budget(command, tmp_path, capsys):
    # train without --budget runs no planner: its check used to be the first step's IndexError;
    # bench on ranks checks before it spawns them (on the meta device)
    config = _gpt2_config(tmp_path)
    argv = ["bench", "--world-size", "2", "--device", "cpu"] if " " in command else COMMANDS[command]
    command = command.split()[0]
    line = _refused([*argv, "--model", config, "--seq", "128", "--batch", "2"], capsys)
    assert f"memfit {command}: --batch 2 x --seq 128 cannot run through the model" in line
    assert "has 128 positions" in line and "the model learned 64" in line and "at most 64 tokens" in line


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("flag", ["--batch", "--seq", "--layers", "--hidden"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_sizes_below_one_are_refused_never_replaced_by_the_default(command, flag, value, capsys):
    shape = {**dict(zip(TINY[::2], TINY[1::2])), flag: value}
    line = _refused([*COMMANDS[command], "--model", "gpt2", *[a for kv in shape.items() for a in kv]], capsys)
    assert line == (
        f"error: memfit {command}: {flag} {value}: pass a whole number of at least 1, or leave {flag} out for the "
        "model's own"
    )


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("budget", ["-1GB", "-1", "0GB"])
def test_a_budget_that_is_not_positive_reaches_the_check(command, budget, capsys):
    argv = COMMANDS[command]
    if command == "plan":
        argv = [a for a in argv if a not in ("--budget", "1GB")]
    line = _refused([*argv, *TINY, "--model", "gpt2", "--budget", budget], capsys)
    assert line.startswith(f"error: memfit {command}: --budget {budget}: a memory budget must be positive")
    assert "pass a positive size, e.g. 80GB" in line


@pytest.mark.parametrize("command", COMMANDS)
def test_a_vision_config_is_refused_with_what_memfit_takes(command, tmp_path, capsys):
    from transformers import ViTConfig

    ViTConfig().save_pretrained(tmp_path)
    line = _refused([*COMMANDS[command], "--model", str(tmp_path)], capsys)
    assert f"memfit {command}: --model {str(tmp_path)!r} is a vit config (ViTConfig)" in line
    assert "memfit trains language models: pass a causal LM config" in line and "pkg.module:function" in line
    assert len(line) < 400  # not transformers' list of every class it builds


def test_argparse_errors_are_one_line_naming_the_flag(capsys):
    # argparse exits (status 2) itself; main() lets its SystemExit through, as for --help
    for argv, message in [
        (["train", "--batch", "two"], "memfit train: error: argument --batch: invalid int value: 'two'"),
        (["plan"], "memfit plan: error: the following arguments are required: --budget"),
    ]:
        with pytest.raises(SystemExit) as stopped:
            main(argv)
        assert stopped.value.code == 2
        command = " ".join(argv[:1])
        assert capsys.readouterr().err == f"{message}; `memfit {command} --help` lists the flags\n"


@pytest.mark.parametrize(
    "flag, value",
    [("--clip", "-1"), ("--clip", "0"), ("--lr", "-1"), ("--val-fraction", "1.5")],
)
def test_train_refuses_a_clip_rate_or_share_that_would_train_wrongly(flag, value, capsys):
    line = _refused([*COMMANDS["train"], *TINY, flag, value], capsys)
    assert flag in line and "must be" in line, line
