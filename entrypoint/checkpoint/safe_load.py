"""Read DCP checkpoints as data, never as code.

torch.distributed.checkpoint unpickles in two places: FileSystemReader.read_metadata loads
`.metadata` with `pickle.load`, and DefaultLoadPlanner.load_bytes loads every non-tensor entry
(optimizer hyper-parameters, for one) with `torch.load(weights_only=False)`. A checkpoint folder
on a shared volume is writable by others, so either would run whatever a planted pickle says.

Here `.metadata` goes through an unpickler that admits only DCP's own metadata classes (and the
torch dtypes, sizes and layouts they hold), and bytes entries load with `weights_only=True`.
Tensors are already read with `weights_only=True` by DCP itself.

What the unpickler built is then checked before DCP reads a byte by it (check_metadata): every
object is the class DCP means there, every size and offset a non-negative int (never a bool),
every chunk inside its tensor, and every storage entry a byte range inside a real file of the
checkpoint folder itself (a `relative_path` climbing out to /etc/shadow is refused, not read).
"""
from __future__ import annotations

import enum
import io
import os
import pickle
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as md
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import StorageMeta

from contracts.folder_guard import is_real_file

METADATA_MODULE = "torch.distributed.checkpoint.metadata"
ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),      # maps a layout's name to the torch.layout object
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpoint(Exception):
    """A checkpoint file asked to construct something other than checkpoint data."""


def enum_member(cls, name):
    """What `builtins.getattr` may do in checkpoint metadata: name a member of an enum of the
    metadata module. Python 3.11.0-3.11.3 (Debian 12's 3.11.2, the image's Python) pickle an enum
    member as getattr(TheEnum, "MEMBER") (later releases as TheEnum(value)), and torch's metadata
    holds one (_MEM_FORMAT_ENCODING); any other getattr could reach anything, so it is refused."""
    if (isinstance(cls, type) and issubclass(cls, enum.Enum) and cls.__module__ == METADATA_MODULE
            and type(name) is str and name in cls.__members__):
        return cls.__members__[name]
    raise UnsafeCheckpoint(f"it asks for getattr({getattr(cls, '__qualname__', type(cls).__name__)}, {name!r}), "
                           "which is not a member of a checkpoint metadata enum")


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module in ("builtins", "__builtin__") and name == "getattr":    # __builtin__: protocol <= 2
            return enum_member
        if module == METADATA_MODULE and not name.startswith("__"):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"it asks to load {module}.{name}, which is not checkpoint metadata")


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as fh:
            try:
                metadata = MetadataUnpickler(fh).load()
            except UnsafeCheckpoint as exc:
                raise UnsafeCheckpoint(f"{path}: {exc}") from None
            except Exception as exc:   # noqa: BLE001 - any way a damaged pickle fails is one refusal
                raise UnsafeCheckpoint(f"{path} is not readable checkpoint metadata: "
                                       f"{type(exc).__name__}: {str(exc)[:200]}") from None
        problem = check_metadata(metadata, Path(str(self.path)))
        if problem:
            raise UnsafeCheckpoint(f"{path} is not readable checkpoint metadata: {problem}")
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
MAX_DIMS = 64


def _size_problem(size: object, where: str) -> str | None:
    if type(size) is not torch.Size or len(size) > MAX_DIMS or any(type(d) is not int or d < 0 for d in size):
        return f"{where} is not a tensor size"
    return None


def _tensor_problem(fqn: str, entry: md.TensorStorageMetadata) -> str | None:
    props = entry.properties
    if type(props) is not md.TensorProperties or not isinstance(getattr(props, "dtype", None), torch.dtype):
        return f"{fqn}: its properties are not tensor properties"
    if problem := _size_problem(entry.size, f"{fqn}: size"):
        return problem
    if type(entry.chunks) is not list:
        return f"{fqn}: chunks is not a list"
    for chunk in entry.chunks:
        if type(chunk) is not md.ChunkStorageMetadata:
            return f"{fqn}: a chunk is not chunk metadata"
        problem = _size_problem(chunk.offsets, f"{fqn}: a chunk's offsets") or \
            _size_problem(chunk.sizes, f"{fqn}: a chunk's sizes")
        if problem:
            return problem
        if len(chunk.offsets) != len(entry.size) or len(chunk.sizes) != len(entry.size) or \
                any(o + n > d for o, n, d in zip(chunk.offsets, chunk.sizes, entry.size)):
            return f"{fqn}: a chunk lies outside the tensor's size {list(entry.size)}"
    return None


def _storage_problem(index: object, info: object, names: dict, folder: Path, sizes: dict[str, int]) -> str | None:
    if type(index) is not md.MetadataIndex or type(index.fqn) is not str or index.fqn not in names:
        return "a storage entry names no tensor of the checkpoint"
    if index.offset is not None and _size_problem(index.offset, f"{index.fqn}: storage offset"):
        return f"{index.fqn}: its storage offset is not a tensor offset"
    if index.index is not None and (type(index.index) is not int or index.index < 0):
        return f"{index.fqn}: its storage index is not a non-negative int"
    if type(info) is not _StorageInfo:
        return f"{index.fqn}: its storage is not DCP storage info"
    name = info.relative_path
    if type(name) is not str or not PLAIN_NAME.fullmatch(name):
        return f"{index.fqn}: it is stored in {name!r}, which is not a file name inside the checkpoint folder"
    if name not in sizes:
        sizes[name] = os.lstat(folder / name).st_size if is_real_file(folder / name) else -1
    if sizes[name] < 0:
        return f"{index.fqn}: it is stored in {name}, which is not a file of the checkpoint folder"
    if type(info.offset) is not int or type(info.length) is not int or info.offset < 0 or info.length < 0 or \
            info.offset + info.length > sizes[name]:
        return f"{index.fqn}: its bytes ({info.offset!r} + {info.length!r}) lie outside {name} ({sizes[name]} bytes)"
    descriptors = getattr(info, "transform_descriptors", None)
    if descriptors is not None and (type(descriptors) not in (list, tuple) or
                                    any(type(d) is not str for d in descriptors)):
        return f"{index.fqn}: its transform descriptors are not names"
    return None


def check_metadata(metadata: object, folder: Path) -> str | None:
    """What is wrong with unpickled DCP metadata, or None: the shape DCP reads, nothing else."""
    if type(metadata) is not md.Metadata:
        return "it is not DCP metadata"
    entries = getattr(metadata, "state_dict_metadata", None)
    if type(entries) is not dict:
        return "state_dict_metadata is not a mapping"
    for fqn, entry in entries.items():
        if type(fqn) is not str:
            return "a state entry's name is not a string"
        if type(entry) is md.TensorStorageMetadata:
            if problem := _tensor_problem(fqn, entry):
                return problem
        elif type(entry) is not md.BytesStorageMetadata:
            return f"{fqn}: it is neither a tensor nor a bytes entry"
    storage = getattr(metadata, "storage_data", None)
    if type(storage) is not dict:
        return "storage_data is not a mapping"
    sizes: dict[str, int] = {}
    for index, info in storage.items():
        if problem := _storage_problem(index, info, entries, folder, sizes):
            return problem
    planner = getattr(metadata, "planner_data", None)
    if planner is not None and (type(planner) is not dict or any(
            type(k) is not str or type(v) not in (tuple, list) or any(type(p) not in (str, int) for p in v)
            for k, v in planner.items())):
        return "planner_data is not a mapping of names to key paths"
    if type(getattr(metadata, "storage_meta", None)) not in (StorageMeta, type(None)):
        return "storage_meta is not DCP storage metadata"
    if type(getattr(metadata, "version", None)) not in (str, type(None)):
        return "version is not a string"
    return None


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpoint(f"entry {read_item.dest_index.fqn} is not plain data: "
                                   f"{str(exc).splitlines()[0]}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
