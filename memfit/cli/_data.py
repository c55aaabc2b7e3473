"""Training tokens from text this machine already has: the Python standard library's sources,
read as bytes (a byte-level tokenizer: ids 0-255; BERT's mask token is 256). Nothing is
downloaded."""

from __future__ import annotations

import functools
import glob
import os
import sysconfig

import torch

MASK_ID = 256


@functools.cache
def corpus(max_bytes: int = 16 * 2**20) -> torch.Tensor:
    """The concatenated bytes of the standard library's top-level .py files (sorted), as int64 ids."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    if not files:
        raise RuntimeError("memfit: found no Python standard library sources to read tokens from")
    chunks, total = [], 0
    for path in files:
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).to(torch.int64)


def batch_at(arch: str, batch: int, seq: int, step: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Batch number ``step``: consecutive windows of the corpus (wrapping around). For BERT, 15%
    of positions are replaced by the mask token and predicted; for causal LMs every next token."""
    tokens = corpus()
    n = tokens.numel() - seq - 1
    starts = [((step * batch + i) * seq) % n for i in range(batch)]
    ids = torch.stack([tokens[s : s + seq] for s in starts])
    if arch != "bert":
        return {"input_ids": ids, "labels": ids.clone()}
    g = torch.Generator().manual_seed(seed * 100003 + step)
    masked = torch.rand(ids.shape, generator=g) < 0.15
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    return {"input_ids": torch.where(masked, torch.full_like(ids, MASK_ID), ids), "labels": labels}
