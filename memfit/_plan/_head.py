"""The LM head and its loss as a planner decision: plain (full logits) or chunked
(`memfit.chunked_cross_entropy`: never more than a chunk of logits at once)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

from memfit._plan._loss import chunked_cross_entropy

# [Note: The head as a decision]
# A masked or causal LM's head turns N = batch x seq hidden states into N x V logits, and its
# loss adds their log-softmax and, in backward, their gradient: on BERT-MLM the logits were
# 238 of the 274 MiB that full checkpointing keeps. No block decision touches them. Chunking the
# head and the loss (see [Note: Chunked head and loss]) replaces them with a chunk's logits, at
# the price of the head's matmul once more in backward. The planner measures both on fake
# tensors (the chunked step is a second profiled step of the same skeleton), prices the
# difference on the device profile, and solves the block decisions once with each head: the
# plan with the least extra time that fits wins. It applies to transformers models whose output
# embedding is an nn.Linear under a base model (BERT-like masked LMs, GPT-2, Llama and other
# causal LMs); the chunked forward returns only the loss.


@dataclass(frozen=True)
class LMHead:
    """Where a transformers LM's head is, for its chunked forward."""

    base: str  # the body returning hidden states (model.base_model_prefix)
    transform: str | None  # a transform before the projection (BERT's cls.predictions.transform)
    proj: str  # the vocabulary projection (an nn.Linear)
    shift: bool  # causal LM: position t predicts label t + 1


def find_head(model: nn.Module) -> LMHead | None:
    """The LM head of a transformers masked or causal LM, or None for any other model."""
    get = getattr(model, "get_output_embeddings", None)
    proj = get() if callable(get) else None
    prefix = getattr(model, "base_model_prefix", "")
    if not isinstance(proj, nn.Linear) or not prefix or not hasattr(model, prefix):
        return None
    name = type(model).__name__
    if name.endswith("ForMaskedLM"):
        shift = False
    elif name.endswith(("ForCausalLM", "LMHeadModel")):
        shift = True
    else:
        return None
    paths = {id(m): p for p, m in model.named_modules()}
    proj_path = paths[id(proj)]
    parent = model.get_submodule(proj_path.rsplit(".", 1)[0]) if "." in proj_path else model
    transform = getattr(parent, "transform", None)
    return LMHead(prefix, paths[id(transform)] if isinstance(transform, nn.Module) else None, proj_path, shift)


class _ChunkedForward:
    """The instance-level ``forward`` of a model whose head is chunked. A class, not a closure:
    ``copy.deepcopy(model)`` gives the copy a forward over the copy's own modules, and the model
    still pickles. It shows the plain forward's signature (the HF Trainer keeps the batch's
    columns by it) and honours ``num_items_in_batch`` as the plain loss does (the Trainer passes
    it with gradient accumulation: the loss is then a sum over that many tokens)."""

    def __init__(self, model: nn.Module, head: LMHead, chunk_size: int | None) -> None:
        self.model, self.head, self.chunk_size = model, head, chunk_size
        self.__signature__ = inspect.signature(type(model).forward.__get__(model))

    def __call__(self, *args, labels=None, num_items_in_batch=None, **kwargs):
        model, head = self.model, self.head
        if labels is None:
            raise ValueError(
                f"memfit: {type(model).__name__}'s head is chunked (memfit.plan decided so): its forward needs "
                "labels= and returns only the loss; plan with chunk_head=False to keep the plain head"
            )
        kwargs.pop("return_dict", None)
        hidden = model.get_submodule(head.base)(*args, **kwargs)[0]
        if head.transform is not None:
            hidden = model.get_submodule(head.transform)(hidden)
        if head.shift:
            hidden, labels = hidden[..., :-1, :], labels[..., 1:]
        chunk = self.chunk_size or min(1024, max(16, labels.numel() // 8))
        proj = model.get_submodule(head.proj)
        loss = chunked_cross_entropy(hidden, proj.weight, labels, bias=proj.bias, chunk_size=chunk)
        if num_items_in_batch is not None:  # a sum over the tokens, divided by the batch's count
            loss = loss * (labels != -100).sum() / num_items_in_batch
        from transformers.modeling_outputs import CausalLMOutput, MaskedLMOutput  # a transformers model's head

        return (CausalLMOutput if head.shift else MaskedLMOutput)(loss=loss)


def chunk_head(model: nn.Module, head: LMHead, chunk_size: int | None = None) -> nn.Module:
    """Make ``model(**batch)`` compute its loss with :func:`memfit.chunked_cross_entropy`
    (in place; ``unchunk_head`` undoes it). The output has ``.loss`` only (no logits).
    ``chunk_size``: rows per chunk; None: an eighth of the rows, from 16 to 1024."""
    model.forward = _ChunkedForward(model, head, chunk_size)
    return model


def unchunk_head(model: nn.Module) -> nn.Module:
    model.__dict__.pop("forward", None)
    return model
