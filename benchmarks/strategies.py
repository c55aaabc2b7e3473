"""Checkpointing strategies applied to an HF BERT-MLM, memfit's and the alternatives'."""

from __future__ import annotations

import copy
import functools
import tempfile
import warnings

import torch

import memfit
from memfit.models import bert_layer_class

STRATEGIES = (
    "none",
    "memfit full",
    "memfit selective (linear)",
    "memfit selective (matmul)",
    "memfit full + offload=disk",
    "torch.utils.checkpoint",
    "torch checkpoint_wrapper",
    "fairscale checkpoint_wrapper",
)


def prepare(strategy: str, base: torch.nn.Module, offload_dir: str | None = None) -> torch.nn.Module:
    """A deep copy of ``base`` with ``strategy`` applied to every BertLayer."""
    model = copy.deepcopy(base)
    layer = bert_layer_class()
    memfit_decisions = {
        "memfit full": memfit.Decision("full"),
        "memfit selective (linear)": memfit.Decision("selective", save="linear"),
        "memfit selective (matmul)": memfit.Decision("selective", save="matmul"),
        "memfit full + offload=disk": memfit.Decision(
            "offload", offload=memfit.Offload("disk", directory=offload_dir or tempfile.gettempdir())
        ),
    }
    if strategy in memfit_decisions:
        memfit_decisions[strategy].apply_to(model, layer)
    elif strategy == "torch.utils.checkpoint":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif strategy == "torch checkpoint_wrapper":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            apply_activation_checkpointing,
            checkpoint_wrapper,
        )

        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
            check_fn=lambda m: isinstance(m, layer),
        )
    elif strategy == "fairscale checkpoint_wrapper":
        from fairscale.nn.checkpoint import checkpoint_wrapper

        layers = model.bert.encoder.layer
        for i, blk in enumerate(layers):
            layers[i] = checkpoint_wrapper(blk)
    elif strategy != "none":
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {STRATEGIES}")
    model.train()
    return model
