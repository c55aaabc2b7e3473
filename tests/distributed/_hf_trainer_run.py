"""Run under torchrun by test_hf_trainer.py: the same Trainer script with DDP, then switched to
memfit (MemfitTrainer, blocks checkpointed), then resumed from its step-2 checkpoint.
Rank 0 writes what it saw to the JSON file named by the first argument."""

import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import Trainer, TrainingArguments
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

import memfit
import memfit.testing
from memfit.integrations.transformers import MemfitTrainer
from tests._models import tiny_gpt2

STEPS = 4


def dataset():
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 97, (4 * STEPS, 16), generator=g)]


def arguments(out, save):
    return TrainingArguments(
        output_dir=out,
        max_steps=STEPS,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy="steps" if save else "no",
        save_steps=2,
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
    )


def record_losses(model):
    """Each forward's loss on this rank (exact: the Trainer's logs round to 4 digits)."""
    losses = []
    model.register_forward_hook(lambda m, a, out: losses.append(out.loss.item()))
    return losses


def main(result_path, root):
    args = arguments(os.path.join(root, "ddp"), save=False)  # sets up torch.distributed
    model = tiny_gpt2()
    ddp_losses = record_losses(model)
    Trainer(model=model, args=args, train_dataset=dataset()).train()

    # The switch: the import and the class name, and (optionally) a checkpointing policy.
    model = tiny_gpt2()
    memfit_losses = record_losses(model)
    trainer = MemfitTrainer(
        model=model,
        args=arguments(os.path.join(root, "mf"), save=True),
        train_dataset=dataset(),
        checkpointing=GPT2Block,
    )
    trainer.train()
    with memfit.summon_full_params(trainer.model, writeback=False):
        final = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    model = tiny_gpt2(seed=1)  # other weights: resuming must bring back the step-2 state
    resumed_losses = record_losses(model)
    trainer = MemfitTrainer(
        model=model,
        args=arguments(os.path.join(root, "mf"), save=True),
        train_dataset=dataset(),
        checkpointing=GPT2Block,
    )
    trainer.train(resume_from_checkpoint=os.path.join(root, "mf", "checkpoint-2"))
    with memfit.summon_full_params(trainer.model, writeback=False):
        resumed = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, (ddp_losses, memfit_losses, resumed_losses))
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(os.path.join(root, "mf", "checkpoint-4"))
        got = dict(loaded.named_parameters())
        with open(result_path, "w") as f:
            json.dump(
                {
                    "losses": losses,
                    "resumed_params_equal": all(torch.equal(resumed[n], final[n]) for n in final),
                    "exported_params_equal": all(torch.equal(got[n], final[n]) for n in got),
                    "files": sorted(os.listdir(os.path.join(root, "mf", "checkpoint-2"))),
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
