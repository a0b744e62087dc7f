"""The SASS of a Mosaic GPU kernel's PTX, counted by loop, on a machine without a GPU: registers
and spills (ptxas), then each loop of the kernel (from a label to a later branch back to it)
with its instruction count and most frequent opcodes, and the kernel's opcode totals. For
weighing a kernel change by the instructions it issues before a GPU measures it.

    tools/sass_census.py KERNEL.ptx [--maxnreg 128] [--top 12]

KERNEL.ptx: Mosaic GPU writes a kernel's PTX when it compiles it with MOSAIC_GPU_DUMP_PTX=1 and
MOSAIC_GPU_DUMP_TO=DIR set, on a GPU or for the compile-only H200 of tools/hopper_program.py
(every Pallas kernel of a layer's program at once, e.g. `--step train --tokens 8192`; its
docstring says which JAX it needs). ptxas and nvdisasm are looked up on PATH, then in the
NVIDIA pip packages beside JAX (`nvidia-cuda-nvcc`, which JAX's CUDA plugin brings, and
`nvidia-cuda-nvdisasm`). --maxnreg N compiles as if the kernel were held to N registers a
thread (the `.maxnreg` directive), to see what ptxas spills there.

Counts are static: a loop's body is counted once, branches inside it as if all were taken (a
warp skips what its predicate or an elected lane's branch leaves out), and the slow paths of
barrier waits, which ptxas places after the kernel's last EXIT, are left out of the loops.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

_LABEL = re.compile(r"^(\.L_x_\d+):")
_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_TARGET = re.compile(r"`?\((\.L_x_\d+)\)|(\.L_x_\d+)")
_BRANCHES = ("BRA", "BRX", "JMP")


@dataclasses.dataclass
class Listing:
    """A kernel's instructions in address order: each one's opcode and the label its branch
    jumps to (None if it is no branch), and the index of the instruction each label names."""

    opcodes: list[str]
    targets: list[str | None]
    labels: dict[str, int]


@dataclasses.dataclass
class Loop:
    """Instructions first..last, where the last branches back to the first (a label)."""

    head: str
    first: int
    last: int
    opcodes: collections.Counter

    @property
    def size(self) -> int:
        return sum(self.opcodes.values())


def listing(sass: str) -> Listing:
    """The instructions of nvdisasm's listing of one kernel."""
    found = Listing([], [], {})
    for line in sass.splitlines():
        if label := _LABEL.match(line):
            found.labels[label.group(1)] = len(found.opcodes)
        elif instruction := _INSTRUCTION.match(line):
            opcode, operands = instruction.groups()
            target = None
            if base(opcode) in _BRANCHES and (named := _TARGET.search(operands)):
                target = named.group(1) or named.group(2)
            found.opcodes.append(opcode)
            found.targets.append(target)
    return found


def base(opcode: str) -> str:
    """An opcode without its modifiers (FFMA.SAT -> FFMA)."""
    return opcode.split(".")[0]


def loops(found: Listing) -> list[Loop]:
    """Every back edge's loop, innermost (smallest) first. Branches after the kernel's last
    EXIT are not loops: ptxas puts the slow paths of barrier waits there (retry, then jump back
    into the body)."""
    exits = [i for i, opcode in enumerate(found.opcodes) if base(opcode) == "EXIT"]
    body = exits[-1] if exits else len(found.opcodes)
    result = []
    for last, target in enumerate(found.targets[:body]):
        first = found.labels.get(target)
        if first is not None and first <= last:
            counts = collections.Counter(base(op) for op in found.opcodes[first : last + 1])
            result.append(Loop(target, first, last, counts))
    return sorted(result, key=lambda loop: loop.size)


def report(found: Listing, top: int) -> str:
    """The census as text: each loop, then the kernel's totals."""
    lines = []
    for loop in loops(found):
        common = " ".join(f"{op} {n}" for op, n in loop.opcodes.most_common(top))
        lines.append(
            f"loop at {loop.head} (instructions {loop.first}-{loop.last}): {loop.size} "
            f"instructions: {common}"
        )
    totals = collections.Counter(base(op) for op in found.opcodes)
    common = " ".join(f"{op} {n}" for op, n in totals.most_common(top))
    lines.append(f"kernel: {sum(totals.values())} instructions: {common}")
    return "\n".join(lines)


def with_maxnreg(ptx: str, registers: int) -> str:
    """The PTX with every entry held to `registers` a thread (a `.maxnreg` after its
    `.maxntid`)."""
    held, count = re.subn(r"(\.maxntid[^\n]*\n)", rf"\1.maxnreg {registers}\n", ptx)
    if not count:
        raise ValueError("sass_census: no .maxntid directive to put .maxnreg after")
    return held


def tool(name: str) -> str:
    """The path of a CUDA tool: on PATH, else in the NVIDIA pip packages beside JAX."""
    if found := shutil.which(name):
        return found
    for root in sys.path:
        for candidate in glob.glob(os.path.join(root, "nvidia", "*", "bin", name)):
            return candidate
    raise FileNotFoundError(
        f"sass_census: {name} is neither on PATH nor in an NVIDIA pip package "
        f"(pip install nvidia-cuda-nvcc nvidia-cuda-nvdisasm)"
    )


def compile_ptx(ptx: str, workdir: str) -> tuple[str, str]:
    """(ptxas' resource lines, nvdisasm's listing) of the PTX compiled for sm_90a."""
    source, cubin = os.path.join(workdir, "kernel.ptx"), os.path.join(workdir, "kernel.cubin")
    with open(source, "w") as f:
        f.write(ptx)
    built = _run([tool("ptxas"), "-arch=sm_90a", "-O3", "-v", source, "-o", cubin])
    resources = "\n".join(
        line.strip()
        for line in (built.stdout + built.stderr).splitlines()
        if "registers" in line or "spill" in line
    )
    return resources, _run([tool("nvdisasm"), "-c", cubin]).stdout


def _run(command: list[str]) -> subprocess.CompletedProcess:
    """The finished command; RuntimeError with its error output if it failed."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        name = os.path.basename(command[0])
        raise RuntimeError(f"sass_census: {name} failed ({done.returncode}):\n{done.stderr}")
    return done


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ptx", help="a kernel's PTX (MOSAIC_GPU_DUMP_PTX)")
    parser.add_argument("--maxnreg", type=int, help="hold the kernel to this many registers")
    parser.add_argument("--top", type=int, default=12, help="opcodes shown a loop")
    args = parser.parse_args(argv)
    with open(args.ptx) as f:
        ptx = f.read()
    if args.maxnreg:
        ptx = with_maxnreg(ptx, args.maxnreg)
    with tempfile.TemporaryDirectory() as workdir:
        resources, sass = compile_ptx(ptx, workdir)
    text = resources + "\n" + report(listing(sass), args.top)
    print(text)
    return text


if __name__ == "__main__":
    main()
