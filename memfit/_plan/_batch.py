"""The example batch checked against the model before planning: a batch the real step would
refuse must not be planned for.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

IGNORE_INDEX = -100  # the labels cross-entropy skips (transformers, torch's default)


# [Note: Checking the batch before planning]
# The planner runs the step on fake tensors, which carry shapes and dtypes but no values, and
# an embedding lookup on fake tensors never reads the ids. So a 128-token batch for a model with
# 64 learned positions, or ids beyond the vocabulary, profiled without complaint and "fit", and
# the real step then failed (an index error, or a device-side assert on a GPU). ``check_batch``
# reads what the model says about itself (a transformers ``config``, or its input embedding) and
# refuses, naming the argument and the limit:
#   - token ids (``input_ids``; a tensor or the first positional argument of a transformers
#     model) must be an integer tensor [batch, seq];
#   - their values in [0, vocabulary size), and ``labels`` too, except the ignored -100;
#   - ``token_type_ids`` below the config's ``type_vocab_size``;
#   - seq at most the positions the model learned (an ``nn.Embedding`` as large as the config's
#     ``max_position_embeddings`` or ``n_positions``: BERT, GPT-2). Rotary models (Llama) have no
#     such table and run longer sequences; they are not limited here.
# Values are read only from tensors that have them (not on the meta device).
def check_batch(model: nn.Module, example_inputs: object) -> None:
    """Raise ValueError when ``example_inputs`` cannot run through ``model``'s real step. See
    [Note: Checking the batch before planning]."""
    named = _named_tensors(model, example_inputs)
    ids = named.get("input_ids")
    if ids is None:
        return
    where = _where(example_inputs, "input_ids")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(
            f"memfit.plan: {where} holds token ids and must be an integer tensor (torch.long), got {ids.dtype}"
        )
    if ids.dim() != 2:
        raise ValueError(
            f"memfit.plan: {where} must be [batch, seq] token ids, got shape {list(ids.shape)}; "
            "add the batch dimension (ids.unsqueeze(0)) or reshape"
        )
    positions = _learned_positions(model)
    if positions is not None and ids.shape[1] > positions[0]:
        raise ValueError(
            f"memfit.plan: {where} has {ids.shape[1]} positions (shape {list(ids.shape)}) but the model learned "
            f"{positions[0]} ({positions[1]}); use sequences of at most {positions[0]} tokens, or a model with more "
            "positions"
        )
    vocab = _vocab_size(model)
    if vocab is not None:
        _check_range(ids, vocab, where, "vocabulary size")
        labels = named.get("labels")
        if labels is not None and not labels.is_floating_point():
            _check_range(labels, vocab, _where(example_inputs, "labels"), "vocabulary size", IGNORE_INDEX)
    types = named.get("token_type_ids")
    type_vocab = getattr(getattr(model, "config", None), "type_vocab_size", None)
    if types is not None and isinstance(type_vocab, int):
        _check_range(types, type_vocab, _where(example_inputs, "token_type_ids"), "config.type_vocab_size")


def _named_tensors(model: nn.Module, inputs: object) -> dict[str, torch.Tensor]:
    """The batch's tensors by the names a transformers model takes: a dict's keys; a tensor or
    the first positional argument is ``input_ids`` when the model has a transformers config."""
    if isinstance(inputs, dict):
        return {k: v for k, v in inputs.items() if torch.is_tensor(v)}
    hf = getattr(model, "config", None) is not None
    if hf and torch.is_tensor(inputs):
        return {"input_ids": inputs}
    if hf and isinstance(inputs, (tuple, list)) and inputs and torch.is_tensor(inputs[0]):
        return {"input_ids": inputs[0]}
    return {}


def _where(inputs: object, name: str) -> str:
    return f"example_inputs[{name!r}]" if isinstance(inputs, dict) else "example_inputs (the token ids)"


def _check_range(t: torch.Tensor, limit: int, where: str, what: str, ignore: int | None = None) -> None:
    if t.device.type == "meta" or t.numel() == 0:
        return
    # Outside any dispatch mode: a MemoryMeter around memfit.plan would count the caller's
    # batch as read here, and the planner holds no tensor memory of its own.
    with _disable_current_modes():
        low, high = int(t.min()), int(t.max())
        if ignore is not None and low == ignore:
            low = int(t[t != ignore].min()) if high != ignore else low
    if ignore is not None and high == ignore:  # every value ignored
        return
    if low < 0 or high >= limit:
        bad = high if high >= limit else low
        allowed = f"in [0, {limit})" + (f" or {ignore} (ignored)" if ignore is not None else "")
        raise ValueError(
            f"memfit.plan: {where} holds {bad}, but the model's {what} is {limit}: every value must be {allowed}; "
            "tokenize with the model's own tokenizer, or use a model whose vocabulary covers the ids"
        )


def _vocab_size(model: nn.Module) -> int | None:
    """How many token ids the model embeds: its config's vocab_size, else its input embedding."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(vocab, int) and vocab > 0:
        return vocab
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    return embedding.num_embeddings if isinstance(embedding, nn.Embedding) else None


def _learned_positions(model: nn.Module) -> tuple[int, str] | None:
    """The positions a model learned an embedding for, and the config key that says so."""
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions"):
        n = getattr(config, key, None)
        if isinstance(n, int) and any(
            isinstance(m, nn.Embedding) and m.num_embeddings == n and ("position" in name or name.endswith("wpe"))
            for name, m in model.named_modules()
        ):
            return n, f"config.{key}"
    return None
