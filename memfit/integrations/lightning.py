"""PyTorch Lightning with memfit sharding: ``Trainer(strategy=MemfitStrategy(...))``.

::

    from memfit.integrations.lightning import MemfitStrategy

    trainer = L.Trainer(strategy=MemfitStrategy(auto_wrap_policy=Block, checkpointing=Block), devices=2)
    trainer.fit(module, data)

See [Note: The Lightning strategy] for what it does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from typing import Any, cast

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

import memfit
from memfit._shard._options import FIELDS, split_kwargs
from memfit._shard._unit import ShardedModule

__all__ = ["MemfitStrategy"]

# [Note: The Lightning strategy]
# MemfitStrategy is DDPStrategy (process group, ranks, samplers, reduce/broadcast/barrier, the
# launchers) with memfit in place of the DDP wrapper:
# - setup shards the LightningModule itself, in place (memfit.FullyShardedDataParallel: one
#   unit per `auto_wrap_policy` module, the root with the rest), after applying the
#   activation-checkpointing policy or Plan; names and `state_dict()` keys do not change.
#   Build the optimizer in `configure_optimizers` from `self.parameters()`, as usual.
# - training_step / validation_step / ... are called through the module's `__call__` (Lightning's
#   forward redirection), so the root unit's hooks gather its parameters around the step.
# - Gradient clipping (`Trainer(gradient_clip_val=...)`, by norm) uses memfit.clip_grad_norm_,
#   the norm over every rank's shards; gradient accumulation uses the model's no_sync().
# - A checkpoint (`trainer.save_checkpoint(path)`, ModelCheckpoint) is a directory: the model
#   and the optimizer as memfit.save_checkpoint writes them (each rank its own chunks, loadable
#   at any world size), plus `lightning.pt` (rank 0) with the rest of Lightning's checkpoint
#   (loops, callbacks, schedulers, hyperparameters). `fit(ckpt_path=...)` resumes from it.

_LIGHTNING_FILE = "lightning.pt"


class MemfitStrategy(DDPStrategy):
    """Lightning strategy that shards the LightningModule with memfit (ZeRO-3) instead of DDP.

    Args:
        checkpointing: activation checkpointing before sharding: a ``memfit.Plan`` or a policy
            for ``memfit.apply_activation_checkpointing`` (block class(es) or a callable).
        options: a ``memfit.ShardOptions`` (``auto_wrap_policy``: which submodules become their
            own sharding unit, None: one unit for the whole module; ``mixed_precision``,
            ``offload``, ``reshard_after_forward``, ...).
        **kwargs: any field of ``memfit.ShardOptions`` (or its torch FSDP spelling), passed to
            ``memfit.FullyShardedDataParallel`` as it is; the rest are DDPStrategy's
            (``process_group_backend``, ``timeout``, ...).
    """

    strategy_name = "memfit"

    def __init__(
        self,
        *,
        checkpointing: memfit.Plan | type | tuple | Callable[[nn.Module], bool] | None = None,
        options: memfit.ShardOptions | None = None,
        **kwargs: Any,
    ) -> None:
        shard_kwargs, kwargs = split_kwargs(kwargs)
        super().__init__(**kwargs)
        memfit.ShardOptions.from_kwargs(options, **{k: v for k, v in shard_kwargs.items() if k in FIELDS})  # checks
        # Resolved at setup, when the process group exists (torch's spellings may build a mesh)
        self._shard_options = (options, shard_kwargs)
        self._checkpointing = checkpointing

    # -- setup ----------------------------------------------------------------------------------

    def setup(self, trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        if not isinstance(self.model, ShardedModule):
            self.model_to_device()
            self.model = self._setup_model(self.model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self._clip_with_memfit()
        if trainer.state.fn == TrainerFn.FITTING:
            for opt in self.optimizers:
                for state in opt.state.values():
                    for k, v in state.items():
                        if isinstance(v, torch.Tensor):
                            state[k] = v.to(self.root_device)

    def _setup_model(self, model: nn.Module) -> nn.Module:  # type: ignore[override]  # sharded, not DDP
        """Apply activation checkpointing, then shard ``model`` in place (See [Note: The Lightning strategy])."""
        if isinstance(self._checkpointing, memfit.Plan):
            self._checkpointing.apply(model)
        elif self._checkpointing is not None:
            memfit.apply_activation_checkpointing(model, self._checkpointing)
        options, kwargs = self._shard_options
        return cast(nn.Module, memfit.FullyShardedDataParallel(model, options=options, **kwargs))

    def _clip_with_memfit(self) -> None:
        plugin = self.precision_plugin

        def clip_grad_by_norm(optimizer, clip_val: float) -> None:
            memfit.clip_grad_norm_(cast(nn.Module, self.model), clip_val)

        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]  # memfit's norm, over the shards

    # -- steps: through the module's __call__, so the root unit's hooks run ----------------------

    def _redirect(self, context, name: str, *args: Any, **kwargs: Any):
        with context():
            model, module = cast(nn.Module, self.model), cast(LightningModule, self.lightning_module)  # set up
            return self._forward_redirection(model, module, name, *args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any):
        return self._redirect(self.precision_plugin.train_step_context, "training_step", *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any):
        return self._redirect(self.precision_plugin.val_step_context, "validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any):
        return self._redirect(self.precision_plugin.test_step_context, "test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any):
        return self._redirect(self.precision_plugin.predict_step_context, "predict_step", *args, **kwargs)

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        """Nothing to prepare: the sharded model hooks its own backward."""

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        """Nothing to flush: the sharded model reduces its gradients itself."""

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        if isinstance(self.model, ShardedModule):
            with self.model.no_sync():
                yield None
        else:
            yield None

    def teardown(self) -> None:
        """Lightning's teardown without moving the model to the CPU: a sharded unit's gathered
        tensors live on the compute device, so the model stays where it was sharded."""
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # -- checkpoints ----------------------------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the model is sharded and the optimizer built before the checkpoint loads

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restored it

    def _optimizer(self):
        if len(self.optimizers) > 1:
            raise NotImplementedError("MemfitStrategy: checkpoints hold one optimizer; configure_optimizers made more")
        return getattr(self.optimizers[0], "_optimizer", self.optimizers[0]) if self.optimizers else None

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """Every rank writes its chunks (memfit.save_checkpoint); rank 0 adds the rest of ``checkpoint``."""
        if storage_options is not None:
            raise TypeError("MemfitStrategy.save_checkpoint: storage_options are not supported")
        path = str(self.broadcast(str(filepath)))
        checkpoint = dict(checkpoint)
        checkpoint.pop("state_dict", None)
        optimizer = self._optimizer() if checkpoint.pop("optimizer_states", None) is not None else None
        memfit.save_checkpoint(path, cast(nn.Module, self.model), optimizer)
        if self.is_global_zero:
            torch.save(checkpoint, os.path.join(path, _LIGHTNING_FILE))
        self.barrier()

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = str(self.broadcast(str(checkpoint_path)))
        if not os.path.isfile(os.path.join(path, _LIGHTNING_FILE)):
            raise ValueError(
                f"MemfitStrategy: {path!r} is not a checkpoint MemfitStrategy saved (no {_LIGHTNING_FILE})"
            )
        fitting = cast(LightningModule, self.lightning_module).trainer.state.fn == TrainerFn.FITTING
        memfit.load_checkpoint(path, cast(nn.Module, self.model), self._optimizer() if fitting else None)
        return torch.load(os.path.join(path, _LIGHTNING_FILE), weights_only=weights_only)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing to do: load_checkpoint loaded the model."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing to do: load_checkpoint loaded the optimizer."""
