"""The planner on real models: forecasts checked against measured steps, tables, names kept."""

import pytest
import torch

import memfit
from memfit._plan._solve import BINS
from memfit.models import Shape, bert_mlm, gpt2_lm, lm_batch, mlm_batch


def measured_peak(model, batch, plan):
    return plan.measure(model, batch)


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_plans_fit_and_forecasts_hold(arch):
    shape = Shape(layers=4, hidden=64, heads=4, seq=64, batch=4, vocab=1000)
    if arch == "bert":
        model, batch = bert_mlm(shape), mlm_batch(shape)
    else:
        model, batch = gpt2_lm(shape), lm_batch(shape)
    first = memfit.plan(model, batch, budget="10GB")
    profile = first.profile
    paths = [b.path for b in profile.blocks]
    # Everything fits: the plan is the fastest one, never slower than keeping every activation.
    assert first.predicted_overhead <= 0.0

    def uniform(k):  # checkpoint every k-th block, fully
        return {p: ("full" if i % k == 0 else "keep") for i, p in enumerate(paths)}

    uniforms = {k: memfit.Plan.fixed(uniform(k), profile) for k in (1, 2, 4)}
    peaks = {k: measured_peak(model, batch, u) for k, u in uniforms.items()}
    keep_peak = measured_peak(model, batch, first)
    full_peak = peaks[1]
    for frac in (0.25, 0.5, 0.75):
        budget = int(full_peak + frac * (keep_peak - full_peak))
        plan = memfit.plan(model, batch, budget=budget, profile=profile)
        measured = measured_peak(model, batch, plan)
        assert abs(plan.predicted_peak / measured - 1) <= 0.10, plan.compare(measured)
        assert measured <= 1.05 * budget, plan.compare(measured)
        # No uniform plan the forecast lets through is cheaper (the benchmark compares measured
        # peaks and times side by side); the solver rounds each block's kept bytes up to a
        # grain of budget/BINS, so a plan within that many grains of the budget may be missed.
        headroom = len(paths) * budget / BINS
        fitting = [u.predicted_overhead for u in uniforms.values() if u.predicted_peak <= budget - headroom]
        assert plan.predicted_overhead <= min(fitting, default=float("inf")) + 1e-12
    for u, peak in zip(uniforms.values(), peaks.values()):
        assert abs(u.predicted_peak / peak - 1) <= 0.10, u.compare(peak)


def test_table_to_dict_and_apply_keep_names():
    shape = Shape(layers=2, hidden=32, heads=2, seq=16, batch=2, vocab=100)
    model, batch = bert_mlm(shape), mlm_batch(shape)
    names = [n for n, _ in model.named_parameters()]
    plan = memfit.plan(model, batch, budget="10GB")
    decisions = dict.fromkeys(plan.decisions, "selective")
    plan = memfit.Plan(plan.budget, decisions, plan.profile, None)
    text = plan.table()
    assert "bert.encoder.layer.1" in text and "selective" in text and "predicted peak" in text
    d = plan.to_dict()
    assert d["decisions"] == decisions and d["predicted_peak"] == plan.predicted_peak
    plan.apply(model)
    assert [n for n, _ in model.named_parameters()] == names
    assert "forward" in model.bert.encoder.layer[0].__dict__  # checkpointed in place
    assert "predicted peak" in plan.compare(plan.predicted_peak)


class PassThrough(torch.nn.Module):
    """Returns its mask input unchanged beside its output (as HF layers return extras)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x, mask):
        return self.lin(x) * mask, mask


class Chain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(PassThrough() for _ in range(3))

    def forward(self, x, mask):
        for b in self.blocks:
            x, mask = b(x, mask)
        return x.square().mean()


def test_outputs_sharing_an_input_storage_are_counted_once():
    inputs = {"x": torch.randn(8, 16), "mask": torch.rand(8, 16)}
    plan = memfit.plan(Chain(), inputs, budget="1GB")
    for b in plan.profile.blocks:
        assert b.output_bytes == 8 * 16 * 4  # the mask is counted as an input only
        assert all(v >= 0 for v in b.kept.values())


class _UnusedBranch(torch.nn.Module):
    """Three blocks and a head, and a trainable layer forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
        self.unused = torch.nn.Linear(64, 256)
        self.head = torch.nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.blocks(x)).square().mean()


def _bart_causal_lm():
    from transformers import BartConfig, BartForCausalLM

    cfg = BartConfig(
        vocab_size=128,
        d_model=32,
        decoder_layers=2,
        decoder_attention_heads=4,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        dropout=0.0,
    )
    ids = torch.randint(0, 128, (2, 16))
    return BartForCausalLM(cfg), {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("arch", ["unused_branch", "bart_causal_lm"])
def test_parameters_the_step_never_reaches_have_no_gradient_or_state(arch):
    # [Note: Parameters the step uses]: the forecast counted gradients and AdamW state for
    # every trainable parameter, also the unused layer (measured +55.9% here) and a BART decoder's
    # cross-attention when it runs as a causal LM without an encoder (+16.5%).
    model, batch = (_UnusedBranch(), torch.randn(8, 64)) if arch == "unused_branch" else _bart_causal_lm()
    plan = memfit.plan(model, batch, budget="1GB", device_profile="cpu")
    measured = plan.measure(model, batch)
    assert 1.0 <= plan.predicted_peak / measured <= 1.03, plan.compare(measured)
    if arch == "unused_branch":  # what the step holds at its end is exact here
        assert plan.predicted_peak == measured
        used = [p for n, p in model.named_parameters() if not n.startswith("unused.")]
        # AdamW: exp_avg and exp_avg_sq of each used parameter, and a 4-byte step counter each
        assert plan.profile.optimizer_bytes == sum(2 * p.numel() * 4 + 4 for p in used)


class _HeavyBackward(torch.autograd.Function):
    """Identity whose backward holds a 1 MiB scratch tensor (code between two blocks)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        scratch = torch.ones(256 * 1024, dtype=grad.dtype)
        return grad * scratch[:1].sum()


class _OutsideInBackward(torch.nn.Module):
    """Four blocks given a rotary-like table the odd ones never read, and code between blocks 1
    and 2 whose backward holds more than any block's."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_TableBlock(i % 2 == 0) for i in range(4))

    def forward(self, x):
        table = torch.arange(64.0).repeat(64, 1)  # 16 KiB, given to every block
        for i, layer in enumerate(self.layers):
            x = layer(x, table)
            if i == 1:
                x = _HeavyBackward.apply(x)
        return x.square().mean()


class _TableBlock(torch.nn.Module):
    def __init__(self, reads: bool) -> None:
        super().__init__()
        self.reads = reads
        self.fc = torch.nn.Linear(64, 64)

    def forward(self, x, table):
        h = self.fc(x)
        return torch.tanh(h + table[: x.shape[0]]) if self.reads else torch.tanh(h) * h


def test_what_the_backward_holds_outside_the_blocks_is_counted():
    # [Note: What the backward holds outside the blocks]: the 1 MiB the code between blocks 1 and
    # 2 holds in its backward was missed (forecast 0.26x of the measured peak).
    model, batch = _OutsideInBackward(), torch.randn(64, 64)
    plan = memfit.plan(model, batch, budget="1GB", device_profile="cpu")
    measured = plan.measure(model, batch)
    assert plan.predicted_peak == measured, plan.compare(measured)
    assert plan.forecast["at"] == "backward after layers.2", plan.forecast["at"]
    assert plan.profile.after_outside[2] >= 1024 * 1024  # the scratch, beside what is alive then
    assert plan.profile.after_outside[:2] == [0, 0] and max(plan.profile.backward_outside) <= 64
    # E_i is measured with every block kept and taken to hold for other decisions: checkpointed,
    # the step holds 16 KiB more at that moment (0.988x; before E_i, 0.26x).
    for kind in ("full", "selective"):
        fixed = memfit.Plan.fixed({b.path: kind for b in plan.profile.blocks}, plan.profile)
        measured = fixed.measure(model, batch)
        assert 0.98 <= fixed.predicted_peak / measured <= 1.03, (kind, fixed.compare(measured))


class _AnotherLinearInRecompute(torch.nn.Module):
    """A block that runs its Linear once more in recompute (on one row, without grad: full
    recompute saves the same tensors): selective checkpointing hands the kept outputs back by
    call count and refuses a path that differs ("ran 2 times in recompute but 1 in forward")."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(32, 32)

    def forward(self, x):
        h = self.fc(x)
        if memfit.is_recomputing():
            with torch.no_grad():
                self.fc(x[:1])
        return torch.tanh(h)


def test_a_decision_a_block_cannot_take_is_left_out_and_named():
    # [Note: A decision a block cannot take]: the planner raised torch's error for the whole model.
    model = torch.nn.Sequential(*[_AnotherLinearInRecompute() for _ in range(3)])
    batch = torch.randn(2048, 32)  # activations above the optimizer step's peak
    loss = {"loss_fn": lambda out: out.square().mean()}
    plan = memfit.plan(model, batch, budget="1GB", device_profile="cpu", **loss)
    for b in plan.profile.blocks:
        assert "in recompute but 1 in forward" in b.unavailable["selective"], b.unavailable
        assert {"keep", "full"} <= set(b.kept) and "selective" not in b.kept
    assert "selective is not available on 0, 1, 2: RuntimeError" in plan.table()
    tight = memfit.plan(model, batch, budget=plan.predicted_peak - 1, profile=plan.profile, **loss)
    assert set(tight.decisions.values()) != {"keep"} and "selective" not in tight.decisions.values()
    with pytest.raises(ValueError, match=r"0 cannot take 'selective'"):
        memfit.Plan.fixed(dict.fromkeys(["0", "1", "2"], "selective"), plan.profile)
    with pytest.raises(ValueError, match=r"3 blocks can take none of the decisions \['selective'\]"):
        memfit.plan(model, batch, budget="1GB", decisions=("selective",), profile=plan.profile, **loss)
    full = memfit.Plan.fixed(dict.fromkeys(["0", "1", "2"], "full"), plan.profile)
    assert 1.0 <= full.predicted_peak / full.measure(model, batch, **loss) <= 1.03


def _albert():
    from transformers import AlbertConfig, AlbertForMaskedLM

    torch.manual_seed(0)
    cfg = AlbertConfig(
        vocab_size=128,
        embedding_size=16,
        hidden_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    ids = torch.randint(0, 128, (4, 32))
    return AlbertForMaskedLM(cfg), {"input_ids": ids, "labels": ids}


def test_a_module_run_several_times_is_one_block_per_call_with_one_decision():
    # [Note: A module run several times]: ALBERT's one layer, run 6 times, was "no repeated blocks".
    model, batch = _albert()
    plan = memfit.plan(model, batch, budget="1GB", device_profile="cpu")
    path = "albert.encoder.albert_layer_groups.0"
    assert [b.path for b in plan.profile.blocks] == [path] * 6 and list(plan.decisions) == [path]
    assert sum(b.grad_bytes > 0 for b in plan.profile.blocks) == 1  # its gradients once, with its last call
    assert 1.0 <= plan.predicted_peak / plan.measure(model, batch) <= 1.03
    # A budget between all-full and keep: one decision for the module, the measured step within it.
    full = memfit.Plan.fixed({path: "full"}, plan.profile)
    budget = (full.predicted_peak + plan.predicted_peak) // 2
    tight = memfit.plan(model, batch, budget=budget, profile=plan.profile)
    assert tight.decisions[path] != "keep" and tight.predicted_peak <= budget
    assert tight.measure(model, batch) <= budget
    assert f"{path} #6" in tight.table()  # the moments name each call
