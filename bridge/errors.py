"""Exception types of the bridge. Each subclasses `BridgeError` and the builtin that fits
(`ValueError` for bad content, `FileNotFoundError` for missing files), so callers can catch either."""

from __future__ import annotations


class BridgeError(Exception):
    """Base class of every error raised on purpose by `bridge`."""


class DLPackTransferError(BridgeError, ValueError):
    """A tensor cannot be shared without a copy (non-contiguous, misaligned, unsupported dtype,
    sharded), and the caller did not pass copy=True."""


class CheckpointNotFoundError(BridgeError, FileNotFoundError):
    """The checkpoint path, or a file it needs, does not exist."""


class MissingRankFilesError(CheckpointNotFoundError):
    """A legacy checkpoint tree lacks some tensor/pipeline/expert-parallel rank files."""


class CorruptCheckpointError(BridgeError, ValueError):
    """A checkpoint file is truncated, corrupt, or not in a format this bridge reads."""


class UnsafeCheckpointError(CorruptCheckpointError):
    """A pickle in the checkpoint references code (a global) that a Megatron checkpoint never holds;
    it is refused before anything is executed."""


class UnknownKeysError(BridgeError, ValueError):
    """The checkpoint holds MoE-layer keys this bridge does not understand (listed in `.keys`)."""

    def __init__(self, message: str, keys):
        super().__init__(message)
        self.keys = sorted(keys)


class ExpertCountError(BridgeError, ValueError):
    """The experts found in the checkpoint do not match the configuration or each other."""


class ShapeMismatchError(BridgeError, ValueError):
    """A tensor's shape disagrees with the configuration (the message names the key and both
    shapes)."""


class ConfigError(BridgeError, ValueError):
    """No usable MoE configuration: none saved in the checkpoint and none given, or a bad one."""


class MXFP8LayoutError(BridgeError, ValueError):
    """Transformer Engine MXFP8 buffers whose shapes do not match the TE layout."""
