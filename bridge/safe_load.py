"""Unpickling checkpoint files without ever running code from them.

Two kinds of pickles appear in Megatron checkpoints:
  * `torch.save` files (legacy `model_optim_rng.pt`, the byte objects inside torch_dist such as
    `common_state`): loaded with `torch.load(weights_only=True)`. Globals that Megatron checkpoints
    legitimately hold but the weights-only unpickler does not know (Megatron / Transformer Engine
    enums inside the saved `args`) are replaced by inert stand-ins that only record their
    arguments; `argparse.Namespace` is allowed as the plain attribute bag it is. Any other global
    (`os.system`, `builtins.exec`, ...) makes the file refused before unpickling starts.
  * the torch_dist `.metadata` file, which torch reads with plain `pickle.load`; here it is read
    by an unpickler that only resolves torch.distributed.checkpoint's metadata classes.
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import zipfile
from typing import Any, BinaryIO

import torch

from bridge.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError

# Modules whose globals may appear in saved Megatron args (enums, dataclass configs). They are
# never imported: each name becomes an inert `OpaqueGlobal` subclass.
STAND_IN_MODULE_PREFIXES = ("megatron.", "transformer_engine.", "apex.")


class OpaqueGlobal:
    """Stand-in for a class referenced by a checkpoint's pickle. Constructing, calling or
    restoring it only records the arguments; nothing from the named module runs."""

    qualified_name = "?"

    def __new__(cls, *args, **kwargs):
        instance = super().__new__(cls)
        instance.args, instance.kwargs, instance.state = args, kwargs, None
        return instance

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state

    def __repr__(self):
        return f"<opaque {self.qualified_name}{self.args!r}>"


def _stand_in(qualified_name: str) -> type:
    return type(
        qualified_name.rsplit(".", 1)[-1], (OpaqueGlobal,), {"qualified_name": qualified_name}
    )


def _unsafe_globals(source: BinaryIO, description: str) -> list[str]:
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(source)
    except (ValueError, RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as exc:
        raise CorruptCheckpointError(
            f"{description}: not a readable torch.save file (truncated or corrupt?): {exc}"
        ) from exc
    finally:
        source.seek(0)
    return sorted(names)


def load_torch_file(
    source: str | os.PathLike | bytes | BinaryIO, description: str | None = None
) -> Any:
    """`torch.load(source, weights_only=True, map_location="cpu")`, refusing unsafe pickles.

    Raises CheckpointNotFoundError (no such file), UnsafeCheckpointError (the pickle references a
    global outside the allowlist; nothing was executed) or CorruptCheckpointError."""
    if isinstance(source, (str, os.PathLike)):
        description = description or os.fspath(source)
        if not os.path.isfile(source):
            raise CheckpointNotFoundError(f"{description}: no such file")
        with open(source, "rb") as handle:
            return _load_stream(handle, description)
    if isinstance(source, bytes):
        source = io.BytesIO(source)
    return _load_stream(source, description or "in-memory torch.save object")


def _load_stream(stream: BinaryIO, description: str) -> Any:
    names = _unsafe_globals(stream, description)
    refused = [
        name
        for name in names
        if name != "argparse.Namespace" and not name.startswith(STAND_IN_MODULE_PREFIXES)
    ]
    if refused:
        raise UnsafeCheckpointError(
            f"{description}: refusing to unpickle, it references code that a Megatron checkpoint "
            f"never holds: {refused} (nothing was executed)"
        )
    allowed: list[Any] = [argparse.Namespace]
    allowed += [(_stand_in(name), name) for name in names if name != "argparse.Namespace"]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(stream, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"{description}: refused by the weights-only unpickler: {exc}"
        ) from exc
    except (RuntimeError, EOFError, ValueError, zipfile.BadZipFile) as exc:
        raise CorruptCheckpointError(
            f"{description}: cannot read (truncated or corrupt?): {exc}"
        ) from exc


# ----------------------------------------------------------------------- torch_dist .metadata
_DCP_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "ChunkStorageMetadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"LoadItemType", "WriteItemType"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath"},  # StorageMeta.checkpoint_id
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only torch.distributed.checkpoint metadata classes and torch dtypes."""

    def find_class(self, module: str, name: str):
        if name in _DCP_METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"torch_dist .metadata references {module}.{name}, which is "
            "not checkpoint metadata; refusing it (nothing was executed)"
        )


def load_dcp_metadata(path: str | os.PathLike):
    """The `torch.distributed.checkpoint` Metadata object in `path` (a `.metadata` file)."""
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(
            f"{path}: no such file (a torch_dist checkpoint needs its .metadata)"
        )
    with open(path, "rb") as handle:
        try:
            return _MetadataUnpickler(handle).load()
        except UnsafeCheckpointError:
            raise
        except (
            pickle.UnpicklingError,
            EOFError,
            AttributeError,
            ValueError,
            TypeError,
            IndexError,
            KeyError,
        ) as exc:
            raise CorruptCheckpointError(f"{path}: corrupt torch_dist metadata: {exc}") from exc
