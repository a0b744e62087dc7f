"""Training checkpoints on orbax: asynchronous saves, the last N kept, verified restores.

A checkpoint of step s is a directory `<directory>/<s>` with three orbax items:
  state     every array of a pytree (model parameters and other state, optimizer state), stored
            as a flat dict named by the leaves' key paths (`leaf_names`), one zarr array each;
            PRNG keys as their key data; zero-size arrays only in the metadata (orbax stores none)
  data      the data position (`PackedBatches.state()`), JSON
  metadata  JSON: the step, the model config dict, the training config, and each array's
            shape, dtype and crc32 (of its bytes in C order, computed on the host at save time)
orbax writes a checkpoint into `<s>.orbax-checkpoint-tmp` and renames it when every item is
written, so a process killed during a save leaves only that temporary directory: it is never
listed as a step, never restored, and removed when the directory is next opened.

A restore refuses, naming the checkpoint and the field or array: another model config (the
differing keys), an array that cannot be read (a truncated or missing file), an array whose
crc32 is not the saved one (flipped bytes, which the storage's compression does not catch), and
a pytree other than the saved one (missing or extra arrays, other shapes or dtypes).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import zlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's suffix of a save in progress


class _NoMergeNotice(logging.Filter):
    """Drops orbax's notice, at every save without OCDBT, that there is no OCDBT to merge."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Skipping merge of OCDBT" not in record.getMessage()


logging.getLogger("absl").addFilter(_NoMergeNotice())


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored as asked (its message names it and the field)."""


@dataclasses.dataclass(frozen=True)
class Restored:
    """What `Checkpointer.restore` returns: the step, the state pytree (the abstract state's
    structure, arrays placed as its leaves say), the data position and the metadata dict."""

    step: int
    state: Any
    data_state: dict
    metadata: dict


def leaf_names(tree: Any) -> list[str]:
    """The leaves' names in tree order: their key paths, components joined by "." (dict keys,
    attribute names, sequence indices), unique (else a ValueError naming the duplicate)."""
    names = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        names.append(".".join(parts))
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"checkpoint: leaves share the names {duplicates}")
    return names


def crc32(array: np.ndarray) -> int:
    """zlib's crc32 of the array's bytes in C order."""
    return zlib.crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def _is_key(leaf) -> bool:
    return jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _flat_differences(saved: Any, requested: Any, prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two JSON-like dicts, with both values."""
    if not (isinstance(saved, dict) and isinstance(requested, dict)):
        return (
            [] if saved == requested else [f"{prefix} (checkpoint {saved!r}, asked {requested!r})"]
        )
    out = []
    for key in sorted(set(saved) | set(requested), key=str):
        name = f"{prefix}.{key}" if prefix else str(key)
        out += _flat_differences(saved.get(key, "<absent>"), requested.get(key, "<absent>"), name)
    return out


class Checkpointer:
    """Saves and restores training checkpoints in `directory` (created when missing).

    keep: how many of the latest checkpoints stay (older ones are deleted after a save).
    async_save: `save` returns once the arrays are copied to the host, and the files are
      written in a background thread while training goes on (`wait` blocks until done).
    Unfinished saves found when opening the directory (a process killed mid-save) are listed in
    `discarded` and removed."""

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"Checkpointer: keep must be a positive int, got {keep!r}")
        self.directory = Path(directory).absolute()
        unfinished = sorted(self.directory.glob(f"*{TMP_SUFFIX}*"))
        for path in unfinished:
            shutil.rmtree(path)
        self.discarded = [p.name for p in unfinished]
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(n=keep),
            enable_async_checkpointing=async_save,
            create=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_names=("state", "data", "metadata"),
            # One directory per array (not OCDBT's shared files): a damaged file is one array's.
            item_handlers={
                "state": ocp.StandardCheckpointHandler(use_ocdbt=False),
                "data": ocp.JsonCheckpointHandler(),
                "metadata": ocp.JsonCheckpointHandler(),
            },
        )

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints, ascending."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The last complete checkpoint's step (None: there is none)."""
        return self._manager.latest_step()

    def path(self, step: int) -> Path:
        """The directory of step's checkpoint."""
        return self.directory / str(step)

    def save(
        self, step: int, state: Any, *, data_state: dict, model_config: dict, train_config: dict
    ) -> None:
        """Checkpoint `state` (a pytree of arrays) at `step`, with the data position and the
        configs (JSON-able dicts). The arrays are copied to the host and checksummed before
        this returns; with async_save the files are written afterwards."""
        names = leaf_names(state)
        leaves = jax.tree.leaves(state)
        host = jax.device_get([jax.random.key_data(x) if _is_key(x) else x for x in leaves])
        arrays, stored = {}, {}
        for name, leaf, value in zip(names, leaves, host):
            value = np.asarray(value)
            entry = dict(shape=list(value.shape), dtype=value.dtype.name, crc32=crc32(value))
            if _is_key(leaf):
                entry["prng_impl"] = str(jax.random.key_impl(leaf))
            arrays[name] = entry
            if value.size:
                stored[name] = value
        metadata = dict(
            step=step, model_config=model_config, train_config=train_config, arrays=arrays
        )
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(stored),
                data=ocp.args.JsonSave(data_state),
                metadata=ocp.args.JsonSave(json.loads(json.dumps(metadata))),
            ),
        )

    def restore(
        self, abstract_state: Any, *, step: int | None = None, model_config: dict | None = None
    ) -> Restored:
        """The checkpoint of `step` (None: the latest complete one) as `abstract_state`'s
        structure (a pytree of arrays or `jax.ShapeDtypeStruct`s; a leaf's sharding, when it
        has one, places the restored array). `model_config`: the dict the checkpoint's must
        equal. Every array is checked against its saved crc32. A CheckpointError names the
        checkpoint and what is wrong; FileNotFoundError when there is no checkpoint."""
        step = self.latest_step() if step is None else step
        if step is None or step not in self.steps():
            raise FileNotFoundError(
                f"no complete checkpoint {'' if step is None else step} in {self.directory}"
            )
        where = self.path(step)
        metadata = self._read(step, "metadata", where)
        if model_config is not None:
            differences = _flat_differences(
                metadata["model_config"], json.loads(json.dumps(model_config))
            )
            if differences:
                raise CheckpointError(
                    f"checkpoint {where} is of another model config: {'; '.join(differences)}"
                )
        saved = metadata["arrays"]
        names = leaf_names(abstract_state)
        leaves, treedef = jax.tree.flatten(abstract_state)
        missing, extra = sorted(set(names) - set(saved)), sorted(set(saved) - set(names))
        if missing or extra:
            raise CheckpointError(
                f"checkpoint {where} holds other arrays than asked: missing {missing}, "
                f"not asked for {extra}"
            )
        for name, leaf in zip(names, leaves):
            shape, dtype = leaf.shape, leaf.dtype
            if _is_key(leaf):
                key_data = jax.eval_shape(jax.random.key_data, leaf)
                shape, dtype = key_data.shape, key_data.dtype
            entry = saved[name]
            if list(shape) != entry["shape"] or jnp.dtype(dtype).name != entry["dtype"]:
                raise CheckpointError(
                    f"checkpoint {where}: array {name} is {entry['dtype']} {entry['shape']}, "
                    f"asked for {jnp.dtype(dtype).name} {list(shape)}"
                )
        target = {
            name: jax.ShapeDtypeStruct(tuple(e["shape"]), jnp.dtype(e["dtype"]))
            for name, e in saved.items()
            if np.prod(e["shape"], dtype=np.int64)
        }
        try:
            items = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()
                ),
            )
        except Exception as error:
            text = str(error)
            # tensorstore's message names the array's directory (its key in OCDBT's spec).
            unreadable = [n for n in target if f"/{n}/" in text or f"'{n}/'" in text]
            what = f"array {unreadable[0]}" if unreadable else "its state or data item"
            raise CheckpointError(
                f"checkpoint {where}: cannot read {what} ({type(error).__name__}: "
                f"{text.splitlines()[0][:200]})"
            ) from error
        restored = []
        for name, leaf in zip(names, leaves):
            entry = saved[name]
            value = (
                np.asarray(items["state"][name])
                if name in target
                else np.zeros(entry["shape"], jnp.dtype(entry["dtype"]))
            )
            if crc32(value) != entry["crc32"]:
                raise CheckpointError(
                    f"checkpoint {where}: array {name} is corrupt (crc32 {crc32(value):#010x}, "
                    f"saved {entry['crc32']:#010x})"
                )
            if _is_key(leaf):
                restored.append(jax.random.wrap_key_data(value, impl=entry["prng_impl"]))
            else:
                restored.append(jax.device_put(value, getattr(leaf, "sharding", None)))
        return Restored(step, jax.tree.unflatten(treedef, restored), items["data"], metadata)

    def _read(self, step: int, item: str, where: Path) -> dict:
        """One JSON item of a checkpoint, a CheckpointError naming it when unreadable."""
        try:
            return self._manager.restore(
                step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()})
            )[item]
        except Exception as error:
            raise CheckpointError(
                f"checkpoint {where}: cannot read its {item} ({type(error).__name__}: {error})"
            ) from error

    def wait(self) -> None:
        """Block until every save in progress is written."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Wait for the saves in progress and release the manager."""
        self._manager.close()
