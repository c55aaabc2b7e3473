"""The op stream the planner traces for an accelerator profile on this CPU host: CUDA's fused
attention (no batch x heads x seq^2 score tensor), native dropout and foreach AdamW; CPU
profiles trace the CPU's stream, their forecasts as before (see [Note: The target's op stream])."""

from __future__ import annotations

import pytest
import torch

import memfit
from memfit._plan._calibrate import device_profile
from memfit._plan._profile import profile_model
from memfit._plan._step import _Meter
from memfit._plan._target import CUDA_BLOCK, cuda_backend, target_of
from memfit._plan._trace import _class_attribute
from memfit.models import Shape, bert_mlm, llama_lm, lm_batch, mlm_batch

# Scores (b*h*s*s elements, bf16) larger than any other tensor of the step (fp32 logits too).
SHAPE = Shape(layers=2, hidden=32, heads=4, seq=128, batch=2, vocab=128)
SCORES = SHAPE.batch * SHAPE.heads * SHAPE.seq * SHAPE.seq


def _ops(model, batch, device: str) -> tuple[set[str], int]:
    prof = profile_model(model, batch, device=device_profile(device), decisions=("keep",), chunk_head=False)
    return {c.op for c in prof.step_ops}, max(c.largest_output for c in prof.step_ops)


def _bert():
    with torch.device("meta"):
        return bert_mlm(SHAPE)  # dropout 0.1


def _llama(dtype=torch.bfloat16):
    import dataclasses

    with torch.device("meta"):
        return llama_lm(dataclasses.replace(SHAPE, dropout=0.0)).to(dtype)


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=SHAPE.vocab, d_model=SHAPE.hidden, d_kv=SHAPE.hidden // SHAPE.heads, d_ff=64, num_layers=2,
        num_decoder_layers=2, num_heads=SHAPE.heads, dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0,
        attn_implementation="sdpa",
    )  # fmt: skip
    with torch.device("meta"):
        return T5ForConditionalGeneration(cfg)


def _t5_batch():
    ids = torch.randint(0, SHAPE.vocab, (SHAPE.batch, SHAPE.seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def test_bert_with_dropout_traces_cuda_stream_for_h100():
    ops, largest = _ops(_bert(), mlm_batch(SHAPE), "h100")
    # fp32 with dropout: CUDA's memory-efficient kernel, forward and backward
    assert "aten._scaled_dot_product_efficient_attention" in ops
    assert "aten._scaled_dot_product_efficient_attention_backward" in ops
    assert largest < SCORES * 4  # no fp32 score tensor
    assert "aten.native_dropout" in ops and "aten.bernoulli_" not in ops
    assert "aten._foreach_addcdiv_" in ops and "aten._foreach_sqrt" in ops  # foreach AdamW
    # the CPU's stream for the same model: the math path's scores, four-op dropout, AdamW's loop
    cpu_ops, cpu_largest = _ops(_bert(), mlm_batch(SHAPE), "cpu")
    assert cpu_largest >= SCORES * 4
    assert "aten.bernoulli_" in cpu_ops and "aten.native_dropout" not in cpu_ops
    assert not any(op.startswith("aten._foreach") for op in cpu_ops)


def test_llama_bf16_traces_flash_for_h100():
    ops, largest = _ops(_llama(), lm_batch(SHAPE), "h100")
    assert {"aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_flash_attention_backward"} <= ops
    assert largest < SCORES * 2
    assert "aten._foreach_addcdiv_" in ops


def test_t5_position_bias_traces_efficient_attention_for_h100():
    ops, _ = _ops(_t5(), _t5_batch(), "h100")
    # a float mask (the position bias): memory-efficient, the mask given as a bias
    assert "aten._scaled_dot_product_efficient_attention" in ops
    assert "aten._scaled_dot_product_efficient_attention_backward" in ops
    assert "aten.native_dropout" in ops and "aten.bernoulli_" not in ops


def test_autocast_traces_cuda_fp32_lists_for_h100():
    def norms(device: str) -> set[str]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            prof = profile_model(_bert(), mlm_batch(SHAPE), device=device_profile(device), decisions=("keep",))
        return {str(c.dtype) for c in prof.step_ops if c.op == "aten.native_layer_norm"}

    assert norms("h100") == {"torch.float32"}  # CUDA autocast: layer_norm in fp32
    assert "torch.bfloat16" in norms("cpu")  # the CPU's lists: in the Linear's output dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):  # torch's own kernels back after the trace
        assert torch.nn.functional.layer_norm(torch.ones(2, 4, dtype=torch.bfloat16), (4,)).dtype == torch.bfloat16


def test_cuda_backend_rule():
    def qkv(dtype, heads_kv=4, dim=8):
        return (torch.empty(2, 4, 16, dim, dtype=dtype, device="meta"),
                torch.empty(2, heads_kv, 16, dim, dtype=dtype, device="meta"))  # fmt: skip

    q, k = qkv(torch.bfloat16)
    assert cuda_backend(q, k, k) == "flash"
    assert cuda_backend(q, k, k, attn_mask=torch.empty(16, 16, device="meta")) == "efficient"
    q, k = qkv(torch.float32)
    assert cuda_backend(q, k, k, dropout_p=0.1) == "efficient"
    q, k = qkv(torch.float32, heads_kv=2)
    assert cuda_backend(q, k, k, enable_gqa=True) == "math"  # efficient has no GQA
    q, k = qkv(torch.bfloat16, heads_kv=2)
    assert cuda_backend(q, k, k, enable_gqa=True) == "flash"
    q, k = qkv(torch.bfloat16, dim=512)
    assert cuda_backend(q, k, k) == "efficient"  # flash: head dims up to 256


def test_targets_of_profiles():
    assert target_of(device_profile("h100")).cuda and target_of(device_profile("a100")).block_bytes == CUDA_BLOCK
    assert not target_of(device_profile("cpu")).cuda and target_of(device_profile("cpu")).block_bytes == 1


def test_meter_rounds_to_the_allocator_block():
    with _class_attribute(_Meter, "block_bytes", CUDA_BLOCK), _Meter() as meter:
        x = torch.empty(3)  # 12 bytes: one 512-byte block
        y = torch.empty(CUDA_BLOCK // 4 + 1)  # 516 bytes: two
        assert meter.current_bytes == 3 * CUDA_BLOCK
        del x, y
    with _Meter() as meter:
        x = torch.empty(3)
        assert meter.current_bytes == 12
        del x


# memfit.plan's forecasts on the CPU profile before the target's stream was added (commit
# b9f238b): unchanged, to the byte.
CPU_FORECASTS = {"bert": 2678440}


@pytest.mark.parametrize("name", sorted(CPU_FORECASTS))
def test_cpu_profile_forecast_unchanged(name):
    shape = Shape(layers=2, hidden=64, heads=2, seq=32, batch=2, vocab=128)
    with torch.device("meta"):
        model = bert_mlm(shape)
    plan = memfit.plan(model, mlm_batch(shape), budget="100GB", device_profile="cpu")
    assert plan.predicted_peak == CPU_FORECASTS[name]
