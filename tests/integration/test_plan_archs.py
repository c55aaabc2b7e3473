"""The planner on the architectures transformers trains: MoE experts on torch._grouped_mm,
steps that read values from their data, vision-language models on a text batch, hybrid
stacks of several layer classes. Tiny random configs (no hub); each forecast of the second
AdamW step's peak is checked against the measured one (Plan.measure: MemoryMeter)."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import memfit

TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}
MOE = {"moe_intermediate_size": 32, "num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2}
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}

CONFIGS = {
    # experts on aten._grouped_mm in float32 ([Note: Ops the meta kernels refuse])
    "mixtral": {**TEXT, **MOE},
    "qwen3_moe": {**TEXT, **MOE},
    "olmoe": {**TEXT, **MOE},
    "deepseek_v3": {
        **TEXT,
        **MOE,
        "num_key_value_heads": 4,
        "head_dim": 8,  # the rotary part of its heads (qk_rope_head_dim)
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "first_k_dense_replace": 0,
        "n_group": 1,
        "topk_group": 1,
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
    },
    # values read from the data ([Note: Values read from the data]): expert_size.tolist()
    "jetmoe": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "kv_channels": 16,
        "intermediate_size": 128,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "vocab_size": 128,
    },
    # lengths.max().item(), and four per-layer lists run interleaved ([Note: Default candidates])
    "xlm": {"emb_dim": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 128, "max_position_embeddings": 64},
    # a vision tower that does not run on a text batch
    "gemma3": {
        "text_config": {**TEXT, "sliding_window": 8},
        "vision_config": {**VISION, "image_size": 32, "patch_size": 8},
        "mm_tokens_per_image": 4,
    },
    # a hybrid: a state-space layer and an attention layer (with experts) in one ModuleList
    "jamba": {
        **TEXT,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_dt_rank": 4,
    },
}

LAYERS = {
    "xlm": [f"transformer.{k}.{i}" for i in range(2) for k in ("attentions", "layer_norm1", "ffns", "layer_norm2")],
    "gemma3": ["model.language_model.layers.0", "model.language_model.layers.1"],
}


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_plans_and_forecasts_within_3_percent_above(arch):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **CONFIGS[arch]))
    ids = torch.randint(3, 128, (2, 16))
    batch = {"input_ids": ids, "labels": ids}
    plan = memfit.plan(model, batch, budget="1GB", decisions=("keep",), chunk_head=False, device_profile="cpu")
    # The layers, in the order they run: every layer of a hybrid, none of a vision tower.
    assert list(plan.decisions) == LAYERS.get(arch, ["model.layers.0", "model.layers.1"])
    measured = plan.measure(model, batch)
    assert 1.0 <= plan.predicted_peak / measured <= 1.03, plan.compare(measured)


def test_candidates_that_never_run_are_named():
    cfg = AutoConfig.for_model("gemma3", **CONFIGS["gemma3"])
    model = AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(3, 128, (2, 16))
    vision = "model.vision_tower.encoder.layers.0"
    with pytest.raises(ValueError, match=rf"candidates \['{vision}'\] never run"):
        memfit.plan(model, {"input_ids": ids, "labels": ids}, budget="1GB", candidates=[vision])


class Routed(torch.nn.Module):
    """A block that runs its Linear on the rows torch.nonzero picks (as eager experts do)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x):
        rows = torch.nonzero(x[:, 0] > 0).squeeze(1)
        return x.index_add(0, rows, self.lin(x[rows]).relu())


def test_values_read_from_the_data_come_from_one_real_forward():
    # [Note: Values read from the data]: the forecast with the rows the batch routes.
    model = torch.nn.Sequential(*[Routed() for _ in range(3)])
    x = torch.randn(256, 64)
    plan = memfit.plan(model, x, budget="1GB", loss_fn=lambda y: y.square().mean(), device_profile="cpu")
    measured = plan.measure(model, x, loss_fn=lambda y: y.square().mean())
    # Never below; 1.177x measured here (the toy's index_add output over-counted, not the rows).
    assert 1.0 <= plan.predicted_peak / measured <= 1.2, plan.compare(measured)
    with torch.device("meta"):
        meta = torch.nn.Sequential(*[Routed() for _ in range(3)])
    with pytest.raises(ValueError, match=r"reads values from its data \(aten.nonzero.default in 0\)"):
        memfit.plan(meta, x, budget="1GB", loss_fn=lambda y: y.square().mean())


class OneHotRouted(torch.nn.Module):
    """LongcatFlash's experts: one_hot of the routing (whose real kernel reads the data to check
    the classes, the fake one does not), then per expert hit, torch.where on its 2-D mask."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.experts = experts
        self.router = torch.nn.Linear(64, experts)
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x):
        top = self.router(x).topk(2, dim=-1).indices  # [tokens, 2]
        mask = torch.nn.functional.one_hot(top, num_classes=self.experts).permute(2, 1, 0)  # [E, 2, tokens]
        out = torch.zeros_like(x)
        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            _, tokens = torch.where(mask[int(e.item())])
            out = out.index_add(0, tokens, self.lin(x[tokens]))
        return out


def test_recorded_values_are_matched_by_op_and_shapes():
    # The real step's one_hot reads its input (.item() checks) where the fake one does not: a
    # count over every data-reading op gave torch.where the answer of another op (a 1-D nonzero:
    # "not enough values to unpack"). Answers are counted per op and argument shapes.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[OneHotRouted() for _ in range(2)])
    x = torch.randn(32, 64)
    plan = memfit.plan(model, x, budget="1GB", loss_fn=lambda y: y.square().mean(), device_profile="cpu")
    measured = plan.measure(model, x, loss_fn=lambda y: y.square().mean())
    assert 1.0 <= plan.predicted_peak / measured <= 1.2, plan.compare(measured)
