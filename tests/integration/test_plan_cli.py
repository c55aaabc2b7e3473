"""`memfit plan`'s header and verdict: the shape once and resolved, the device profile that
prices the step (the named one by default, never a cached calibration), what to change for one
process and for a sharded layout, and hybrid-sharded layouts."""

import json
import sys

import torch.distributed as dist

import memfit
from memfit.cli import main
from memfit.models import Shape, llama_lm, lm_batch
from memfit.testing import PROFILES, device_profile

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
