"""`memfit.chunked_cross_entropy`: an LM head and its loss without the full logits."""

from __future__ import annotations

import torch
from torch import nn

# [Note: Chunked head and loss]
# An LM head's logits are N x V (tokens x vocabulary): on BERT-MLM with 6 layers they were 238
# of the 274 MiB that full checkpointing keeps, and the loss adds their log-softmax and, in
# backward, their gradient, each N x V again. The chunked loss computes, for C rows at a time,
# the logits, their logsumexp and the target's logit, and keeps only the N logsumexps; backward
# recomputes each chunk's logits and turns them into the gradients of the hidden states and of
# the head's weight at once. Live at any moment beyond the inputs: one chunk's logits and their
# gradient, 2 x C x V elements, instead of about 3 x N x V. The cost: the head's matmul runs
# twice (once more in backward).


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk: int, ignore_index: int):
        n, acc = hidden.shape[0], torch.promote_types(hidden.dtype, torch.float32)
        lse = hidden.new_empty(n, dtype=acc)
        total = hidden.new_zeros((), dtype=acc)
        valid = labels != ignore_index
        for s in range(0, n, chunk):
            logits = nn.functional.linear(hidden[s : s + chunk], weight, bias).to(acc)
            lse[s : s + chunk] = torch.logsumexp(logits, dim=-1)
            y = labels[s : s + chunk].clamp(min=0)
            target = logits.gather(1, y[:, None]).squeeze(1)
            total += ((lse[s : s + chunk] - target) * valid[s : s + chunk]).sum()
            del logits  # before the next chunk's exist
        count = valid.sum().clamp(min=1)
        ctx.save_for_backward(hidden, weight, bias, labels, lse, count)
        ctx.chunk, ctx.ignore_index = chunk, ignore_index
        return (total / count).to(hidden.dtype)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, labels, lse, count = ctx.saved_tensors
        scale = grad / count
        d_hidden = torch.empty_like(hidden)
        d_weight = torch.zeros_like(weight, dtype=lse.dtype)
        d_bias = torch.zeros_like(bias, dtype=lse.dtype) if bias is not None else None
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s : s + ctx.chunk]
            y = labels[s : s + ctx.chunk]
            g = nn.functional.linear(h, weight, bias).to(lse.dtype)
            g.sub_(lse[s : s + ctx.chunk, None]).exp_()  # the softmax, in place of the logits
            g.scatter_add_(1, y.clamp(min=0)[:, None], torch.full_like(g[:, :1], -1.0))
            g *= (y != ctx.ignore_index)[:, None] * scale
            d_hidden[s : s + ctx.chunk] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            d_weight += g.T @ h.to(lse.dtype)
            if d_bias is not None:
                d_bias += g.sum(0)
            del g
        return (
            d_hidden,
            d_weight.to(weight.dtype),
            d_bias.to(bias.dtype) if d_bias is not None else None,
            None,
            None,
            None,
        )


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int = 1024,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels``, computed
    ``chunk_size`` rows at a time so the full logits never exist (see [Note: Chunked head and
    loss]). Equal to ``F.cross_entropy(F.linear(hidden, weight, bias), labels,
    ignore_index=ignore_index)`` up to float rounding.

    Args:
        hidden: (..., H) the last hidden states (flattened to rows).
        weight: (V, H) the LM head's weight (tied embeddings: the embedding's weight).
        labels: (...) target ids; ``ignore_index`` marks positions without a loss. Shift them
            yourself for next-token prediction.
    """
    if chunk_size < 1:
        raise ValueError(f"memfit.chunked_cross_entropy: chunk_size must be >= 1, got {chunk_size}")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"memfit.chunked_cross_entropy: hidden {list(hidden.shape)} and labels {list(labels.shape)} must "
            "agree in every dimension but the last"
        )
    rows = hidden.reshape(-1, hidden.shape[-1])
    return _ChunkedCrossEntropy.apply(rows, weight, bias, labels.reshape(-1), chunk_size, ignore_index)
