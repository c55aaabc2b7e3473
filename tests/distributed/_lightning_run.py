"""Run under torchrun by test_lightning.py: the same LightningModule fitted with Lightning's DDP
strategy, then with MemfitStrategy (blocks sharded and checkpointed, ModelCheckpoint every
epoch), then resumed with fit(ckpt_path=...) from the first epoch's checkpoint.
Rank 0 writes what it saw to the JSON file named by the first argument."""

import json
import os
import sys

import lightning
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

import memfit
import memfit.testing
from memfit.integrations.lightning import MemfitStrategy
from tests._models import AttnBlock, TinyLM

EPOCHS = 2  # 2 steps per epoch: 8 sequences, 2 per rank and step, 2 ranks


class LitLM(lightning.LightningModule):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = TinyLM()
        self.losses = []  # this rank's loss at each step
        self.checkpointed = []  # blocks waiting to be recomputed, after each forward

    def forward(self, ids):
        return self.net(ids)

    def training_step(self, ids, batch_idx):
        logits = self(ids)
        self.checkpointed.append(memfit.testing.live_checkpoint_frames())
        loss = nn.functional.cross_entropy(logits.reshape(-1, 37), ids.reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data():
    ids = torch.randint(0, 37, (8, 8), generator=torch.Generator().manual_seed(0))
    return DataLoader(list(ids), batch_size=2, shuffle=False)


def trainer(root, strategy, callbacks=()):
    return lightning.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=EPOCHS,
        gradient_clip_val=0.5,
        default_root_dir=root,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=bool(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )


def params(module):
    with memfit.summon_full_params(module, writeback=False):
        return {n: p.detach().clone() for n, p in module.named_parameters()}


def main(result_path, root):
    lightning.seed_everything(0)
    ddp = LitLM()
    trainer(root, "ddp").fit(ddp, data())

    strategy = MemfitStrategy(auto_wrap_policy=AttnBlock, checkpointing=AttnBlock)
    ckpt = ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), every_n_epochs=1, save_top_k=-1)
    mf = LitLM()
    trainer(root, strategy, [ckpt]).fit(mf, data())
    units = sorted(u.name for u in memfit.testing.sharded_units(mf))
    final = params(mf)
    saved = sorted(os.listdir(os.path.join(root, "ckpt")))

    resumed = LitLM(seed=1)  # other weights: resuming must bring back the epoch-1 state
    strategy = MemfitStrategy(auto_wrap_policy=AttnBlock, checkpointing=AttnBlock)
    trainer(root, strategy).fit(resumed, data(), ckpt_path=os.path.join(root, "ckpt", saved[0]))
    again = params(resumed)

    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, (ddp.losses, mf.losses, resumed.losses))
    if dist.get_rank() == 0:
        with open(result_path, "w") as f:
            json.dump(
                {
                    "losses": losses,
                    "units": units,
                    "saved": saved,
                    "files": sorted(os.listdir(os.path.join(root, "ckpt", saved[0]))),
                    "checkpointed": [ddp.checkpointed, mf.checkpointed],
                    "resumed_params_equal": all(torch.equal(again[n], final[n]) for n in final),
                },
                f,
            )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # Every process group freed before the interpreter's teardown, so that gloo's threads end
    # while it lives (see [Note: Ending a process group] in memfit/cli/_launch.py): a group that
    # something still holds fails the run, naming it.
    left = memfit.testing.end_process_group()
    if left:
        sys.exit(f"rank {os.environ['RANK']}: {', '.join(left)} outlived destroy_process_group()")
