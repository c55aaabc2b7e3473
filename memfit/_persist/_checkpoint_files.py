"""Sharded checkpoints that load at any world size: save_checkpoint and load_checkpoint."""

from __future__ import annotations

import concurrent.futures
import errno
import functools
import io
import json
import math
import mmap
import os
import pickle
import shutil
import warnings
import zlib
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from memfit._instrument import HOOKS
from memfit._persist import _atomic
from memfit._persist._async_save import SAVES
from memfit._persist._dcp_files import is_dcp_checkpoint, load_dcp_checkpoint
from memfit._shard._device import device_of_units, moved
from memfit._shard._optim_state import install_optimizer_state_hooks
from memfit._shard._param import ShardedParam
from memfit._shard._unit import ShardedModule, Unit

__all__ = ["load_checkpoint", "save_checkpoint"]

# [Note: Sharded checkpoints]
# `save_checkpoint` writes with torch.distributed.checkpoint (DCP): every sharded parameter,
# and every optimizer state tensor shaped like it, goes in as a DTensor placed Shard(0) on
# the ranks (torch.chunk layout, the same as memfit's), so each rank writes its own chunks
# and nobody gathers the model. DCP records the full shape of each tensor, so
# `load_checkpoint` at another world size reads back exactly the rows each new rank owns.
# Replicated tensors (buffers, step counters, tensors in `extra`) are written once.
# Saving is atomic: all ranks write into `<path>.tmp-<id>`; then rank 0 writes the JSON part
# (optimizer hyperparameters, `extra`), syncs, and swaps the directory in, so a kill at any
# point leaves the previous checkpoint whole (See [Note: Atomic directory replacement]).
# Every stored chunk (each tensor, or each rank's part of a sharded one) has a CRC-32 of its
# bytes in memfit.json, computed after DCP wrote the files (each rank reads back a share of
# them) and checked before anything is loaded (each rank checks a share), so that a bit flip
# or an overwritten region is refused naming the file and the tensor instead of loading as
# weights. The cost is one read of the checkpoint at save and one at load (measured in
# benchmarks/results/checkpoint_checksums_cpu.md).
# Loading never unpickles arbitrary objects: DCP's `.metadata` file is a pickle, so it is read
# first with an unpickler that admits only DCP's own metadata classes and torch sizes and
# dtypes; tensors are read by DCP with weights_only loading; the rest is JSON.


_JSON = "memfit.json"
_VERSION = 2  # 2: memfit.json holds a CRC-32 per stored chunk; 1 (no checksums) still loads
_CORRUPT = "is corrupt or not a memfit checkpoint"


def _shard_params(model: nn.Module) -> tuple[dict[int, ShardedParam], Any]:
    units = [m._memfit_unit for m in model.modules() if isinstance(m, ShardedModule)]
    if not units:
        raise ValueError(f"memfit: {type(model).__name__} is not sharded; save it with torch.save or shard it first")
    return {id(sp.sharded): sp for u in units for sp in u.params}, units[0].layout.everyone


def _as_dtensor(local: torch.Tensor, sp: ShardedParam, meshes: dict[int, DeviceMesh]) -> DTensor:
    """``local`` (this rank's rows of ``sp``, or of its optimizer state) as a DTensor on its
    unit's mesh, which is of the compute device; an offloaded shard's host chunk stays the local
    part as it is (See [Note: state_dict of a sharded model]): DTensor.from_local would copy it
    to the device, and a CPU mesh would run DCP's collectives on host tensors over NCCL."""
    full = (sp.rows, *sp.shape[1:]) if len(sp.shape) else (sp.rows,)
    stride = torch.empty(full, device="meta").stride()
    mesh = meshes[id(sp.owner)]
    place = (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))  # See [Note: Hybrid sharding]
    value = local.reshape(sp.local_rows, *full[1:])
    if value.device.type == mesh.device_type:
        return DTensor.from_local(value, mesh, place, shape=torch.Size(full), stride=stride)
    spec = DTensorSpec(mesh, place, TensorMeta(torch.Size(full), stride, value.dtype))
    return DTensor(value, spec, requires_grad=False)


def _meshes(shards: dict[int, ShardedParam]) -> dict[int, DeviceMesh]:
    """Each unit's mesh, by ``id(unit)``: its 2-D (replicate, shard) mesh when hybrid, else a
    1-D mesh over its shard group, of the device the unit computes on (offloaded units too).
    Units of one model may differ (hybrid blocks under a plainly sharded root): each
    parameter's chunks are placed on its own unit's mesh."""
    out: dict[int, DeviceMesh] = {}
    plain: dict[tuple[str, tuple[int, ...]], DeviceMesh] = {}
    for sp in shards.values():
        unit = cast(Unit, sp.owner)  # every sharded parameter has its unit by now
        if id(unit) in out:
            continue
        if unit.layout.mesh is not None:
            out[id(unit)] = unit.layout.mesh
            continue
        key = (sp.full.device.type, tuple(dist.get_process_group_ranks(unit.group)))
        if key not in plain:
            plain[key] = DeviceMesh.from_group(unit.group, key[0])
        out[id(unit)] = plain[key]
    return out


def _model_state(model: nn.Module, meshes: dict[int, DeviceMesh], shards: dict[int, ShardedParam]) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        sp = shards.get(id(t))
        state[f"model/{name}"] = _as_dtensor(t.detach(), sp, meshes) if sp else t.detach()
    return state


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _optim_state(optimizer, model, meshes, shards) -> tuple[dict[str, Any], list[dict]]:
    names = _names(model)
    state: dict[str, Any] = {}
    groups = []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params" and _jsonable(v)}
        groups.append({"params": [names[id(p)] for p in group["params"]], **hyper})
        for p in group["params"]:
            sp = shards.get(id(p))
            for k, v in optimizer.state.get(p, {}).items():
                if not torch.is_tensor(v):
                    continue
                sharded = sp is not None and v.shape == p.shape and v.dim() > 0
                state[f"optim/{names[id(p)]}/{k}"] = _as_dtensor(v, sp, meshes) if sharded else v
    return state, groups


def _jsonable(v) -> bool:
    try:
        json.dumps(v)
        return True
    except TypeError:
        return False


def save_checkpoint(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, Any] | None = None,
    async_: bool = False,
) -> concurrent.futures.Future | None:
    """Write a sharded checkpoint of ``model`` (and ``optimizer``) to directory ``path``,
    atomically; every rank must call it. ``extra`` holds what else resuming needs, by name:
    JSON values (step, data position) and tensors (saved once, from rank 0);
    :func:`load_checkpoint` returns it. Each rank writes its own chunks; :func:`load_checkpoint`
    reads them back at any world size. A kill at any moment of the save, or a full disk, leaves
    the checkpoint already at ``path`` whole and loadable (See [Note: Atomic directory
    replacement]).

    ``async_=True`` returns once this rank's state is copied to host memory and writes it in the
    background: it returns a ``concurrent.futures.Future`` whose ``result()`` waits for the write
    and raises its error. At most one save is in flight: the next save (or load) waits for it
    first. Call ``result()`` before ``destroy_process_group`` (See [Note: Asynchronous
    checkpoints])."""
    # See [Note: Sharded checkpoints]
    SAVES.wait()
    extra = {} if extra is None else extra
    if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
        raise TypeError(f"memfit.save_checkpoint: extra= takes a dict with str keys, not {type(extra).__name__}")
    shards, group = _shard_params(model)
    path = os.path.abspath(path)
    plain = {k: v for k, v in extra.items() if not torch.is_tensor(v)}
    bad = [k for k, v in plain.items() if not _jsonable(v)]
    if bad:
        raise TypeError(f"memfit.save_checkpoint: extra values {bad} are neither tensors nor JSON-serialisable")
    tmp = _begin(path, group)
    meshes = _meshes(shards)
    state = _model_state(model, meshes, shards)
    groups: list[dict] = []
    if optimizer is not None:
        opt_state, groups = _optim_state(optimizer, model, meshes, shards)
        state.update(opt_state)
    state.update({f"extra/{k}": v for k, v in extra.items() if torch.is_tensor(v)})
    # Tensors of `extra` saved from an accelerator load onto the compute device, the others
    # (an RNG state) into host memory.
    on_device = sorted(k for k, v in extra.items() if torch.is_tensor(v) and v.device.type != "cpu")
    info = {"version": _VERSION, "optimizer_groups": groups, "extra": plain, "on_device": on_device}
    if not async_:
        _finish(path, tmp, state, info, group)
        return None
    # See [Note: Asynchronous checkpoints]
    staged, writers = SAVES.stage(state), SAVES.writer_group(group)
    return SAVES.submit(path, functools.partial(_finish, path, tmp, staged, info, writers))


def _begin(path: str, group) -> str:
    """The temporary directory a save writes into. Rank 0 picks it and checks that it can be
    created, before anything else happens; every rank learns the outcome (no rank is left
    waiting in a collective)."""
    box: list[Any] = [None]
    if dist.get_rank(group) == 0:
        try:
            if os.path.lexists(path) and not os.path.isdir(path):
                raise OSError(errno.ENOTDIR, "it exists and is not a directory")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            _atomic.recover(path, is_whole, _JSON)
            box[0] = _atomic.temporary(path)
            _atomic.step("save:tmp-created")
        except OSError as e:
            box[0] = _write_error(e, path, None)
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]


def _finish(path: str, tmp: str, state: dict[str, Any], info: dict[str, Any], group) -> None:
    """Write ``state`` into ``tmp`` with DCP, checksum it, and swap it in at ``path``."""
    rank = dist.get_rank(group)
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), process_group=group)
        _atomic.step("save:written")
        checksums = None
        if HOOKS.checksums:  # of the metadata as written: torch 2.11's dcp.save returns it without storage_data
            checksums = _checksums(tmp, _unpickle_metadata(os.path.join(tmp, ".metadata")), group)
        _atomic.step("save:checksummed")
    except BaseException as e:  # CheckpointException is a BaseException; every rank gets it
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, (KeyboardInterrupt, SystemExit)) and _atomic.is_no_space(e):
            raise _write_error(e, path, _nbytes(state)) from None
        raise
    box: list[Any] = [None]
    if rank == 0:
        try:
            with open(os.path.join(tmp, _JSON), "w") as f:
                json.dump({**info, "checksums": checksums} if checksums is not None else info, f)
                f.flush()
                os.fsync(f.fileno())
            _atomic.step("save:info-written")
            _atomic.replace(tmp, path, _JSON)
            _atomic.recover(path, is_whole, _JSON)  # what earlier saves killed midway left
            _atomic.step("save:done")
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)  # unfinished, or the previous one after an exchange
            box[0] = _write_error(e, path, _nbytes(state))
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    if isinstance(box[0], Exception):
        raise box[0]


def is_whole(path: str) -> bool:
    """Whether ``path`` holds a checkpoint whose save finished (memfit.json is written last)."""
    return os.path.isfile(os.path.join(path, ".metadata")) and os.path.isfile(os.path.join(path, _JSON))


def whole_copy(path: str) -> str:
    """``path``, or where its checkpoint is while ``path`` is missing: a save killed between the
    two renames of a filesystem without RENAME_EXCHANGE left it at ``<path>.old-<id>`` (the
    next save moves it back). See [Note: Atomic directory replacement]."""
    parent, base = os.path.split(path)
    if os.path.lexists(path) or not os.path.isdir(parent):
        return path
    olds = sorted(n for n in os.listdir(parent) if n.startswith(f"{base}.old-"))
    return next((os.path.join(parent, n) for n in reversed(olds) if is_whole(os.path.join(parent, n))), path)


def _not_a_checkpoint(path: str) -> str:
    """Why ``path`` is no memfit checkpoint, for the error: missing, a file, a directory of
    checkpoints (naming them), a Hugging Face Trainer checkpoint, or an incomplete save."""
    if not os.path.exists(path):
        return f"{path!r} does not exist"
    if not os.path.isdir(path):
        return f"{path!r} is a file; a memfit checkpoint is a directory (what memfit.save_checkpoint wrote)"
    names = sorted(os.listdir(path))
    inside = [n for n in names if is_whole(os.path.join(path, n))]
    if "trainer_state.json" in names:
        within = f"; the memfit checkpoint in it is {os.path.join(path, inside[0])!r}" if inside else ""
        return (
            f"{path!r} is a Hugging Face Trainer checkpoint (trainer_state.json), not a memfit one{within}; "
            "resume it with Trainer.train(resume_from_checkpoint=...), or load its weights with from_pretrained"
        )
    if inside:
        shown = ", ".join(inside[-5:]) + (f" and {len(inside) - 5} more" if len(inside) > 5 else "")
        newest = os.path.join(path, inside[-1])
        return (
            f"{path!r} is a directory of checkpoints ({shown}), not one checkpoint; "
            f"pass one of them, e.g. the last: {newest!r}"
        )
    return f"{path!r} is not a complete memfit checkpoint (no .metadata and memfit.json: an unfinished save?)"


def _nbytes(state: dict[str, Any]) -> int:
    """The bytes of the tensors a save writes, over all ranks."""
    return sum(math.prod(v.shape) * v.element_size() for v in state.values() if torch.is_tensor(v))


def _write_error(e: BaseException, path: str, needed: int | None) -> OSError:
    """The error a save that could not write raises: a full disk says so, with what it needed."""
    kept = f"the checkpoint at {path!r} is untouched" if is_whole(path) else f"nothing was at {path!r}"
    if _atomic.is_no_space(e):
        return _atomic.no_space("memfit.save_checkpoint", path, needed, kept)
    code = getattr(e, "errno", None) or errno.EIO
    reason = getattr(e, "strerror", None) or str(e)
    return OSError(code, f"memfit.save_checkpoint: cannot write to {path!r}: {reason}; {kept}")


def _chunks(meta) -> list[tuple[str, str, int, int]]:
    """(chunk name, file, offset, length) of every stored chunk, by file and offset."""
    out = []
    for index, info in (meta.storage_data or {}).items():
        corner = tuple(index.offset or ())
        name = index.fqn + (f" (chunk at {list(corner)})" if any(corner) else "")
        out.append((info.relative_path, info.offset, info.length, name))
    return [(name, rel, offset, length) for rel, offset, length, name in sorted(out)]


def _crc32(file: str, ranges: list[tuple[int, int]]) -> list[int]:
    """The CRC-32 of each (offset, length) byte range of ``file``, read through a memory map
    (no copies: the cost is the checksum itself, about 3 GB/s, on page-cached files)."""
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return [zlib.crc32(b"") if n == 0 else -1 for _, n in ranges]
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m, memoryview(m) as view:
            return [zlib.crc32(view[o : o + n]) if o + n <= size else -1 for o, n in ranges]


def _my_files(chunks: list, group) -> set[str]:
    """This rank's share of the checkpoint's files (file i goes to rank i mod world)."""
    files = sorted({rel for _, rel, _, _ in chunks})
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return {rel for i, rel in enumerate(files) if i % world == rank}


def _by_file(chunks: list, files: set[str]) -> dict[str, list[tuple[str, int, int]]]:
    out: dict[str, list[tuple[str, int, int]]] = {}
    for name, rel, offset, length in chunks:
        if rel in files:
            out.setdefault(rel, []).append((name, offset, length))
    return out


def _checksums(path: str, meta, group) -> dict[str, dict]:
    """chunk name -> {"file", "crc32"} of every stored chunk; each rank reads its share of files."""
    chunks = _chunks(meta)
    local = {}
    for rel, items in _by_file(chunks, _my_files(chunks, group)).items():
        crcs = _crc32(os.path.join(path, rel), [(o, n) for _, o, n in items])
        local.update({name: {"file": rel, "crc32": crc} for (name, _, _), crc in zip(items, crcs)})
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, local, group=group)
    return {k: v for part in parts for k, v in part.items()}


def _verify(path: str, meta, checksums: dict[str, dict], group) -> None:
    """Refuse (on every rank) a checkpoint whose bytes differ from the checksums written at save."""
    # See [Note: Sharded checkpoints]
    chunks = _chunks(meta)
    bad = None
    for rel, items in _by_file(chunks, _my_files(chunks, group)).items():
        crcs = _crc32(os.path.join(path, rel), [(o, n) for _, o, n in items])
        for (name, _, _), crc in zip(items, crcs):
            want = checksums.get(name)
            if want is None or want["file"] != rel:
                bad = f"{_JSON} has no checksum for tensor '{name}' in {rel!r}"
            elif crc != want["crc32"]:
                bad = (
                    f"{os.path.join(path, rel)!r} is corrupt: the bytes of tensor '{name}' differ from those "
                    "written at save (CRC-32 mismatch)"
                )
            if bad:
                break
        if bad:
            break
    found: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, bad, group=group)
    first = next((b for b in found if b), None)
    if first:
        raise RuntimeError(
            f"memfit.load_checkpoint: {first}; restore the file from a copy or load an earlier checkpoint"
        )


class _Refused(pickle.UnpicklingError):
    """The metadata pickle names a global that checkpoint metadata never contains."""


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata dataclasses, torch sizes and dtypes, and builtins; nothing else."""

    _ALLOWED = frozenset(
        {
            ("torch", "Size"),
            ("torch", "device"),
            ("torch.serialization", "_get_layout"),  # a layout by name: torch.strided
            ("builtins", "set"),
            ("builtins", "frozenset"),
            ("builtins", "tuple"),
            ("builtins", "list"),
            ("builtins", "dict"),
            ("collections", "OrderedDict"),
            ("pathlib", "PosixPath"),
            ("pathlib", "PurePosixPath"),
            ("pathlib", "WindowsPath"),
            ("pathlib", "PureWindowsPath"),
        }
    )
    _MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")

    def find_class(self, module: str, name: str):
        if module in self._MODULES or (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, (torch.dtype, torch.memory_format)):
            return value
        raise _Refused(f"{module}.{name}")


def _read_metadata(path: str):
    """DCP's pickled metadata of the checkpoint at ``path``, unpickled safely."""
    # See [Note: Sharded checkpoints]
    meta_path = os.path.join(path, ".metadata")
    if not os.path.isfile(meta_path) or not os.path.isfile(os.path.join(path, _JSON)):
        raise FileNotFoundError(f"memfit.load_checkpoint: {path!r} is not a complete memfit checkpoint")
    return _unpickle_metadata(meta_path)


def _unpickle_metadata(meta_path: str):
    with open(meta_path, "rb") as f:
        data = f.read()
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except _Refused as e:
        raise RuntimeError(
            f"memfit.load_checkpoint: refusing {meta_path!r}: it asks to load {e}, which a checkpoint's "
            "metadata never contains (it could run arbitrary code)"
        ) from None
    except Exception as e:  # truncated, garbled, another file
        raise RuntimeError(f"memfit.load_checkpoint: {meta_path!r} {_CORRUPT} ({type(e).__name__})") from None


def _read_info(path: str) -> dict:
    """memfit.json of the checkpoint at ``path``: optimizer groups, extra, checksums."""
    file = os.path.join(path, _JSON)
    try:
        with open(file) as f:
            info = json.load(f)
        if not isinstance(info, dict) or not {"optimizer_groups", "extra"} <= info.keys():
            raise ValueError("not memfit's fields")
    except (ValueError, UnicodeDecodeError) as e:
        what = "is empty" if os.path.getsize(file) == 0 else f"cannot be read ({e})"
        raise RuntimeError(f"memfit.load_checkpoint: {file!r} {what}: the checkpoint {_CORRUPT}") from None
    return info


def _check_files(path: str, meta) -> None:
    ends: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for rel, end in ends.items():
        file = os.path.join(path, rel)
        size = os.path.getsize(file) if os.path.isfile(file) else -1
        if size < end:
            raise RuntimeError(
                f"memfit.load_checkpoint: {file!r} is {'missing' if size < 0 else f'truncated ({size} of {end} bytes)'}"
            )


def _check_keys(meta, state: dict[str, Any], what: str) -> None:
    saved = {k for k in meta.state_dict_metadata if k.startswith(what + "/")}
    wanted = {k for k in state if k.startswith(what + "/")}
    missing, unexpected = sorted(wanted - saved), sorted(saved - wanted)
    if missing or unexpected:
        cut = len(what) + 1
        raise RuntimeError(
            f"memfit.load_checkpoint: the checkpoint does not match this {what}: missing keys "
            f"{[k[cut:] for k in missing][:10]}, unexpected keys {[k[cut:] for k in unexpected][:10]}"
        )
    for k in sorted(wanted):
        m = meta.state_dict_metadata[k]
        t = state[k]
        if tuple(m.size) != tuple(t.shape) or m.properties.dtype != t.dtype:
            raise RuntimeError(
                f"memfit.load_checkpoint: '{k[len(what) + 1 :]}' is {m.properties.dtype}{list(m.size)} in the "
                f"checkpoint but {t.dtype}{list(t.shape)} here"
            )


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load a checkpoint written by :func:`save_checkpoint`, at this world size (any); every
    rank must call it. Returns ``extra``. Refuses, naming what differs: another model's
    checkpoint (missing and unexpected keys), other shapes or dtypes, truncated or missing
    files, bytes that differ from the checksums written at save (naming file and tensor),
    unreadable files ("corrupt or not a memfit checkpoint"), and metadata that would unpickle
    anything but checkpoint metadata."""
    SAVES.wait()  # a load of what an asynchronous save is writing reads it whole
    path = whole_copy(os.path.abspath(path))
    if is_dcp_checkpoint(path):  # See [Note: memfit's checkpoint files and DCP's]
        return load_dcp_checkpoint(path, model, optimizer)
    if not is_whole(path):
        raise FileNotFoundError(f"memfit.load_checkpoint: {_not_a_checkpoint(path)}")
    shards, group = _shard_params(model)
    meta = _read_metadata(path)
    _check_files(path, meta)
    info = _read_info(path)
    if info.get("checksums"):
        _verify(path, meta, info["checksums"], group)
    elif "checksums" in info and meta.storage_data and dist.get_rank(group) == 0:
        warnings.warn(
            f"memfit.load_checkpoint: {path!r} records no checksums (memfit saved none under torch 2.11 "
            "before 2026-11-27): its bytes are loaded unverified; save it again to have them checked",
            stacklevel=2,
        )
    meshes = _meshes(shards)
    state = _model_state(model, meshes, shards)
    _check_keys(meta, state, "model")
    opt_keys: dict[str, tuple[torch.Tensor, str]] = {}
    if optimizer is not None:
        names = _names(model)
        by_name = {names[id(p)]: p for g in optimizer.param_groups for p in g["params"]}
        for key, m in meta.state_dict_metadata.items():
            if not key.startswith("optim/"):
                continue
            pname, k = key[len("optim/") :].rsplit("/", 1)
            p = by_name.get(pname)
            if p is None:
                raise RuntimeError(f"memfit.load_checkpoint: the optimizer has no parameter '{pname}'")
            sp = shards.get(id(p))
            if sp is not None and tuple(m.size) == (sp.rows, *sp.shape[1:]) and len(m.size) > 0:
                local = torch.zeros_like(p.detach(), dtype=m.properties.dtype)
                state[key] = _as_dtensor(local, sp, meshes)
            else:
                local = torch.zeros(tuple(m.size), dtype=m.properties.dtype)
                state[key] = local
            opt_keys[key] = (p, k)
    extra_keys = [k for k in meta.state_dict_metadata if k.startswith("extra/")]
    for key in extra_keys:
        m = meta.state_dict_metadata[key]
        state[key] = torch.zeros(tuple(m.size), dtype=m.properties.dtype)
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), process_group=group)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise RuntimeError(
            f"memfit.load_checkpoint: {path!r} {_CORRUPT}: torch could not read its tensors ({type(e).__name__})"
        ) from None
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            v = state[f"model/{name}"]
            t.copy_(v.to_local().reshape(t.shape) if isinstance(v, DTensor) else v)
    if optimizer is not None:
        for group_state, saved in zip(optimizer.param_groups, info["optimizer_groups"]):
            group_state.update({k: v for k, v in saved.items() if k != "params"})
        groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        for key, (p, k) in opt_keys.items():
            v = state[key]
            v = v.to_local().reshape(p.shape) if isinstance(v, DTensor) else v
            optimizer.state[p][k] = placed_state(v, p, groups[id(p)], k)
        install_optimizer_state_hooks(optimizer)  # its state_dict() speaks DTensors before any step
    extra = dict(info["extra"])
    device = device_of_units([sp.owner for sp in shards.values()]) if shards else torch.device("cpu")
    on_device = set(info.get("on_device", []))
    for key in extra_keys:
        name = key[len("extra/") :]
        extra[name] = moved(state[key], device) if name in on_device else state[key]
    return extra


def placed_state(value: torch.Tensor, param: torch.Tensor, group: dict, key: str) -> torch.Tensor:
    """A loaded optimizer state tensor (a copy), where and as torch's ``Optimizer.load_state_dict``
    puts it: ``step`` on the parameter's device as fp32 for fused and capturable optimizers (they
    read it on the device), else in host memory as saved (read on the host without a sync);
    any other tensor on the parameter's device (in host memory for offloaded shards)."""
    if key == "step":
        if group.get("fused") or group.get("capturable"):
            return value.to(dtype=torch.float32, device=param.device, copy=True)
        return value.clone()
    return moved(value, param.device, copy=True)
