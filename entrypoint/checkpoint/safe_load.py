"""Read DCP checkpoints as data, never as code.

torch.distributed.checkpoint unpickles in two places: FileSystemReader.read_metadata loads
`.metadata` with `pickle.load`, and DefaultLoadPlanner.load_bytes loads every non-tensor entry
(optimizer hyper-parameters, for one) with `torch.load(weights_only=False)`. A checkpoint folder
on a shared volume is writable by others, so either would run whatever a planted pickle says.

Here `.metadata` goes through an unpickler that admits only DCP's own metadata classes (and the
torch dtypes, sizes and layouts they hold), and bytes entries load with `weights_only=True`.
Tensors are already read with `weights_only=True` by DCP itself.
"""
from __future__ import annotations

import io
import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

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


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
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
            except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
                raise UnsafeCheckpoint(f"{path} is not readable checkpoint metadata: {exc}") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpoint(f"entry {read_item.dest_index.fqn} is not plain data: "
                                   f"{str(exc).splitlines()[0]}") from None
        from torch.distributed.checkpoint._traverse import set_element

        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
