"""`memfit train`'s traps, one process: what a checkpoint path is when it is none, the schedule a
changed --steps would silently change, the save at the end, exported files' modes, Ctrl-C
outside the loop, the stop-request bookkeeping, the log's words, and the step's one host read.
(The signals end to end, under torchrun too: tests/distributed/test_train_preempt.py.)"""

import json
import math
import os
import signal
import stat
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import memfit
from memfit._shard._utils import clip_grads
from memfit.cli import TrainConfig, main
from memfit.cli._checkpoints import identity, schedule_change
from memfit.cli._data import batch_at, window_batch
from memfit.cli._log import RunLog
from memfit.cli._preempt import ECHO_S, StopRequests, agreed_signal, resume_command
from memfit.cli._train import _build, _save_due, _step, accumulation
from memfit.models import PRESETS
from memfit.models._spec import layer_class, loss_of, settle_loss_type
from memfit.testing import HostSyncCounter, end_process_group, meta_accelerator, sharded_units

TINY = {"layers": 2, "hidden": 32, "seq": 16, "batch": 4}


@pytest.fixture
def group_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    end_process_group()


def _fake_checkpoint(path):
    os.makedirs(path)
    for name in (".metadata", "memfit.json"):
        open(os.path.join(path, name), "w").close()


def test_load_checkpoint_says_what_the_path_is_instead(tmp_path):
    model = nn.Linear(2, 2)

    def message(path):
        with pytest.raises(FileNotFoundError) as e:
            memfit.load_checkpoint(str(path), model)
        return str(e.value)

    assert f"{str(tmp_path / 'nope')!r} does not exist" in message(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    assert "is a file; a memfit checkpoint is a directory" in message(tmp_path / "file")
    ck = tmp_path / "ck"
    for step in (2, 4):
        _fake_checkpoint(ck / f"step-{step:08d}")
    text = message(ck)
    assert "is a directory of checkpoints (step-00000002, step-00000004), not one checkpoint" in text, text
    assert f"e.g. the last: {str(ck / 'step-00000004')!r}" in text, text
    hf = tmp_path / "out" / "checkpoint-500"
    hf.mkdir(parents=True)
    (hf / "trainer_state.json").write_text("{}")
    text = message(hf)
    assert "is a Hugging Face Trainer checkpoint (trainer_state.json), not a memfit one; resume it" in text, text
    _fake_checkpoint(hf / "memfit")  # memfit's Trainer integration keeps its checkpoint inside
    assert f"the memfit checkpoint in it is {str(hf / 'memfit')!r}" in message(hf)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "0_0.distcp").write_text("")  # shards written, no metadata yet
    assert "is not a complete memfit checkpoint (no .metadata and memfit.json" in message(tmp_path / "half")


def test_a_changed_schedule_is_named_with_the_flags_that_keep_it():
    cfg = TrainConfig(steps=10, **TINY)
    was = identity(TrainConfig(steps=6, **TINY), "r")["config"]
    text = schedule_change(cfg, was, 4)
    assert text is not None
    assert "the run saved --steps 6, --warmup 2, --lr 0.0003, this one has --steps 10, --warmup 2" in text, text
    old, new = TrainConfig(steps=6, **TINY).lr_at(4), cfg.lr_at(4)
    assert f"(the lr of step 5: {old:.3e} -> {new:.3e})" in text and old != new, text
    assert text.endswith("to keep the saved schedule, pass --steps 6")
    assert schedule_change(cfg, identity(cfg, "r")["config"], 4) is None
    # a flag that is not the schedule's changes nothing here
    assert schedule_change(cfg, {**identity(cfg, "r")["config"], "clip": 0.5}, 4) is None


def test_a_checkpoint_dir_alone_saves_at_the_end():
    assert [d for d in range(1, 6) if _save_due(TrainConfig(checkpoint_dir="ck", steps=5), d)] == [5]
    every = TrainConfig(checkpoint_dir="ck", steps=5, save_every=2)
    assert [d for d in range(1, 6) if _save_due(every, d)] == [2, 4, 5]
    assert not any(_save_due(TrainConfig(steps=5), d) for d in range(1, 6))


def test_a_global_batch_the_ranks_cannot_share_is_refused_with_what_to_pass():
    assert accumulation(6, 1, 3) == 2 and accumulation(6, 2, 1) == 3
    with pytest.raises(ValueError, match=r"global batch of 6 sequences is not a multiple of --batch 4 x world size 1"):
        accumulation(6, 4, 1)
    with pytest.raises(ValueError, match=r"--global-batch must be >= 1, and sets --accumulate: pass one of the two"):
        TrainConfig(global_batch=8, accumulate=2)


def test_the_continue_command_swaps_resume_and_overwrite_for_resume_auto():
    argv = ["/x/memfit/__main__.py", "train", "--steps", "9", "--checkpoint-dir", "my ck", "--overwrite"]
    assert resume_command(argv) == "memfit train --steps 9 --checkpoint-dir 'my ck' --resume auto"
    assert resume_command(["memfit", "train", "--resume", "--steps", "3"]) == "memfit train --steps 3 --resume auto"
    assert resume_command(["memfit", "train", "--resume", "yes"]) == "memfit train --resume auto"
    assert resume_command(["memfit", "train", "--resume=auto"]) == "memfit train --resume auto"


def test_stop_requests_count_a_repeat_within_the_echo_window_once():
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when the suite runs in a background job
    with StopRequests(rank=0) as stop:
        assert stop.votes() == [0.0, 0.0]
        os.kill(os.getpid(), signal.SIGINT)  # handled at once, on this (the main) thread
        assert stop.votes() == [0.0, 1.0]
        os.kill(os.getpid(), signal.SIGTERM)  # within ECHO_S of the first: the same preemption
        assert stop.votes() == [0.0, 1.0]
        assert stop.first is not None and stop.first[0] == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is before  # restored
    assert ECHO_S <= 2.0
    # the ranks' summed votes: SIGTERM wins over SIGINT; none: go on
    assert agreed_signal([0.0, 2.0]) == signal.SIGINT
    assert agreed_signal([1.0, 1.0]) == signal.SIGTERM
    assert agreed_signal([0.0, 0.0]) is None


def interrupted():
    raise KeyboardInterrupt  # Ctrl-C while the model is built


def test_ctrl_c_outside_the_loop_prints_one_line(capsys):
    try:
        status = main(["train", "--model", f"{__name__}:interrupted", "--device", "cpu"])
    finally:
        end_process_group()
    assert status == 130
    err = capsys.readouterr().err
    assert err == "memfit: interrupted (Ctrl-C); exit status 130\n", err


def test_log_words_and_summary(capsys):
    log = RunLog(0, None, None)
    log.summary(1, 64, 3.0, [])
    log.summary(2, 1, 75.0, ["ck/step-00000001", "ck/step-00000002"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "trained 1 step, 64 tokens in 3s; 0 checkpoints written"
    assert out[1] == "trained 2 steps, 1 token in 1m15s; 2 checkpoints written (the last: ck/step-00000002)"
    entry = {"step": 2, "loss": 1.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 100.0, "step_s_slowest": 0.25}
    log.step_line({**entry, "slowest_rank": 1, "peak_bytes_per_rank": [2**20, 3 * 2**20]}, 9, 5)
    line = capsys.readouterr().out.strip()
    assert line.endswith("| 100 tok/s | 0.250 s/step | ETA 5s | peak 1.0-3.0 MiB per rank (highest: rank 1)"), line


def test_gpt2_names_its_loss_and_bert_is_sharded_by_its_layers():
    from transformers.loss.loss_utils import LOSS_MAPPING

    model = PRESETS["gpt2"].resized(layers=1, hidden=32).build(0)
    assert model.loss_type is None  # what makes transformers warn on every run
    settle_loss_type(model)
    assert model.loss_function is LOSS_MAPPING["ForCausalLM"]  # the loss transformers fell back to
    bert = PRESETS["bert"].resized(layers=2, hidden=32).build(0)
    assert layer_class(bert).__name__ == "BertLayer"  # not BertEmbeddings, which _no_split_modules names first


def test_exported_files_follow_the_umask(group_of_one, tmp_path):
    model = memfit.FullyShardedDataParallel(
        nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), options=memfit.ShardOptions(auto_wrap_policy={nn.Linear})
    )
    for mask, mode in ((0o022, 0o644), (0o027, 0o640)):
        old = os.umask(mask)
        try:
            memfit.export_safetensors(model, str(tmp_path / oct(mask)))
        finally:
            os.umask(old)
        files = sorted(os.listdir(tmp_path / oct(mask)))
        assert any(f.endswith(".safetensors") for f in files)
        assert {f: stat.S_IMODE(os.stat(tmp_path / oct(mask) / f).st_mode) for f in files} == dict.fromkeys(files, mode)


class _Copies(TorchDispatchMode):
    """Records the shapes of the tensors copied onto the meta device (the pretend accelerator)."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default) and out.is_meta:
            self.shapes.add(tuple(out.shape))
        return out


def test_the_trainer_puts_only_chunks_of_the_model_on_the_device():
    """The model is built in host memory and sharding copies to the device only each rank's rows
    (sync_module_states too: rank 0 broadcasts one rank's rows at a time): no parameter of two or
    more rows is ever copied there in full (a whole-model .to(device) did, and the broadcast of
    each full parameter)."""
    with meta_accelerator(2):
        with _Copies() as copied:
            run = _build(TrainConfig(device="cpu", **TINY), torch.device("meta"))
        full = {tuple(sp.shape) for u in sharded_units(run.model) for sp in u.params if sp.shape[0] >= 2}
        assert full and not full & copied.shapes, sorted(full & copied.shapes)[:4]
        assert {p.device.type for p in run.model.parameters()} == {"meta"}
        run.log.close()


def test_a_step_reads_the_device_once_beyond_the_librarys_reads(group_of_one):
    """The trainer's own host syncs in a steady-state step with --accumulate 3: one (the stop
    flag's read, which carries the loss and the gradient norm; before it, one .item() per
    micro-batch and one for the mean, and the clipping's read of its norm). The reference runs
    the same library calls without the trainer."""
    run = _build(TrainConfig(accumulate=3, device="cpu", **TINY), torch.device("cpu"))
    stop = StopRequests(rank=0)  # not entered: no handlers, no request
    for step in range(2):
        _step(run, step, False, stop)
    with HostSyncCounter() as trainer:
        entry, stopped = _step(run, 2, False, stop)
    assert stopped is None and entry["step"] == 3
    micro = [{k: v[:4] for k, v in _first_rows(run).items()} for _ in range(3)]
    with HostSyncCounter() as library:
        for i, mb in enumerate(micro):
            with run.model.no_sync() if i < 2 else torch.enable_grad():
                (loss_of(run.model, mb) / 3).backward()
        with HostSyncCounter() as clipping:
            clip_grads(run.model, 1e-3)  # small: the gradients are scaled
        run.opt.step()
        run.opt.zero_grad(set_to_none=True)
    # The clipping reads nothing (it read its norm once, before the trainer carried the norm in
    # its one read); the library's reads on the CPU: AdamW's step counts, the sharded step's checks.
    assert clipping.calls == []
    assert trainer.calls == [*library.calls, "tolist"], (trainer.calls, library.calls)


def _first_rows(run):
    from memfit.cli._data import window_batch

    return window_batch(run.tokens.train, run.spec.arch, 12, run.seq, 0, 0, run.tokens.mask_id)


def _kinds(model, paths) -> dict[str, str]:
    """The checkpointing applied to the blocks at ``paths``: keep, selective (a save rule) or full."""
    out = {}
    for path in paths:
        fwd = model.get_submodule(path).__dict__.get("forward")
        out[path] = "keep" if fwd is None else "selective" if getattr(fwd, "save", None) else "full"
    return out


def _micro_batch(run):
    return window_batch(run.tokens.train, run.spec.arch, run.batch, run.seq, 0, 0, run.tokens.mask_id)


KINDS = ("keep", "selective", "full")


def test_a_budget_trains_with_memfit_plans_decisions_within_it(group_of_one):
    """--budget plans the trainer's model on its first micro-batch (whole head, keep/selective/
    full) and applies the plan per block; a step's measured peak stays within the budget."""
    run = _build(TrainConfig(device="cpu", **TINY), torch.device("cpu"))
    keep = memfit.plan(run.spec.build(0), _micro_batch(run), budget="1TB", decisions=KINDS, chunk_head=False)
    full = memfit.Plan.fixed(dict.fromkeys(keep.decisions, "full"), keep.profile).predicted_peak
    budget = (full + keep.predicted_peak) // 2  # between all-full and keep-all
    run = _build(TrainConfig(device="cpu", budget=str(budget), **TINY), torch.device("cpu"))
    wanted = memfit.plan(run.spec.build(0), _micro_batch(run), budget=budget, decisions=KINDS, chunk_head=False)
    assert _kinds(run.model, wanted.decisions) == dict(wanted.decisions)
    assert set(wanted.decisions.values()) != {"keep"}, wanted.decisions  # the budget made it checkpoint
    stop = StopRequests(rank=0)
    _step(run, 0, False, stop)
    entry, _ = _step(run, 1, True, stop)  # the second step: AdamW state exists
    assert entry["peak_bytes"] <= budget, (entry["peak_bytes"], budget)


def test_a_budget_counts_the_gradients_accumulated_over_micro_batches(group_of_one):
    """With --accumulate 4 the gradients of the earlier micro-batches are alive beside the last
    one's (here where the peak is: the embeddings' backward): the plan holds them, so the
    measured peak stays within its forecast, and a budget between the forecast without them
    (which the plan used to take, then exceed) and with them is refused, not trained over."""
    shape = {**TINY, "model": "gpt2", "batch": 1, "accumulate": 4}
    run = _build(TrainConfig(device="cpu", budget="1TB", **shape), torch.device("cpu"))
    plain = memfit.plan(run.spec.build(0), _micro_batch(run), budget="1TB", decisions=KINDS, chunk_head=False)
    assert run.forecast > plain.predicted_peak  # the accumulated gradients are counted
    stop = StopRequests(rank=0)
    _step(run, 0, False, stop)
    entry, _ = _step(run, 1, True, stop)
    assert plain.predicted_peak < entry["peak_bytes"] <= run.forecast, (entry["peak_bytes"], run.forecast)
    between = str(int(plain.predicted_peak + run.forecast) // 2)
    with pytest.raises(memfit.PlanError, match=r"no plan fits .* The smallest budget that fits is"):
        _build(TrainConfig(device="cpu", budget=between, **shape), torch.device("cpu"))


def test_a_budget_under_bf16_plans_mixed_precision_and_holds(group_of_one):
    """--budget with --mixed-precision bf16 plans the step as the units compute it (bf16
    copies beside fp32 shards): a budget between its all-full and keep-all forecasts trains
    with that plan's decisions, and a step's measured peak stays within forecast and budget."""
    mixed = memfit.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    run = _build(TrainConfig(device="cpu", **TINY), torch.device("cpu"))
    opts = {"decisions": KINDS, "chunk_head": False, "mixed_precision": mixed}
    keep = memfit.plan(run.spec.build(0), _micro_batch(run), budget="1TB", **opts)
    full = memfit.Plan.fixed(dict.fromkeys(keep.decisions, "full"), keep.profile).predicted_peak
    budget = (full + keep.predicted_peak) // 2
    run = _build(TrainConfig(device="cpu", budget=str(budget), mixed_precision="bf16", **TINY), torch.device("cpu"))
    wanted = memfit.plan(run.spec.build(0), _micro_batch(run), budget=budget, **opts)
    assert _kinds(run.model, wanted.decisions) == dict(wanted.decisions) and run.forecast == wanted.predicted_peak
    assert set(wanted.decisions.values()) != {"keep"}, wanted.decisions
    stop = StopRequests(rank=0)
    _step(run, 0, False, stop)
    entry, _ = _step(run, 1, True, stop)
    assert entry["peak_bytes"] <= run.forecast <= budget, (entry["peak_bytes"], run.forecast, budget)


def test_a_saved_plan_is_applied_block_by_block_or_refused_by_name(group_of_one, tmp_path):
    paths = ["bert.encoder.layer.0", "bert.encoder.layer.1"]
    decisions = dict(zip(paths, ["selective", "keep"]))
    (tmp_path / "plan.json").write_text(json.dumps({"plan": {"decisions": decisions}}))  # plan --auto's nesting
    run = _build(TrainConfig(device="cpu", plan=str(tmp_path / "plan.json"), **TINY), torch.device("cpu"))
    assert _kinds(run.model, paths) == decisions
    (tmp_path / "other.json").write_text(json.dumps({"decisions": {"encoder.layer.7": "full"}}))
    with pytest.raises(ValueError, match=r"decides for blocks this model lacks \(encoder\.layer\.7\).*--layers"):
        _build(TrainConfig(device="cpu", plan=str(tmp_path / "other.json"), **TINY), torch.device("cpu"))
    (tmp_path / "half.json").write_text(json.dumps({"decisions": {paths[0]: "full"}}))
    with pytest.raises(ValueError, match=r"decides for 1 of this model's 2 blocks \(not bert\.encoder\.layer\.1\)"):
        _build(TrainConfig(device="cpu", plan=str(tmp_path / "half.json"), **TINY), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"--plan '.*nowhere\.json': no such file"):
        _build(TrainConfig(device="cpu", plan=str(tmp_path / "nowhere.json"), **TINY), torch.device("cpu"))
    (tmp_path / "w2.json").write_text(json.dumps({"decisions": decisions, "world_size": 2}))
    run = _build(TrainConfig(device="cpu", plan=str(tmp_path / "w2.json"), **TINY), torch.device("cpu"))
    assert "(planned for world size 2: its forecast is not this run's)" in run.chosen[2]
    (tmp_path / "offload.json").write_text(json.dumps({"decisions": dict.fromkeys(paths, "offload")}))
    with pytest.raises(ValueError, match=r"kind 'offload'; memfit train applies"):
        _build(TrainConfig(device="cpu", plan=str(tmp_path / "offload.json"), **TINY), torch.device("cpu"))


def test_auto_trains_with_autoconfigures_pick(group_of_one):
    shape = {k: v for k, v in TINY.items() if k != "batch"}
    run = _build(TrainConfig(device="cpu", budget="1GB", auto=True, global_batch=8, **shape), torch.device("cpu"))
    example = window_batch(run.tokens.train, run.spec.arch, run.spec.batch, run.seq, 0, 0, run.tokens.mask_id)
    best = memfit.autoconfigure(
        run.spec.build(0), example, budget="1GB", world_size=1, global_batch=8, device_profile="cpu",
        decisions=("keep", "selective", "full"), chunk_head=False,
    ).best  # fmt: skip
    assert (run.batch, run.accumulate) == (best.micro_batch, best.accumulation) and run.batch * run.accumulate == 8
    assert best.plan is not None and _kinds(run.model, best.plan.decisions) == dict(best.plan.decisions)


def test_trials_train_the_fastest_measured_and_leave_the_run_as_it_was(group_of_one, monkeypatch):
    from memfit._plan import _trial
    from memfit.cli import _train

    shape = {k: v for k, v in TINY.items() if k != "batch"}
    clock, steps, real, models = [0.0], [], _train._descend, {}

    def descend(run, micro):  # a step takes 1 / its micro-batches seconds: the most accumulation is fastest
        steps.append((run.batch, run.accumulate))
        models[id(run.model)] = weakref.ref(run.model)
        clock[0] += 1 / run.accumulate
        return real(run, micro)

    monkeypatch.setattr(_trial, "_clock", lambda: clock[0])
    monkeypatch.setattr(_train, "_descend", descend)
    flags = {"device": "cpu", "budget": "1GB", "auto": True, "global_batch": 8, **shape}
    run = _build(TrainConfig(trials=3, **flags), torch.device("cpu"))
    example = window_batch(run.tokens.train, run.spec.arch, run.spec.batch, run.seq, 0, 0, run.tokens.mask_id)
    result = memfit.autoconfigure(
        run.spec.build(0), example, budget="1GB", world_size=1, global_batch=8, device_profile="cpu",
        decisions=KINDS, chunk_head=False,
    )  # fmt: skip
    top = [(c.micro_batch, c.accumulation) for c in result.candidates[:3]]
    assert steps == [m for m in top for _ in range(2 + 5)]  # warm-up 2, then 5 timed, one configuration at a time
    fastest = max(top, key=lambda m: m[1])
    assert fastest != top[0]  # the measured pick is not the predicted one
    assert (run.batch, run.accumulate) == fastest
    assert "ms a step measured (--trials, picked by its expected" in run.chosen[2], run.chosen[2]
    scale = sorted(1 / c.accumulation / c.step_time for c in result.candidates[:3])[1]  # the median of the three
    assert f"trial scale {scale:.2f} (the median measured / predicted), measured-time weight 1.00" in run.chosen[2]
    assert [ref() for ref in models.values() if ref() is not None] == []  # the trials' models are freed
    pick = next(c for c in result.candidates if (c.micro_batch, c.accumulation) == fastest)
    assert pick.plan is not None and _kinds(run.model, pick.plan.decisions) == dict(pick.plan.decisions)
    # --trials 1 measures the predicted pick alone: the run trains as without --trials, bit for bit
    once, never = (_build(TrainConfig(**flags, trials=t), torch.device("cpu")) for t in (1, 0))
    assert (once.batch, once.accumulate) == (never.batch, never.accumulate) == top[0]
    for r in (once, never):
        _step(r, 0, False, StopRequests(rank=0))
    for a, b in zip(once.model.parameters(), never.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_restart_trains_what_the_trials_picked_without_trying_again(group_of_one, monkeypatch, tmp_path):
    # the checkpoint records --trials' pick; a resumed run at the same world size trains it
    # again (its search has it, it fits) instead of timing the top K anew, which could pick
    # another configuration mid-run. See [Note: Trying configurations].
    from memfit._plan import _trial
    from memfit.cli import _train
    from memfit.cli._choose import picked_before

    shape = {k: v for k, v in TINY.items() if k != "batch"}
    clock, steps, real = [0.0], [], _train._descend

    def descend(run, micro):  # a step takes 1 / its micro-batches seconds: the most accumulation is fastest
        steps.append((run.batch, run.accumulate))
        clock[0] += 1 / run.accumulate
        return real(run, micro)

    monkeypatch.setattr(_trial, "_clock", lambda: clock[0])
    monkeypatch.setattr(_train, "_descend", descend)
    flags = {"device": "cpu", "budget": "1GB", "auto": True, "global_batch": 8, "trials": 3, **shape}
    first = _build(TrainConfig(steps=1, checkpoint_dir=str(tmp_path), **flags), torch.device("cpu"))
    picked = (first.batch, first.accumulate)
    assert len(steps) == 3 * 7 and first.trials_pick is not None
    _train._loop(first, StopRequests(rank=0), None)  # one step, saved
    steps.clear()
    again = _build(TrainConfig(steps=2, checkpoint_dir=str(tmp_path), resume="yes", **flags), torch.device("cpu"))
    assert steps == [] and (again.batch, again.accumulate) == picked, steps
    assert "picked by --trials before, not tried again" in again.chosen[2], again.chosen[2]
    assert again.trials_pick == first.trials_pick  # and its checkpoints record it again
    # another precision (or sequence length, device) times other steps; another world size
    # searches other layouts: the record does not apply, the trials run again
    steps.clear()
    bf16 = _build(
        TrainConfig(steps=2, checkpoint_dir=str(tmp_path), resume="yes", mixed_precision="bf16", **flags),
        torch.device("cpu"),
    )
    assert len(steps) == 3 * 7 and "not tried again" not in bf16.chosen[2]
    assert first.trials_pick["seq"] == first.seq and first.trials_pick["device"] == "cpu"  # resolved, not the flags
    assert picked_before({**first.trials_pick, "world": 2}, None, [], 1, None, {}) is None


def test_a_trial_cut_short_by_out_of_memory_frees_its_model(group_of_one):
    # a step that fails between its forward and the end of its backward leaves its root state in
    # memfit's in-flight set: measure releases it, so the failed configuration's model is freed
    spec = TrainConfig(device="cpu", **TINY).spec()
    batch = batch_at(spec.arch, 2, 16, step=0)
    result = memfit.autoconfigure(
        spec.build(0), batch, budget="1GB", world_size=1, global_batch=4, device_profile="cpu"
    )
    refs = []

    def step_of(c):
        plain = spec.build(0)
        model = memfit.FullyShardedDataParallel(plain, auto_wrap_policy={layer_class(plain)})
        refs.append(weakref.ref(model))
        failing = c is result.candidates[0]

        def step():
            loss = loss_of(model, batch)
            if failing:
                raise torch.OutOfMemoryError("CUDA out of memory (a stand-in)")
            loss.backward()

        return step

    measured = result.measure(step_of, top=2, steps=1, warmup=0)
    assert measured.best.measured is not None  # the second configuration, measured
    assert measured.candidates[1].lost.startswith("memory: out of memory when run (CUDA out of memory")
    assert [r() for r in refs] == [None, None]


def test_bf16_mixed_precision_gathers_bf16_and_keeps_fp32_masters(group_of_one):
    run = _build(TrainConfig(device="cpu", mixed_precision="bf16", **TINY), torch.device("cpu"))
    units = sharded_units(run.model)
    assert {p.dtype for p in run.model.parameters()} == {torch.float32}  # the shards the optimizer steps
    assert torch.bfloat16 in {sp.full.dtype for u in units for sp in u.params}  # norms stay fp32
    entry, _ = _step(run, 0, False, StopRequests(rank=0))
    assert math.isfinite(entry["loss"])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"budget": "1GB", "plan": "p.json"}, r"--budget and --plan each choose the checkpointing"),
        ({"budget": "1GB", "checkpointing": "selective"}, r"--budget and --checkpointing each choose"),
        ({"plan": "p.json", "checkpointing": "full"}, r"--plan and --checkpointing each choose"),  # the default, typed
        ({"auto": True}, r"--auto searches configurations that fit a --budget"),
        ({"auto": True, "budget": "1GB", "batch": 2}, r"--auto chooses --batch, --accumulate and --hybrid-shards"),
        ({"budget": "lots"}, r"lots"),
        ({"budget": "1GB", "trials": 2}, r"--trials K tries --auto's top configurations: pass --auto"),
        ({"budget": "1GB", "auto": True, "trials": -1}, r"--trials takes 0 \(none\) or more"),
    ],
)
def test_conflicting_choices_are_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**flags)
