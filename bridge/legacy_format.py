"""Finding the files of a Megatron checkpoint on disk: the format, the iteration directory, and
the legacy `mp_rank_XX[_YYY][_ZZZ]/model_optim_rng.pt` rank files (docs/numerics.md, "Megatron
checkpoints")."""

from __future__ import annotations

import dataclasses
import os
import re

from bridge.errors import CheckpointNotFoundError, MissingRankFilesError
from bridge.torch_dist_format import is_torch_dist_dir

TRACKER_FILE = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_ITER_DIR = re.compile(r"^iter_(\d{7})$")


def iteration_dir_name(iteration: int | None) -> str:
    """`iter_0000042`, or `release` for iteration None."""
    return "release" if iteration is None else f"iter_{iteration:07d}"


def rank_dir_name(tp: int, pp: int | None = None, ep: int | None = None) -> str:
    """Megatron's `mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]` (pp only when PP > 1, ep only when
    EP > 1)."""
    name = f"mp_rank_{tp:02d}"
    if pp is not None:
        name += f"_{pp:03d}"
    if ep is not None:
        name += f"_{ep:03d}"
    return name


def resolve(path: str) -> tuple[str, str]:
    """(format, location): "torch_dist" and its directory, "legacy_file" and the file, or
    "legacy_tree" and the iteration directory holding the mp_rank_* folders. Follows Megatron's
    tracker file, else takes `release/` or the highest `iter_*`."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return "legacy_file", path
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"{path}: no such file or directory")
    if is_torch_dist_dir(path):
        return "torch_dist", path
    entries = os.listdir(path)
    if any(_RANK_DIR.match(name) for name in entries):
        return "legacy_tree", path
    tracker = os.path.join(path, TRACKER_FILE)
    if os.path.isfile(tracker):
        with open(tracker) as handle:
            text = handle.read().strip()
        name = "release" if text == "release" else iteration_dir_name(int(text))
        if not os.path.isdir(os.path.join(path, name)):
            raise CheckpointNotFoundError(
                f"{tracker} names iteration {text!r} but {name}/ does not exist"
            )
        return resolve(os.path.join(path, name))
    iterations = sorted(name for name in entries if _ITER_DIR.match(name))
    if iterations or "release" in entries:
        return resolve(os.path.join(path, iterations[-1] if iterations else "release"))
    raise CheckpointNotFoundError(
        f"{path}: no Megatron checkpoint here (expected a torch_dist .metadata, mp_rank_*/ "
        f"folders, {TRACKER_FILE}, iter_*/ or release/)"
    )


@dataclasses.dataclass(frozen=True)
class RankFile:
    """One legacy rank file and its parallel coordinates (None: that suffix is absent)."""

    path: str
    tp: int
    suffixes: tuple[int, ...]


def rank_files(iteration_dir: str) -> list[RankFile]:
    """The rank files of a legacy iteration directory, checked to form a full grid (every
    combination of the ranks seen has its folder and its model_optim_rng.pt)."""
    found, missing_files = [], []
    for name in sorted(os.listdir(iteration_dir)):
        match = _RANK_DIR.match(name)
        if not match:
            continue
        file = os.path.join(iteration_dir, name, RANK_FILE)
        if not os.path.isfile(file):
            missing_files.append(file)
            continue
        suffixes = tuple(int(g) for g in match.groups()[1:] if g is not None)
        found.append(RankFile(file, int(match.group(1)), suffixes))
    if missing_files:
        raise MissingRankFilesError(f"rank folders without {RANK_FILE}: {missing_files}")
    if not found:
        raise CheckpointNotFoundError(f"{iteration_dir}: no mp_rank_*/{RANK_FILE} files")
    lengths = {len(f.suffixes) for f in found}
    if len(lengths) != 1:
        raise MissingRankFilesError(f"{iteration_dir}: rank folder names mix suffix patterns")
    size = [max(f.tp for f in found) + 1]
    size += [max(f.suffixes[i] for f in found) + 1 for i in range(lengths.pop())]
    present = {(f.tp, *f.suffixes) for f in found}
    missing = sorted(set(_grid(size)) - present)
    if missing:
        names = [rank_dir_name(*coords) for coords in missing]
        raise MissingRankFilesError(
            f"{iteration_dir}: missing rank folders {names} (a full grid of "
            f"{' x '.join(map(str, size))} ranks is expected)"
        )
    return found


def _grid(size: list[int]):
    if not size:
        yield ()
        return
    for head in range(size[0]):
        for tail in _grid(size[1:]):
            yield (head, *tail)
