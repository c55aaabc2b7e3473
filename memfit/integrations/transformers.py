"""HF transformers' Trainer with memfit sharding (and optionally activation checkpointing).

Switching a Trainer script over takes the import and the class name::

    from memfit.integrations.transformers import MemfitTrainer

    trainer = MemfitTrainer(model=model, args=args, train_dataset=ds, checkpointing=GPT2Block)
    trainer.train()

launched with ``torchrun --nproc-per-node=N script.py`` as before. See [Note: The HF Trainer
with memfit] for what changes inside.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer

import memfit
from memfit._shard._options import split_kwargs
from memfit._shard._unit import ShardedModule
from memfit.cli._launch import end_process_group_at_exit

__all__ = ["MemfitTrainer", "shard_pretrained_model"]

# [Note: The HF Trainer with memfit]
# MemfitTrainer shards the model when it is built (memfit.FullyShardedDataParallel, one unit
# per block class the model names in `_no_split_modules` unless told otherwise), after applying
# the checkpointing policy or Plan if one is given. Then, inside the Trainer:
# - Accelerate prepares the model without wrapping it in DDP (the sharded model reduces its own
#   gradients) and without moving it; autocast and torch.compile still apply.
# - Gradient clipping uses memfit.clip_grad_norm_ (the norm over every rank's shards).
# - A checkpoint directory holds what a plain Trainer writes (the full model via
#   save_pretrained, rank 0, one unit at a time; scheduler, RNG states, trainer state) plus
#   `memfit/`: memfit.save_checkpoint's sharded model and optimizer state, each rank writing its
#   own chunks. Resuming (`train(resume_from_checkpoint=...)`) reads `memfit/` back, at any
#   world size; a directory without it (a plain HF checkpoint) loads the full weights.
# - `save_model()` / `save_pretrained` must run on every rank (they gather); the Trainer's own
#   calls do.

MEMFIT_DIR = "memfit"


def shard_pretrained_model(
    model: nn.Module,
    *,
    checkpointing: memfit.Plan | type | tuple | Callable[[nn.Module], bool] | None = None,
    options: memfit.ShardOptions | None = None,
    **kwargs,
) -> nn.Module:
    """Checkpoint (optionally) and shard an HF model in place; returns it.

    Args:
        checkpointing: a ``memfit.Plan`` (from ``memfit.plan(model, batch, budget=...)``) or a
            policy for ``memfit.apply_activation_checkpointing`` (a block class, classes or a
            ``callable(module) -> bool``); None: no activation checkpointing.
        options: a ``memfit.ShardOptions``; its ``auto_wrap_policy`` defaults to the classes
            named in the model's ``_no_split_modules`` (its blocks), and the model is moved to
            its ``device`` (the Trainer's ``args.device``) first.
        **kwargs: any field of ``memfit.ShardOptions`` (or its torch FSDP spelling), replacing
            that field of ``options``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "memfit.integrations.transformers: no process group. Launch the script with torchrun "
            "(torchrun --nproc-per-node=N script.py; N=1 works too) and build TrainingArguments before the trainer."
        )
    if isinstance(model, ShardedModule):
        return model
    options = memfit.ShardOptions.from_kwargs(options, **kwargs)
    if options.device is not None and not any(p.is_meta for p in model.parameters()):
        model.to(options.device)
    if isinstance(checkpointing, memfit.Plan):
        checkpointing.apply(model)
    elif checkpointing is not None:
        memfit.apply_activation_checkpointing(model, checkpointing)
    if options.auto_wrap_policy is None:
        options = dataclasses.replace(options, auto_wrap_policy=_block_classes(model))
    return cast(nn.Module, memfit.FullyShardedDataParallel(model, options=options))


def _block_classes(model: nn.Module) -> set[type] | None:
    names = set(getattr(model, "_no_split_modules", None) or ())
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    return classes or None


class MemfitTrainer(Trainer):
    """``transformers.Trainer`` that trains a memfit-sharded model (see the module docstring).

    Takes the Trainer's arguments and, keyword-only, ``checkpointing``, ``options`` (a
    ``memfit.ShardOptions``; its ``device`` defaults to ``args.device``) and any field of
    ``memfit.ShardOptions`` as a keyword argument (see :func:`shard_pretrained_model`). A model
    already sharded with memfit is used as it is.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args=None,
        *rest,
        checkpointing: memfit.Plan | type | tuple | Callable[[nn.Module], bool] | None = None,
        options: memfit.ShardOptions | None = None,
        **kwargs,
    ) -> None:
        if args is not None and (getattr(args, "fsdp", None) or getattr(args, "deepspeed", None)):
            raise ValueError("MemfitTrainer shards the model itself: leave TrainingArguments' fsdp and deepspeed unset")
        shard_kwargs, kwargs = split_kwargs(kwargs)
        if model is not None:
            device = args.device if args is not None else None  # also sets up torch.distributed under torchrun
            options = memfit.ShardOptions.from_kwargs(options, **shard_kwargs)
            if options.device is None and device is not None:
                options = dataclasses.replace(options, device=device)
            model = shard_pretrained_model(model, checkpointing=checkpointing, options=options)
        super().__init__(model, args, *rest, **kwargs)
        if dist.is_available() and dist.is_initialized():
            end_process_group_at_exit()  # the Trainer leaves the group to the interpreter's teardown

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # See [Note: The HF Trainer with memfit]
        accelerator = self.accelerator
        prepare_model = accelerator.prepare_model

        def prepare_sharded(model, device_placement=None, evaluation_mode=False):
            if isinstance(model, ShardedModule):
                return prepare_model(model, device_placement=False, evaluation_mode=True)
            return prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

        clip = accelerator.clip_grad_norm_

        def clip_sharded(parameters, max_norm, norm_type=2):
            if not isinstance(self.model, ShardedModule):
                return clip(parameters, max_norm, norm_type)
            accelerator.unscale_gradients()
            return torch.tensor(memfit.clip_grad_norm_(self.model, max_norm, norm_type))

        accelerator.prepare_model = prepare_sharded
        accelerator.clip_grad_norm_ = clip_sharded

    # -- saving and resuming --------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the full model with ``save_pretrained`` (every rank must call this)."""
        if not isinstance(self.model, ShardedModule):
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        self.model.save_pretrained(output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not isinstance(self.model, ShardedModule):
            return super()._save_optimizer_and_scheduler(output_dir)
        memfit.save_checkpoint(os.path.join(output_dir, MEMFIT_DIR), self.model, _inner(self.optimizer))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))
        return None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        model = model or self.model
        path = os.path.join(resume_from_checkpoint, MEMFIT_DIR)
        if isinstance(model, ShardedModule) and os.path.isdir(path):
            memfit.load_checkpoint(path, model)
            return None
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        path = os.path.join(checkpoint, MEMFIT_DIR) if checkpoint else None
        if path is None or not isinstance(self.model, ShardedModule) or not os.path.isdir(path):
            return super()._load_optimizer_and_scheduler(checkpoint)
        memfit.load_checkpoint(path, self.model, _inner(self.optimizer))
        scheduler = os.path.join(checkpoint, "scheduler.pt")
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
        return None


def _inner(optimizer):
    """The torch optimizer inside Accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)
