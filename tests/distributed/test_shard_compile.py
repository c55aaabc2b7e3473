"""Sharding + activation checkpointing + per-block torch.compile (torchtitan's order: checkpoint,
compile each block, then shard) on HF GPT-2 at W=2: the same losses as the same recipe in eager
over 3 optimizer steps, bitwise (inductor draws dropout with eager's RNG under fallback_random)."""

import copy

import torch
import torch._inductor.config

from tests._dist import run_ranks


def _losses(rank, world, base, ids, compiled: bool) -> list[float]:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    import memfit

    model = copy.deepcopy(base)
    memfit.apply_activation_checkpointing(model, GPT2Block)
    if compiled:
        for block in model.transformer.h:
            block.compile(backend="inductor")
    model = memfit.FullyShardedDataParallel(model, auto_wrap_policy={GPT2Block})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(3):
        torch.manual_seed(10 + step * world + rank)  # dropout differs per rank and step
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def compiled_vs_eager(rank, world):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch._inductor.config.fallback_random = True
    cfg = GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2, n_positions=64, use_cache=False)
    cfg.bos_token_id = cfg.eos_token_id = 0
    torch.manual_seed(0)
    base = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 128, (2 * world, 16), generator=torch.Generator().manual_seed(1)).chunk(world)[rank]
    return _losses(rank, world, base, ids, False), _losses(rank, world, base, ids, True)


def test_sharded_checkpointed_compiled_blocks_match_eager():
    for eager, compiled in run_ranks(compiled_vs_eager, 2, timeout=600):
        assert compiled == eager
