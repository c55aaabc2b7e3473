"""A port of pytorch/examples' distributed/FSDP T5 script (T5_training.py with its policies,
train/validation and model_checkpointing helpers), written for torch FSDP1. Differences from the
example, all to run in seconds on a CPU with gloo: a tiny random T5 (no hub download), random
token ids for wikihow, the CPU for `torch.cuda.current_device()`, a `Config` instead of the
example's config files, and `main` returns what it measured (losses, the saved paths).

tests/distributed/test_fsdp1_t5.py runs this file as it is (torch's FSDP1), and again with the
one import line of FSDP changed to `from memfit import FullyShardedDataParallel as FSDP`.
"""

import functools
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.optim as optim
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import (
    FullStateDictConfig,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import T5Config, T5ForConditionalGeneration
from transformers.models.t5.modeling_t5 import T5Block

# -- policies/mixed_precision.py -----------------------------------------------------------------

fpSixteen = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16)  # noqa: N816
bfSixteen = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)  # noqa: N816
bfSixteen_working = MixedPrecision(  # noqa: N816
    param_dtype=torch.float32, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16
)
fp32_policy = MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32, buffer_dtype=torch.float32)

# -- policies/wrapping.py, policies/activation_checkpointing_functions.py -------------------------


def get_t5_wrapper():
    return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={T5Block})


non_reentrant_wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def check_fn(submodule):
    return isinstance(submodule, T5Block)


def apply_fsdp_checkpointing(model):
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=non_reentrant_wrapper, check_fn=check_fn)


# -- configs/fsdp.py, configs/training.py ---------------------------------------------------------


@dataclass
class Config:
    mixed_precision: MixedPrecision | None = None
    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    fsdp_activation_checkpointing: bool = True
    limit_all_gathers: bool = True
    save_dir: str = "."
    batch_size: int = 4
    epochs: int = 2
    lr: float = 2e-3
    gamma: float = 0.7
    seed: int = 0


# -- the data: random ids in place of wikihow --------------------------------------------------------


class RandomSeq2Seq(Dataset):
    def __init__(self, n, vocab=100, src_len=12, tgt_len=8, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.source = torch.randint(1, vocab, (n, src_len), generator=g)
        self.mask = torch.ones(n, src_len, dtype=torch.long)
        self.mask[:, -3:] = torch.randint(0, 2, (n, 3), generator=g)  # some padding
        self.target = torch.randint(1, vocab, (n, tgt_len), generator=g)

    def __len__(self):
        return len(self.source)

    def __getitem__(self, i):
        return {"source_ids": self.source[i], "source_mask": self.mask[i], "target_ids": self.target[i]}


# -- utils/train_utils.py ------------------------------------------------------------------------


def train(args, model, rank, world_size, train_loader, optimizer, epoch, sampler=None, device="cpu"):
    model.train()
    fsdp_loss = torch.zeros(2).to(device)
    losses = []
    if sampler:
        sampler.set_epoch(epoch)
    for batch in train_loader:
        for key in batch.keys():
            batch[key] = batch[key].to(device)
        optimizer.zero_grad()
        output = model(input_ids=batch["source_ids"], attention_mask=batch["source_mask"], labels=batch["target_ids"])
        loss = output["loss"]
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        fsdp_loss[0] += loss.item()
        fsdp_loss[1] += len(batch)
    dist.all_reduce(fsdp_loss, op=dist.ReduceOp.SUM)
    train_accuracy = fsdp_loss[0] / fsdp_loss[1]
    return train_accuracy.item(), losses


def validation(model, rank, world_size, val_loader, device="cpu"):
    model.eval()
    fsdp_loss = torch.zeros(2).to(device)
    with torch.no_grad():
        for batch in val_loader:
            for key in batch.keys():
                batch[key] = batch[key].to(device)
            output = model(
                input_ids=batch["source_ids"], attention_mask=batch["source_mask"], labels=batch["target_ids"]
            )
            fsdp_loss[0] += output["loss"].item()
            fsdp_loss[1] += len(batch)
    dist.all_reduce(fsdp_loss, op=dist.ReduceOp.SUM)
    return (fsdp_loss[0] / fsdp_loss[1]).item()


# -- model_checkpointing/checkpoint_handler.py -----------------------------------------------------

fullstate_save_policy = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)


def save_model_checkpoint(model, optimizer, rank, cfg, epoch=1):
    """saving model via rank0 cpu streaming and full_state_dict"""
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, fullstate_save_policy):
        cpu_state = model.state_dict()
    if rank == 0:
        save_full_path = os.path.join(cfg.save_dir, f"t5-{epoch}.pt")
        torch.save(cpu_state, save_full_path)
        return save_full_path
    return None


def save_optimizer_checkpoint(model, optimizer, rank, cfg, epoch=1):
    """save optimizer state via full state dict"""
    optim_state = FSDP.full_optim_state_dict(model, optimizer)  # rank0_only: {} elsewhere
    if rank == 0:
        opt_save_full_path = os.path.join(cfg.save_dir, f"t5-optimizer-{epoch}.pt")
        torch.save(optim_state, opt_save_full_path)
        return opt_save_full_path
    return None


# -- T5_training.py: fsdp_main -----------------------------------------------------------------------


def main(rank, world_size, cfg):
    torch.manual_seed(cfg.seed)
    config = T5Config(
        vocab_size=100,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
        use_cache=False,  # the key/value cache is refilled in recompute: checkpointed blocks must not use it
    )
    model = T5ForConditionalGeneration(config)
    train_set, val_set = RandomSeq2Seq(16, seed=1), RandomSeq2Seq(8, seed=2)
    sampler1 = DistributedSampler(train_set, rank=rank, num_replicas=world_size, shuffle=True, seed=cfg.seed)
    sampler2 = DistributedSampler(val_set, rank=rank, num_replicas=world_size)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler1)
    val_loader = DataLoader(val_set, batch_size=cfg.batch_size, sampler=sampler2)

    model = FSDP(
        model,
        auto_wrap_policy=get_t5_wrapper(),
        mixed_precision=cfg.mixed_precision,
        sharding_strategy=cfg.sharding_strategy,
        device_id=torch.device("cpu"),  # the example: torch.cuda.current_device()
        limit_all_gathers=cfg.limit_all_gathers,
    )
    if cfg.fsdp_activation_checkpointing:
        apply_fsdp_checkpointing(model)
    optimizer = optim.AdamW(model.parameters(), lr=cfg.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=cfg.gamma)

    out = {"train": [], "val": [], "losses": [], "saved": []}
    for epoch in range(1, cfg.epochs + 1):
        train_accuracy, losses = train(cfg, model, rank, world_size, train_loader, optimizer, epoch, sampler=sampler1)
        out["train"].append(train_accuracy)
        out["losses"] += losses
        out["val"].append(validation(model, rank, world_size, val_loader))
        scheduler.step()
    out["saved"] = [
        save_model_checkpoint(model, optimizer, rank, cfg, epoch=cfg.epochs),
        save_optimizer_checkpoint(model, optimizer, rank, cfg, epoch=cfg.epochs),
    ]
    dist.barrier()
    return out
