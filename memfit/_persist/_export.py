"""`memfit.export_safetensors`: the full, unsharded weights of a sharded model, in the format
the rest of the ecosystem loads (HF transformers' sharded safetensors layout), and
``save_pretrained`` on a sharded HF model, which writes through it."""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import math
import os
import re
import shutil
import uuid
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from memfit._persist import _atomic
from memfit._shard._unit import ShardedModule, Unit, units_of, user_class

__all__ = ["SavePretrained", "export_safetensors"]

# [Note: Exported weights]
# Rank 0 writes one safetensors file per unit holding parameters, then one for the tensors no
# unit owns (buffers, parameters left unsharded), skipping any that would be empty, plus
# `model.safetensors.index.json` whose weight_map names each tensor's file. A unit's shards
# are gathered to rank 0 only, in the shards' own dtype (fp32 master weights under mixed
# precision, never the compute copy), so rank 0 holds one unit in full at a time and the other
# ranks none. A parameter registered under several names (a tied LM head) is written once,
# under its first name in `state_dict()` order (the input embedding for HF models, which is
# what `from_pretrained` expects: it ties the head again); the index's metadata lists the
# names left out ("tied": {name: written name}). Every floating tensor is written in one dtype,
# `dtype=` (default: the parameters' own dtype). HF models also get `config.json` (with
# `architectures` and `dtype` set, as `save_pretrained` writes them) and, when they generate,
# `generation_config.json`: `from_pretrained(path)` needs nothing else.
# Over an earlier export the index is the pointer that switches atomically: the new shard files
# get names the current index does not use (the usual names, or with a `.v<id>` tag when the
# earlier export holds them), are written and synced, then the new index replaces the old one
# with a rename, and only then are the files it no longer names deleted. A kill at any moment
# leaves an index whose files are all there and all from one export; a full disk removes the
# new files and leaves the old index. Other files in the directory (a tokenizer, a Trainer's
# logs) are never touched, which is why an export does not swap the whole directory as a
# checkpoint does (See [Note: Atomic directory replacement]). config.json and
# generation_config.json are rewritten (each atomically) just before the index: they differ
# between two exports of one model only in `dtype` when `dtype=` differs.


@torch.no_grad()
def export_safetensors(model: nn.Module, path: str, *, dtype: torch.dtype | None = None) -> None:
    """Write ``model``'s full weights under their original names to directory ``path``.

    Files: ``model-0000i-of-0000n.safetensors`` (one per sharded unit, and one for buffers and
    unsharded parameters, none empty) and ``model.safetensors.index.json``; for HF models also
    ``config.json`` (and ``generation_config.json``), so ``AutoModel...from_pretrained(path)``
    loads it as it is, and ``load_state_dict(..., strict=False)`` or ``from_pretrained`` on a
    plain model. A parameter tied under several names is written once, under its first name.
    Every floating tensor is written in ``dtype`` (default: the parameters' own dtype, fp32
    under mixed precision). Every rank must call it; rank 0 writes, holding one unit in full
    at a time. Over an earlier export, a kill at any moment or a full disk leaves the earlier
    one whole; other files in ``path`` are left alone. See [Note: Exported weights].
    """
    from safetensors.torch import save_file

    units = units_of(model)
    group = units[0].layout.everyone  # one rank writes, whatever the replicas
    rank = dist.get_rank(group)
    path = os.path.abspath(path)
    owned = [u for u in units if u.params]
    dtype = dtype or (owned[0].params[0].sharded.dtype if owned else torch.float32)
    names, tied = _names(model, units)
    sharded_ids = {id(t) for u in units for sp in u.params for t in (sp.sharded, sp.full)}
    rest = [n for n, t in model.state_dict(keep_vars=True).items() if id(t) not in sharded_ids and n not in tied]
    files = [names[id(u)] for u in owned if names[id(u)]] + ([rest] if rest else [])
    n_files = len(files)
    weight_map: dict[str, str] = {}
    total = 0
    index = 0
    failed: BaseException | None = None
    tag = ""
    if rank == 0:
        try:
            os.makedirs(path, exist_ok=True)
            _remove_unlisted(path)
            tag = _tag(path, n_files)
            _atomic.step("export:started")
        except OSError as e:
            failed = e
    for u in owned:
        full = _gather_to_rank0(u)  # every rank takes part, also after rank 0 failed to write
        if rank == 0 and names[id(u)] and failed is None:
            index += 1
            by_id = {id(sp): t for sp, t in full}
            tensors = {key: _cast(by_id[id(sp)], dtype) for key, sp in names[id(u)]}
            try:
                total += _write(save_file, tensors, path, _file_name(index, n_files, tag), weight_map)
                _atomic.step("export:shard-written")
            except Exception as e:  # safetensors' own error on a full disk
                failed = e
    if rank == 0 and failed is None:
        try:
            if rest:
                state = model.state_dict(keep_vars=True)
                tensors = {n: _cast(state[n].detach().cpu(), dtype) for n in rest}
                total += _write(save_file, tensors, path, _file_name(index + 1, n_files, tag), weight_map)
            _write_hf_configs(model, path, dtype)
            _atomic.step("export:configs-written")
            metadata = {"total_size": total, **({"tied": tied} if tied else {})}
            _atomic.sync_dir(path)  # the new files' names are durable before the index names them
            index_text = json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2)
            _replace_file(os.path.join(path, _INDEX), index_text)
            _atomic.step("export:index-written")
            _atomic.sync_dir(path)
            _remove_unlisted(path)
            _atomic.step("export:done")
        except Exception as e:
            failed = e
    box: list[Any] = [None]
    if rank == 0 and failed is not None:
        with contextlib.suppress(OSError):
            _remove_unlisted(path)  # the new shard files the index does not name
        state = model.state_dict()
        needed = sum(_nbytes(sp.shape, dtype, sp.sharded) for u in owned for _, sp in names[id(u)])
        needed += sum(_nbytes(state[n].shape, dtype, state[n]) for n in rest)
        box[0] = _export_error(failed, path, needed)
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    if box[0] is not None:
        raise box[0] from (failed if rank == 0 else None)


_INDEX = "model.safetensors.index.json"
_CONFIG_TMP = ".memfit-configs.tmp-"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}(\.v[0-9a-f]{8})?\.safetensors")


def _file_name(i: int, n: int, tag: str) -> str:
    return f"model-{i:05d}-of-{n:05d}{tag}.safetensors"


def _listed(path: str) -> set[str]:
    """The files the export index at ``path`` names (none when there is no readable index)."""
    try:
        with open(os.path.join(path, _INDEX)) as f:
            return set(json.load(f)["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def _tag(path: str, n: int) -> str:
    """ "" (the usual names) unless one of them is taken by the export in ``path``: then a version
    tag, so the new files never overwrite the ones the current index names."""
    listed = _listed(path)
    if not any(_file_name(i, n, "") in listed for i in range(1, n + 1)):
        return ""
    return f".v{uuid.uuid4().hex[:8]}"


def _remove_unlisted(path: str) -> None:
    """Delete the export files in ``path`` that its index does not name (a replaced export's, or
    those of one killed or failed before its index was written), and temporary index files."""
    listed = _listed(path)
    for name in os.listdir(path):
        stale = _SHARD.fullmatch(name) and name not in listed
        if stale or name.startswith(f"{_INDEX}.tmp-"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(path, name))
        elif name.startswith(_CONFIG_TMP):
            shutil.rmtree(os.path.join(path, name), ignore_errors=True)


def _replace_file(file: str, text: str) -> None:
    """Write ``text`` to ``file`` atomically: a synced temporary file renamed over it."""
    tmp = f"{file}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, file)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype, like: torch.Tensor) -> int:
    """The bytes of a tensor of ``shape`` written as ``like`` would be (floating ones in ``dtype``)."""
    return math.prod(shape) * (dtype.itemsize if like.is_floating_point() else like.element_size())


def _export_error(e: BaseException, path: str, needed: int) -> OSError:
    kept = "an earlier export there is untouched" if _listed(path) else "no export was there"
    if _atomic.is_no_space(e):
        return _atomic.no_space("memfit.export_safetensors", path, needed, kept)
    code = getattr(e, "errno", None) or errno.EIO
    return OSError(code, f"memfit.export_safetensors: cannot write to {path!r}: {e}; {kept}")


def _names(model: nn.Module, units: list[Unit]) -> tuple[dict[int, list], dict[str, str]]:
    """Each unit's (first name, parameter) pairs, in state_dict order; and the tied names left out."""
    # A unit that computes now registers its full tensors: either one stands for the parameter.
    by_param = {id(t): (u, sp) for u in units for sp in u.params for t in (sp.sharded, sp.full)}
    names: dict[int, list] = {id(u): [] for u in units}
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in by_param:
            continue
        if id(t) in first:
            tied[name] = first[id(t)]
            continue
        first[id(t)] = name
        u, sp = by_param[id(t)]
        names[id(u)].append((name, sp))
    return names, tied


def _gather_to_rank0(unit: Unit) -> list:
    """[(ShardedParam, full tensor on the CPU)] on rank 0 (empty elsewhere), from the shards."""
    device = unit.params[0].full.device  # the compute device: what the group's backend talks to
    dtype = unit.params[0].sharded.dtype
    send = torch.zeros(sum(sp.slot_numel for sp in unit.params), dtype=dtype, device=device)
    offset = 0
    for sp in unit.params:
        send[offset : offset + sp.local_numel].copy_(sp.sharded.detach().reshape(-1))
        offset += sp.slot_numel
    root = dist.get_global_rank(unit.group, 0)
    slots = [torch.empty_like(send) for _ in range(unit.world)] if unit.rank == 0 else None
    dist.gather(send, slots, dst=root, group=unit.group)
    if unit.rank != 0:
        return []
    assert slots is not None  # rank 0 gathered into them
    out, offset = [], 0
    for sp in unit.params:
        rows = [slots[r][offset : offset + sp.rows_of(r) * sp.row_numel] for r in range(unit.world)]
        out.append((sp, torch.cat(rows).reshape(sp.shape).cpu()))
        offset += sp.slot_numel
    return out


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (t.to(dtype) if t.is_floating_point() else t).contiguous()


def _write(save_file, tensors: dict[str, torch.Tensor], path: str, name: str, weight_map: dict[str, str]) -> int:
    file = os.path.join(path, name)
    save_file(tensors, file, metadata={"format": "pt"})
    os.chmod(file, 0o666 & ~_umask())  # safetensors writes 0600; as config.json and any new file
    with open(file, "rb") as f:
        os.fsync(f.fileno())
    for key in tensors:
        weight_map[key] = name
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _umask() -> int:
    """The process's umask (read by setting it back at once; there is no other way to read it)."""
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


def _write_hf_configs(model: nn.Module, path: str, dtype: torch.dtype) -> None:
    """config.json (and generation_config.json) of an HF model, each replacing the old one atomically."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    config = copy.deepcopy(config)
    config.architectures = [user_class(model).__name__]
    config.dtype = dtype
    tmp = os.path.join(path, f"{_CONFIG_TMP}{uuid.uuid4().hex[:8]}")
    try:
        config.save_pretrained(tmp)
        generation = getattr(model, "generation_config", None)
        can_generate = getattr(model, "can_generate", lambda: False)
        if generation is not None and can_generate():
            generation.save_pretrained(tmp)
        for name in sorted(os.listdir(tmp)):
            with open(os.path.join(tmp, name), "rb") as f:
                os.fsync(f.fileno())
            os.replace(os.path.join(tmp, name), os.path.join(path, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class SavePretrained(ShardedModule):
    """Mixed into sharded HF ``PreTrainedModel`` classes: ``save_pretrained`` writes full weights."""

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        is_main_process: bool = True,
        state_dict: dict | None = None,
        *,
        dtype: torch.dtype | None = None,
        push_to_hub: bool = False,
        **kwargs,
    ) -> None:
        """Write the full model to ``save_directory`` so ``from_pretrained`` loads it (every
        rank must call this; rank 0 writes, one unit at a time: see :func:`export_safetensors`).

        ``dtype``: the dtype of the written weights (default: the parameters' own).
        ``is_main_process`` is ignored (rank 0 of the model's group writes); a ``state_dict``
        and ``push_to_hub`` are refused; HF's other arguments (``max_shard_size``,
        ``safe_serialization``) are ignored: one safetensors file per sharded unit.
        """
        del is_main_process, kwargs
        if state_dict is not None:
            raise ValueError(
                f"memfit: save_pretrained(state_dict=...) on a sharded {user_class(self).__name__}: leave it out; "
                "the full weights are gathered one unit at a time (see memfit.export_safetensors)"
            )
        if push_to_hub:
            raise NotImplementedError("memfit: save_pretrained(push_to_hub=True) on a sharded model: save, then push")
        export_safetensors(cast(nn.Module, self), os.fspath(save_directory), dtype=dtype)
