"""`memfit plan`'s header and verdict: the shape once and resolved, the device profile that
prices the step (the named one by default, never a cached calibration), what to change for one
process and for a sharded layout, and hybrid-sharded layouts."""

import json
import re
import sys

import torch.distributed as dist

import memfit
from memfit._plan._calibrate import device_profile
from memfit._plan._time import PROFILES
from memfit.cli import main
from memfit.models import Shape, llama_lm, lm_batch

TINY = ["--model", "llama", "--layers", "2", "--hidden", "64", "--seq", "16", "--batch", "2"]


def _absurd_calibration(tmp_path, monkeypatch):
    """A cached calibration 1000x slower than the fixed CPU profile, as one made under load."""
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    slow = memfit.DeviceProfile("calibrated-cpu", {"float32": 5e7}, 1e7, 1e6, 1e-2, "measured under load")
    (tmp_path / "device-cpu.json").write_text(json.dumps(slow.__dict__))
    return slow


def test_a_cached_calibration_is_used_only_when_asked_for(tmp_path, monkeypatch):
    slow = _absurd_calibration(tmp_path, monkeypatch)
    assert device_profile(None) == PROFILES["cpu"]  # the default: the named profile, not the cache
    assert device_profile("calibrated") == slow
    shape = Shape(layers=2, hidden=32, heads=4, seq=16, batch=2, vocab=256, dropout=0.0)
    model, batch = llama_lm(shape), lm_batch(shape)
    default = memfit.plan(model, batch, budget="1GB")
    assert default.profile.device == "cpu" and "fixed rates" in default.profile.device_source
    asked = memfit.plan(model, batch, budget="1GB", device_profile="calibrated")
    assert asked.profile.device == "calibrated-cpu"
    assert asked.predicted_step_time > 100 * default.predicted_step_time
    assert "time on cpu (fixed rates" in default.table()


def test_plan_header_names_the_profile_and_the_resolved_shape_once(tmp_path, monkeypatch, capsys):
    _absurd_calibration(tmp_path, monkeypatch)
    assert main(["plan", *TINY, "--budget", "1GB"]) == 0
    out = capsys.readouterr().out
    assert out.count("Shape(") == 1
    assert "intermediate=128, kv_heads=2" in out and "intermediate=0" not in out  # Llama's 8/3 x 64 // 64 * 64
    assert "time priced on: cpu (the default for this machine's cpu" in out
    assert "calibrated-cpu" not in out
    assert main(["plan", *TINY, "--budget", "1GB", "--device-profile", "h100"]) == 0
    assert "time priced on: h100 (NVIDIA H100 SXM data sheet)" in capsys.readouterr().out


def _change(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("what to change:"))


def test_what_to_change_for_one_process_and_for_ranks():
    shape = Shape(layers=4, hidden=64, heads=4, seq=128, batch=4, vocab=256, dropout=0.0)  # activations dominate
    model, batch = llama_lm(shape), lm_batch(shape)
    probe = memfit.plan(model, batch, budget="1GB", device_profile="cpu")
    assert _change(probe.table()) == "what to change: nothing: every activation is kept (no recompute)"
    keep_all = probe.predicted_peak
    full = memfit.Plan.fixed(dict.fromkeys(probe.decisions, "full"), probe.profile).predicted_peak
    one = memfit.plan(model, batch, budget=(keep_all + full) // 2, profile=probe.profile)
    change = _change(one.table())
    assert "more memory keeps every activation (no recompute)" in change and "per rank" not in change
    # Sharding over 2 processes frees the parameters and AdamW state: enough to keep everything?
    fits_at_2 = memfit.plan(model, batch, budget=one.budget, world_size=2, profile=probe.profile)
    if "nothing" not in _change(fits_at_2.table()):
        assert "more per rank keeps every activation" in _change(fits_at_2.table())
    else:
        assert "or world size 2 (memfit.shard over that many processes) keeps them within the budget" in change
    sharded = memfit.plan(model, batch, budget=(keep_all + full) // 2 - 2**20, world_size=4, profile=probe.profile)
    text = sharded.table()
    assert "per rank (world size 4)" in text and "memory keeps" not in _change(text)


def test_hybrid_layout_forecasts_as_sharding_over_the_shard_group(capsys):
    assert main(["plan", *TINY, "--budget", "1GB", "--world-size", "16", "--shard-size", "8"]) == 0
    hsdp = capsys.readouterr().out
    assert "world size 16 as 2 replicas x 8 shards (hybrid sharding)" in hsdp
    assert "per rank (world size 16: 2 replicas x 8 shards)" in hsdp
    assert main(["plan", *TINY, "--budget", "1GB", "--world-size", "8"]) == 0
    eight = capsys.readouterr().out
    peak = lambda out: out.split("predicted peak ")[1].split(" at ")[0]  # noqa: E731
    assert peak(hsdp) == peak(eight)  # per-rank bytes depend on the shard group only
    assert main(["plan", *TINY, "--budget", "1GB", "--world-size", "16", "--shard-size", "3"]) == 2
    assert "--shard-size 3 must divide --world-size 16" in capsys.readouterr().err


def test_main_called_from_a_program_leaves_its_process_group(tmp_path, monkeypatch, capsys):
    # memfit.cli.main() is also called from users' own scripts: only the memfit program
    # (memfit.cli.program: the console command, python -m memfit) ends the process group.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(sys, "argv", ["memfit", "plan", *TINY, "--budget", "1GB"])
        assert main() == 0
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()
    capsys.readouterr()


def _tiny_config(directory, **sizes):
    from transformers import GPT2Config

    config = dict(n_positions=64, n_embd=32, n_layer=2, n_head=2, vocab_size=300, bos_token_id=0, eos_token_id=0)
    GPT2Config(**{**config, **sizes}).save_pretrained(directory)  # writes directory/config.json
    return directory / "config.json"


FACTORY = """
from transformers import GPT2Config, GPT2LMHeadModel

def build():
    return GPT2LMHeadModel(GPT2Config(n_positions=64, n_embd=32, n_layer=3, n_head=2, vocab_size=300))
"""


def test_plan_bench_and_train_take_the_same_model_specs(tmp_path, monkeypatch, capsys):
    # One resolver (memfit.models._spec.resolve) reads --model for every command: a preset, a
    # config.json or its directory, pkg.module:function. The planner builds them on the meta device.
    from memfit.cli import BenchConfig, TrainConfig, parse_config
    from memfit.models._spec import resolve

    file = _tiny_config(tmp_path)
    (tmp_path / "user_models.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve(str(file)).about == resolve(str(tmp_path)).about == f"gpt2 from {file}"
    for spec, about, blocks in [
        (str(tmp_path), f"gpt2 from {file}", "\ntransformer.h.1 "),  # 2 blocks
        # 3 blocks, each a row: the first keeps less (its input, the embeddings' output, is counted
        # before the blocks) and a run of 2 is not folded
        ("user_models:build", "what user_models:build() returns", "\ntransformer.h.2 "),
    ]:
        assert main(["plan", "--model", spec, "--budget", "1GB", "--batch", "2", "--seq", "32"]) == 0
        out = capsys.readouterr().out
        assert f"{spec}: {about}\nbatch 2 x seq 32 per rank" in out
        assert blocks in out and "fits, predicted peak" in out
    for spec, seq in [(str(file), 64), (str(tmp_path), 64), ("user_models:build", 128), ("gpt2", 128)]:
        # a config's default seq: 128, or its positions if fewer
        assert BenchConfig(model=spec).spec.seq == TrainConfig(model=spec).spec().seq == seq
        assert parse_config(["plan", "--model", spec, "--budget", "1GB"]).spec().name == spec
    for command in ("plan", "bench", "train"):
        argv = [command, "--model", "no-such-model", *(["--budget", "1GB"] if command == "plan" else [])]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"memfit {command}: unknown model 'no-such-model'" in err and "config.json" in err and ":function" in err


def test_a_config_whose_vocabulary_the_batch_exceeds_is_refused(tmp_path, capsys):
    # The CLI's batch is byte tokens (ids up to 255; this one's largest is above 100): a
    # 100-token vocabulary cannot take it.
    _tiny_config(tmp_path, vocab_size=100)
    assert main(["plan", "--model", str(tmp_path), "--budget", "1GB"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"example_inputs\['input_ids'\] holds 1\d\d, but the model's vocabulary size is 100", err)
    assert main(["plan", "--model", str(tmp_path / "config.json"), "--budget", "1GB", "--seq", "65"]) == 2
    assert "has 65 positions (shape [8, 65]) but the model learned 64" in capsys.readouterr().err


def test_plan_ends_with_the_run_that_applies_it(tmp_path, capsys):
    from memfit.cli import parse_config

    argv = ["plan", *TINY, "--budget", "1GB", "--world-size", "4", "--shard-size", "2"]
    assert main(argv) == 0
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    flags = "--model llama --layers 2 --hidden 64 --seq 16 --batch 2 --checkpointing keep --hybrid-shards 2"
    assert last == f"run it: torchrun --nproc-per-node 4 -m memfit train {flags}"
    run = tmp_path / "run.toml"
    assert main([*argv, "--emit", str(run)]) == 0
    out = capsys.readouterr().out.rstrip().splitlines()
    assert out[-1] == f"run it: torchrun --nproc-per-node 4 -m memfit train --config {run}"
    assert "memfit train applies one kind to every block: --checkpointing keep predicts" in out[-2]
    train = parse_config(["train", "--config", str(run)])  # what `memfit train --config` reads
    assert (train.model, train.layers, train.hidden, train.seq, train.batch) == ("llama", 2, 64, 16, 2)
    assert (train.checkpointing, train.hybrid_shards) == ("keep", 2)
    assert main(["plan", *TINY, "--budget", "1GB", "--emit", str(tmp_path / "run.json")]) == 2
    assert "--emit" in capsys.readouterr().err


def test_the_blocks_of_a_spec_are_its_repeated_layers():
    # BERT's _no_split_modules lists BertEmbeddings beside BertLayer: the first one found (the
    # embeddings) was taken for the block by bench and train.
    import torch

    from memfit.models import PRESETS
    from memfit.models._spec import layer_class

    for name in ("bert", "gpt2", "llama"):
        for layers in (1, 2):
            with torch.device("meta"):
                model = PRESETS[name].resized(layers=layers, hidden=32).build()
            assert layer_class(model) is PRESETS[name].layer_class(), (name, layers)


def test_bf16_mixed_precision_plans_as_memfit_computes_and_runs_with_its_flag(tmp_path, capsys):
    """--mixed-precision bf16 forecasts memfit train's flag (bf16 compute from fp32 masters):
    the fp32 shards and optimizer state per rank, gathered copies of half the bytes (the
    norm layers' stay fp32), and the command that runs the plan carries the flag; bf16 masters
    beside it are refused by name."""
    out, terms = {}, {}
    for mixed in ("no", "bf16"):
        path = tmp_path / f"{mixed}.json"
        argv = ["plan", *TINY, "--budget", "1GB", "--world-size", "2", "--json", str(path)]
        assert main([*argv, "--mixed-precision", mixed]) == 0
        out[mixed], terms[mixed] = capsys.readouterr().out, json.loads(path.read_text())["terms"]
    assert "fp32 parameters, gradients and optimizer state" in out["no"]
    assert "bf16 compute (torch.nn norm layers fp32), fp32 master weights, gradients and optimizer state" in out["bf16"]
    # the same fp32 shards and optimizer state; buffers in bf16 (the rotary inv_freq: 32 bytes less)
    assert 0 <= terms["no"]["state"] - terms["bf16"]["state"] <= 64
    assert terms["bf16"]["gather_buffers"] * 2 == terms["no"]["gather_buffers"]  # HF RMSNorm: not torch's, bf16 too
    assert "train --model llama --layers 2 --hidden 64 --seq 16 --batch 2 --mixed-precision bf16 --plan" in out["bf16"]
    assert "--mixed-precision" not in out["no"].splitlines()[-1]
    assert main(["plan", *TINY, "--budget", "1GB", "--dtype", "bf16", "--mixed-precision", "bf16"]) == 2
    err = capsys.readouterr().err
    assert "--mixed-precision bf16 keeps fp32 master weights and computes in bf16: drop --dtype bf16" in err
    # replicated under bf16: forecast (gradients summed in fp32), as sharded
    argv = ["plan", *TINY, "--budget", "1GB", "--world-size", "2", "--shard-size", "1", "--mixed-precision", "bf16"]
    assert main(argv) == 0
    assert "2 replicas x 1 shards" in capsys.readouterr().out
