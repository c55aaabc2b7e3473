"""Every architecture transformers can build for causal LM, masked LM, seq2seq LM, image
classification and speech seq2seq (its auto mappings at the installed version), tiny: memfit's
checkpointing of the repeated blocks, full and selective (save="linear"), gives the plain
model's loss and gradients bitwise, dropout on. An architecture whose plain step fails on its
tiny config and batch (transformers' own forward or backward raises) is skipped with the
reason, and so is one with no repeated blocks; anything else is a failure (or an entry of
CHECKPOINT_XFAIL). The full enumeration is in the slow tier; `make test` runs a sample. Counts
and one line per architecture: ``PYTHONPATH=. python -m tests._archs``. Then the planner on
the sample (slow tier): its forecast of the second AdamW step's peak is within 0..+3% of the
measured peak. And memfit.materialize of each built on the meta device, sharded at world size 1:
the eager build's init (See [Note: Initialised like eager]), or a refusal naming the tensor that
nothing initialises (full enumeration: slow tier)."""

import re

import pytest
import torch

import memfit
from tests._archs import (
    Arch,
    ShrinkError,
    _reason,
    architectures,
    assert_like_eager,
    batch_for,
    build,
    check,
    materialized,
)

ALL = architectures()
SAMPLE = {
    "causal_lm-LlamaForCausalLM",
    "causal_lm-GPT2LMHeadModel",
    "causal_lm-BartForCausalLM",
    "masked_lm-BertForMaskedLM",
    "masked_lm-XLMWithLMHeadModel",
    "seq2seq_lm-T5ForConditionalGeneration",
    "image_classification-ViTForImageClassification",
    "speech_seq2seq-WhisperForConditionalGeneration",
}
# Architectures whose checkpointing check fails, and why; strict: a fix flips them (remove the entry).
_SHRINK = "the tiny config is not tiny (a size the shrinker in tests/_archs.py does not know): add OVERRIDES"
_TOO_BIG: list[str] = []  # over MAX_PARAMS after shrinking (tests/_archs.py): None now
CHECKPOINT_XFAIL: dict[str, str] = dict.fromkeys(_TOO_BIG, _SHRINK)
# Architectures whose tensors neither reset_parameters nor transformers' _init_weights writes (their
# constructors set them: lost on the meta device): materialize must refuse them by name.
MATERIALIZE_REFUSED = {
    "ApertusForCausalLM": "alpha_p' of XIELUActivation",
    "FalconH1ForCausalLM": "mup_vector' of FalconH1Mixer",
    "OpenAIGPTLMHeadModel": "c_attn.weight' of Conv1D",
    "ImageGPTForImageClassification": "c_attn.weight' of Conv1D",
    "LevitForImageClassification": "attention_biases' of LevitAttentionSubsample",
    "LevitForImageClassificationWithTeacher": "attention_biases' of LevitAttentionSubsample",
    "SpeechEncoderDecoderModel": "weight.original0' of ParametrizationList",  # weight_norm's g and v
    "SpeechT5ForSpeechToText": "weight.original0' of ParametrizationList",
    "LukeForMaskedLM": "bias' of EntityPredictionHead",  # its constructor sets the bias
    "PerceiverForMaskedLM": "bias' of PerceiverEmbeddingDecoder",
}
# The sample plus tied heads whose init differs from their embedding's, and a tied bias.
MATERIALIZE_SAMPLE = SAMPLE | {
    "causal_lm-ModernBertDecoderForCausalLM",
    "causal_lm-YoutuForCausalLM",
    "masked_lm-FNetForMaskedLM",
    "causal_lm-OpenAIGPTLMHeadModel",
}
# The planner's sample: the sample and architectures it once failed on (a step that formats a
# tensor's value, replaces its buffers, mutates a tensor selective checkpointing keeps, a block
# input nobody reads, one layer run several times, a batch the real step reads before the fake
# one does).
PLANNER_SAMPLE = SAMPLE | {
    "seq2seq_lm-SwitchTransformersForConditionalGeneration",
    "masked_lm-IBertForMaskedLM",
    "image_classification-Swinv2ForImageClassification",
    "causal_lm-AfmoeForCausalLM",
    "masked_lm-AlbertForMaskedLM",
    "causal_lm-HYV4ForCausalLM",
    "masked_lm-LongformerForMaskedLM",
    "masked_lm-TapasForMaskedLM",
}
# Planner failures of the sample: class name -> why (strict: a fix flips them). None now.
PLANNER_XFAIL: dict[str, str] = {}


def _params(archs, xfail: dict[str, str]) -> list:
    return [
        pytest.param(a, id=a.id, marks=[pytest.mark.xfail(reason=xfail[a.class_name], strict=True)])
        if a.class_name in xfail
        else pytest.param(a, id=a.id)
        for a in archs
    ]


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny ops on a shared machine run 20x slower on all its threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(arch: Arch) -> None:
    result = check(arch)
    if result["status"] == "skip":
        # Plain transformers fails on the tiny config and batch tests/_archs.py makes (many are the
        # shrinker's or the batch's doing: a config it cannot shrink consistently), or no blocks.
        pytest.skip(f"{arch.class_name}: plain step fails on its tiny config and batch: {result['reason']}")
    assert result["status"] == "pass", {k: v for k, v in result.items() if k != "status"}


@pytest.mark.parametrize("arch", [a for a in ALL if a.id in SAMPLE], ids=lambda a: a.id)
def test_checkpointing_matches_plain_on_a_sample(arch):
    _run(arch)


def test_the_sample_is_enumerated():
    assert SAMPLE | PLANNER_SAMPLE <= {a.id for a in ALL}  # a renamed class fails here, not silently
    assert len(ALL) > 300  # every (task, class) of the five mappings, at transformers 5.23


@pytest.mark.parametrize("arch", _params(ALL, CHECKPOINT_XFAIL))
def test_checkpointing_matches_plain(arch):  # the slow tier: every architecture
    _run(arch)


@pytest.mark.parametrize("arch", _params([a for a in ALL if a.id in PLANNER_SAMPLE], PLANNER_XFAIL))
def test_planner_forecast_of_the_second_step(arch):  # the slow tier: 30-100 s each on a loaded machine
    model = build(arch)
    batch = batch_for(arch, model)
    plan = memfit.plan(model, batch, budget="1TB", device_profile="cpu")  # its default candidates
    measured = plan.measure(model, batch)
    assert 1.0 <= plan.predicted_peak / measured <= 1.03, plan.compare(measured)


def _materialize(arch: Arch) -> None:
    try:
        eager = build(arch)
    except ShrinkError:
        raise
    except Exception as e:
        pytest.skip(f"{arch.class_name}: transformers cannot build its tiny config: {_reason(e)}")
    refused = MATERIALIZE_REFUSED.get(arch.class_name)
    if refused is not None:
        with pytest.raises(RuntimeError, match=f"nothing initialised .*{re.escape(refused)}.*init=fn"):
            materialized(arch, eager)
        return
    model = materialized(arch, eager)
    with memfit.summon_full_params(model, writeback=False):
        assert_like_eager(eager.state_dict(), model.state_dict(), arch.class_name)  # [Note: Initialised like eager]


@pytest.mark.parametrize("arch", [a for a in ALL if a.id in MATERIALIZE_SAMPLE], ids=lambda a: a.id)
def test_materialize_initialises_like_eager_on_a_sample(arch, one_rank):
    _materialize(arch)


@pytest.mark.parametrize("arch", _params(ALL, dict.fromkeys(_TOO_BIG, _SHRINK)))
def test_materialize_initialises_like_eager(arch, one_rank):  # the slow tier: every architecture
    _materialize(arch)
