"""Training tokens. By default text this machine already has: the Python standard library's
sources, read as bytes (a byte-level tokenizer: ids 0-255; BERT's mask token is 256). `memfit
train --data` reads the user's: text files (bytes, or a local tokenizer.json) or a token array.
Nothing is downloaded."""

from __future__ import annotations

import functools
import glob
import os
import sysconfig
from dataclasses import dataclass

import numpy as np
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
    return window_batch(corpus().numpy(), arch, batch, seq, step, seed, MASK_ID)


@dataclass(frozen=True)
class Tokens:
    """A training run's token ids: a train split and a held-out tail for evaluation."""

    train: np.ndarray  # 1-D token ids (a memory map for .npy/.bin files)
    val: np.ndarray  # the last --val-fraction of the ids (empty when 0)
    vocab: int  # ids are < vocab
    mask_id: int  # the id masked-LM training replaces tokens with (vocab when the ids have none)
    source: str  # what was read, for the log


def load_tokens(data: str | None, tokenizer: str | None, val_fraction: float, seq: int) -> Tokens:
    """The tokens of ``data``: None (the standard library's sources, bytes), a ``.npy`` or
    nanoGPT ``.bin`` (uint16) array of ids, or a text file or a directory of them (tokenized
    with the ``tokenizer.json`` at ``tokenizer`` when given, else bytes: ids 0-255)."""
    if data is None:
        ids, vocab, mask, source = corpus().numpy(), 256, MASK_ID, "Python standard library sources, bytes"
    elif data.endswith((".npy", ".bin")):
        ids = np.load(data, mmap_mode="r") if data.endswith(".npy") else np.memmap(data, dtype=np.uint16, mode="r")
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ValueError(f"memfit train: {data!r} must hold a 1-D array of integer token ids, not {ids.dtype}")
        vocab, source = int(ids.max()) + 1, f"{data} ({len(ids)} token ids)"
        mask = vocab
    else:
        ids, vocab, mask, source = _text_tokens(data, tokenizer)
    if not 0 <= val_fraction < 1:
        raise ValueError("memfit train: --val-fraction must be in [0, 1)")
    cut = len(ids) - int(len(ids) * val_fraction)
    if cut < seq + 2:
        raise ValueError(
            f"memfit train: {source} has {cut} training tokens, fewer than one sequence of {seq} (+2); "
            "give more text, a smaller --seq or a smaller --val-fraction"
        )
    return Tokens(ids[:cut], ids[cut:], vocab, mask, source)


def _text_tokens(data: str, tokenizer: str | None) -> tuple[np.ndarray, int, int, str]:
    if os.path.isdir(data):
        files = sorted(p for p in glob.glob(os.path.join(data, "**", "*"), recursive=True) if os.path.isfile(p))
    elif os.path.isfile(data):
        files = [data]
    else:
        raise ValueError(f"memfit train: --data {data!r}: no such file or directory")
    if not files:
        raise ValueError(f"memfit train: --data {data!r} holds no files")
    raw = [open(p, "rb").read() for p in files]
    source = f"{data} ({len(files)} file{'s' * (len(files) > 1)}"
    if tokenizer is None:
        ids = np.frombuffer(b"".join(raw), dtype=np.uint8)
        return ids, 256, MASK_ID, source + ", bytes)"
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(tokenizer)
    except Exception as e:  # the tokenizers library raises its own Exception types
        raise ValueError(f"memfit train: cannot read the tokenizer {tokenizer!r}: {e}") from None
    encoded = tok.encode_batch([r.decode("utf-8", errors="replace") for r in raw])
    ids = np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in encoded])
    mask = tok.token_to_id("[MASK]")
    vocab = tok.get_vocab_size()
    return ids, vocab, vocab if mask is None else mask, source + f", {tokenizer}: {vocab} ids)"


def window_batch(
    ids: np.ndarray, arch: str, batch: int, seq: int, step: int, seed: int, mask_id: int
) -> dict[str, torch.Tensor]:
    """Batch number ``step`` of ``ids``: consecutive windows (wrapping around); masked as
    :func:`batch_at` says for BERT, next-token labels otherwise."""
    n = len(ids) - seq - 1
    starts = [((step * batch + i) * seq) % n for i in range(batch)]
    rows = torch.from_numpy(np.stack([np.asarray(ids[s : s + seq], dtype=np.int64) for s in starts]))
    return _labelled(rows, arch, step, seed, mask_id)


def _labelled(ids: torch.Tensor, arch: str, step: int, seed: int, mask_id: int) -> dict[str, torch.Tensor]:
    if arch != "bert":
        return {"input_ids": ids, "labels": ids.clone()}
    g = torch.Generator().manual_seed(seed * 100003 + step)
    masked = torch.rand(ids.shape, generator=g) < 0.15
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    return {"input_ids": torch.where(masked, torch.full_like(ids, mask_id), ids), "labels": labels}


def check_first_batch(command: str, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> None:
    """Refuse a batch the model cannot take (a sequence longer than the positions it learned,
    ids beyond its vocabulary) before the first step, naming the flags, whether or not a planner
    runs: memfit.plan's check (See [Note: Checking the batch before planning]), in the command's
    words."""
    from memfit._plan._batch import check_batch

    try:
        check_batch(model, batch)
    except ValueError as e:
        rows, seq = batch["input_ids"].shape
        detail = str(e).removeprefix("memfit.plan: ")
        raise ValueError(f"{command}: --batch {rows} x --seq {seq} cannot run through the model: {detail}") from None
