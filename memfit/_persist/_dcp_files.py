"""Checkpoints written by torch's state-dict API and DCP, read by ``memfit.load_checkpoint``."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = ["is_dcp_checkpoint", "load_dcp_checkpoint"]

# [Note: memfit's checkpoint files and DCP's]
# Both are torch.distributed.checkpoint directories, with different keys. `memfit.save_checkpoint`
# writes "model/<name>" and "optim/<name>/<state>" plus memfit.json (optimizer groups, extra,
# checksums); torch's recipe (`msd, osd = get_state_dict(model, opt)`, `dcp.save({"model": msd,
# "optim": osd})`) writes "model.<name>", "optim.state.<name>.<state>" and
# "optim.param_groups.<name>.<hyperparameter>" and no memfit.json. `memfit.load_checkpoint` reads
# both (the latter through get_state_dict / dcp.load / set_state_dict, at any world size;
# "optimizer" is accepted for "optim"). `dcp.load` of memfit's files needs memfit's keys: load
# them with `memfit.load_checkpoint`.

_MODEL, _OPTIM = "model", ("optim", "optimizer")


def is_dcp_checkpoint(path: str) -> bool:
    """A DCP directory without memfit.json: written by torch's API, not memfit.save_checkpoint."""
    return os.path.isfile(os.path.join(path, ".metadata")) and not os.path.isfile(os.path.join(path, "memfit.json"))


def load_dcp_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """Load a DCP checkpoint of ``{"model": ..., "optim": ...}`` (torch's state-dict API) into
    ``model`` and ``optimizer``; returns {} (such a checkpoint has no memfit ``extra``)."""
    reader = dcp.FileSystemReader(path)
    tops = {k.split(".", 1)[0] for k in reader.read_metadata().state_dict_metadata}
    optim_key = next((k for k in _OPTIM if k in tops), None)
    if _MODEL not in tops or (optimizer is not None and optim_key is None):
        want = "'model'" + (" and 'optim' (or 'optimizer')" if optimizer is not None else "")
        raise RuntimeError(
            f"memfit.load_checkpoint: {path!r} is a torch.distributed.checkpoint directory without memfit.json, "
            f"whose top-level keys are {sorted(tops)}; memfit reads such a directory when it holds {want}, as "
            "`dcp.save({'model': msd, 'optim': osd})` writes them after `msd, osd = get_state_dict(model, opt)`. "
            "Load other layouts with torch.distributed.checkpoint.load and set_state_dict."
        )
    opts = (optimizer,) if optimizer is not None else ()
    msd, osd = get_state_dict(model, opts)
    state: dict[str | None, Any] = {_MODEL: msd, **({optim_key: osd} if optimizer is not None else {})}
    dcp.load(state, storage_reader=reader)
    set_state_dict(
        model, opts, model_state_dict=state[_MODEL], optim_state_dict=state[optim_key] if optimizer is not None else {}
    )
    return {}
