"""Training checkpoints (jaxmoe/checkpoint.py) on small pytrees: exact round trips, the last N
kept, asynchronous saves, unfinished saves ignored, and refusals that name the checkpoint and
the field: another model config, a truncated array file, flipped bytes, another pytree."""

import shutil
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from jaxmoe.checkpoint import TMP_SUFFIX, Checkpointer, CheckpointError, leaf_names

from bitwise import assert_bitwise

MODEL = {"hidden_size": 64, "moe": {"num_experts": 4, "top_k": 2}}
TRAIN = {"lr": 1e-3, "seed": 0}


def state(seed=0):
    """Nested dicts and lists, bf16 and int leaves, a typed PRNG key, a zero-size array and an
    optax AdamW state (NamedTuples)."""
    rng = np.random.default_rng(seed)
    params = {
        "layers": [
            {"kernel": jnp.asarray(rng.normal(size=(16, 32)), jnp.float32)} for _ in range(2)
        ],
        "embed": jnp.asarray(rng.normal(size=(11, 8)), jnp.bfloat16),
    }
    return {
        "params": params,
        "opt_state": optax.adamw(1e-3).init(params),
        "counts": jnp.arange(5, dtype=jnp.int32) + seed,
        "key": jax.random.key(seed),
        "empty": jnp.zeros((0, 3), jnp.float32),
    }


def save(checkpointer, step, seed=None, model=MODEL):
    checkpointer.save(
        step,
        state(step if seed is None else seed),
        data_state={"epoch": 0, "index": step},
        model_config=model,
        train_config=TRAIN,
    )


def abstract():
    return jax.eval_shape(state)


def assert_same_state(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert_bitwise(np.asarray(x), np.asarray(y))


def test_restore_gives_the_saved_bits_and_keeps_the_last_n(tmp_path):
    """Every leaf back with its bits, dtype and structure (keys, bf16, empty, NamedTuples), the
    data position and the metadata; only the `keep` latest steps stay; a new Checkpointer on
    the directory finds them; restoring a deleted step is a FileNotFoundError."""
    checkpointer = Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3):
        save(checkpointer, step)
    checkpointer.wait()
    assert checkpointer.steps() == [2, 3]
    reopened = Checkpointer(tmp_path, keep=2)
    assert reopened.latest_step() == 3 and reopened.discarded == []
    restored = reopened.restore(abstract(), model_config=MODEL)
    assert restored.step == 3 and restored.data_state == {"epoch": 0, "index": 3}
    assert restored.metadata["train_config"] == TRAIN
    assert_same_state(restored.state, state(3))
    assert_same_state(reopened.restore(abstract(), step=2).state, state(2))
    with pytest.raises(FileNotFoundError, match="no complete checkpoint 1"):
        reopened.restore(abstract(), step=1)
    assert isinstance(restored.state["opt_state"][0], optax.ScaleByAdamState)


def block_finalize(monkeypatch):
    """Make orbax's rename of a step's temporary directory wait for the returned event (the
    moment a save is still being written)."""
    release, entered = threading.Event(), threading.Event()
    finalize = ocp.path.atomicity.AtomicRenameTemporaryPath.finalize

    async def blocked(self):
        if self.get_final().name.isdigit():  # a step's directory, not one of its items'
            entered.set()
            release.wait(60)
        await finalize(self)

    monkeypatch.setattr(ocp.path.atomicity.AtomicRenameTemporaryPath, "finalize", blocked)
    return release, entered


def test_an_unfinished_save_is_ignored(tmp_path, monkeypatch):
    """`save` returns while the checkpoint is still being written (asynchronous). A copy of the
    directory taken at that moment (what a process killed then leaves) lists only the earlier
    step, restores it, and drops the unfinished one; the original completes on `wait`."""
    directory = tmp_path / "run"
    checkpointer = Checkpointer(directory)
    save(checkpointer, 1)
    checkpointer.wait()
    release, entered = block_finalize(monkeypatch)
    save(checkpointer, 2)
    assert entered.wait(60), "the save did not reach its rename"
    assert (directory / f"2{TMP_SUFFIX}").is_dir() and not (directory / "2").exists()
    shutil.copytree(directory, tmp_path / "killed")
    release.set()
    checkpointer.wait()
    assert checkpointer.steps() == [1, 2]
    killed = Checkpointer(tmp_path / "killed")
    assert killed.discarded == [f"2{TMP_SUFFIX}"] and killed.steps() == [1]
    assert not (tmp_path / "killed" / f"2{TMP_SUFFIX}").exists()
    assert_same_state(killed.restore(abstract()).state, state(1))


def test_another_model_config_is_refused_by_key(tmp_path):
    """The error names the checkpoint and each differing key with both values."""
    checkpointer = Checkpointer(tmp_path / "run", async_save=False)
    save(checkpointer, 4)
    other = {"hidden_size": 64, "moe": {"num_experts": 4, "top_k": 1}, "qk_norm": True}
    with pytest.raises(CheckpointError) as error:
        checkpointer.restore(abstract(), model_config=other)
    message = str(error.value)
    assert str(tmp_path / "run" / "4") in message
    assert "moe.top_k (checkpoint 2, asked 1)" in message and "qk_norm" in message
    assert "hidden_size" not in message


def chunk_file(checkpointer, step, name):
    """The one data file of array `name` in the checkpoint of `step`."""
    files = [p for p in (checkpointer.path(step) / "state" / name).iterdir() if p.name[0] != "."]
    assert len(files) == 1, files
    return files[0]


# orbax's reads of the other arrays end after its event loop has closed on the failed one.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_truncated_array_file_is_refused_by_name(tmp_path):
    """Half of an array's file cut off: the error names the checkpoint and the array."""
    checkpointer = Checkpointer(tmp_path, async_save=False)
    save(checkpointer, 1)
    name = "params.layers.1.kernel"
    assert name in leaf_names(state())
    path = chunk_file(checkpointer, 1, name)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(
        CheckpointError, match=rf"checkpoint {tmp_path}/1: cannot read array {name}"
    ):
        checkpointer.restore(abstract())


def test_flipped_bytes_are_refused_by_the_checksum(tmp_path):
    """One byte of an array's file inverted: the file still decodes (its compression keeps no
    checksum) to other values, which the saved crc32 refuses, naming the array. Control: the
    undamaged checkpoint restores."""
    checkpointer = Checkpointer(tmp_path, async_save=False)
    save(checkpointer, 1)
    checkpointer.restore(abstract())
    name = "params.layers.0.kernel"
    path = chunk_file(checkpointer, 1, name)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"checkpoint {tmp_path}/1: array {name} is corrupt"):
        checkpointer.restore(abstract())


def test_another_pytree_is_refused_by_array(tmp_path):
    """A missing or extra leaf, or another shape or dtype: errors naming the arrays."""
    checkpointer = Checkpointer(tmp_path, async_save=False)
    save(checkpointer, 1)
    fewer = abstract()
    del fewer["counts"]
    with pytest.raises(CheckpointError, match=r"missing \[\], not asked for \['counts'\]"):
        checkpointer.restore(fewer)
    wider = abstract()
    wider["params"]["embed"] = jax.ShapeDtypeStruct((11, 9), jnp.bfloat16)
    with pytest.raises(CheckpointError, match=r"array params.embed is bfloat16 \[11, 8\]"):
        checkpointer.restore(wider)
    with pytest.raises(ValueError, match="keep must be a positive int"):
        Checkpointer(tmp_path, keep=0)
