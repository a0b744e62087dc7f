"""Reading and writing Megatron-Core `torch_dist` checkpoints (torch.distributed.checkpoint, DCP)
without a process group and without unsafe unpickling (docs/numerics.md, "Megatron
checkpoints").

Reads allocate exactly the requested global tensors and let `dcp.load` fill them; byte objects
(`common_state`, `_extra_state`) go through `bridge.safe_load`. Nothing under `optimizer.*` is
ever requested."""

from __future__ import annotations

import io
import json
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    StorageMeta,
    TensorStorageMetadata,
)

from bridge.errors import BridgeError, CheckpointNotFoundError, CorruptCheckpointError
from bridge.safe_load import load_dcp_metadata, load_torch_file

METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}


def is_torch_dist_dir(path: str) -> bool:
    """Whether `path` is a directory holding a DCP `.metadata` file."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, ".metadata"))


class _SafeReader(dcp.FileSystemReader):
    """FileSystemReader whose metadata is read by the restricted unpickler."""

    def read_metadata(self, *args, **kwargs):
        metadata = load_dcp_metadata(os.path.join(self.path, ".metadata"))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """Default planner, except byte objects are unpickled by `bridge.safe_load`."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        # Used with flatten_state_dict=False, so fqn is a key of the caller's (unflattened) dict.
        self.original_state_dict[fqn] = load_torch_file(
            value.getvalue(), description=f"byte object {fqn}"
        )


def read_index(path: str) -> dict[str, TensorStorageMetadata | BytesStorageMetadata]:
    """Every key of the checkpoint with its storage metadata (global size and dtype for
    tensors)."""
    if not is_torch_dist_dir(path):
        raise CheckpointNotFoundError(f"{path}: not a torch_dist checkpoint (no .metadata)")
    return dict(load_dcp_metadata(os.path.join(path, ".metadata")).state_dict_metadata)


def _reraise(exc: BaseException, path: str):
    failures = getattr(exc, "failures", None)
    causes = list(failures.values()) if failures else [exc]
    for cause in causes:
        cause = cause[0] if isinstance(cause, tuple) else getattr(cause, "exception", cause)
        if isinstance(cause, BridgeError):
            raise cause from exc
        if isinstance(cause, FileNotFoundError):
            raise CheckpointNotFoundError(f"{path}: a data file is missing: {cause}") from exc
    raise CorruptCheckpointError(
        f"{path}: cannot read the torch_dist data (truncated or corrupt?): {causes[0]!r}"
    ) from exc


def read(path: str, index: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """Load `keys` (tensor keys as full global tensors on CPU, byte keys as their unpickled
    objects)."""
    state: dict[str, Any] = {}
    for key in keys:
        entry = index[key]
        if isinstance(entry, TensorStorageMetadata):
            state[key] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        else:
            state[key] = io.BytesIO()
    if not state:
        return {}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                state,
                storage_reader=_SafeReader(path),
                planner=_SafeLoadPlanner(flatten_state_dict=False),
                no_dist=True,
            )
    except (CheckpointException, RuntimeError, OSError, ValueError, EOFError) as exc:
        _reraise(exc, path)
    return state


def read_common_state(path: str, index: dict[str, Any]) -> dict | None:
    """The non-tensor common state (`common_state/shard_*` object, or an older `common.pt`), or
    None when the checkpoint has none."""
    keys = [key for key in index if key.startswith("common_state/")]
    if keys:
        value = read(path, index, keys[:1])[keys[0]]
        value = value[0] if isinstance(value, list) and len(value) == 1 else value
        return value if isinstance(value, dict) else None
    common_file = os.path.join(path, "common.pt")
    if os.path.isfile(common_file):
        value = load_torch_file(common_file)
        return value if isinstance(value, dict) else None
    return None


def write(path: str, state: dict[str, Any], progress: Callable[[str], None] | None = None) -> None:
    """Write `state` as a torch_dist checkpoint in the directory `path`, plus Megatron's
    metadata.json. Tensors are stored as global tensors; any other value becomes a byte object
    (DCP torch.saves it, as Megatron's ShardedObjects)."""
    os.makedirs(path, exist_ok=True)
    if progress:
        progress(f"writing {len(state)} entries to {path}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(path),
            planner=DefaultSavePlanner(flatten_state_dict=False),
            no_dist=True,
        )
    with open(os.path.join(path, "metadata.json"), "w") as handle:
        json.dump(METADATA_JSON, handle)
