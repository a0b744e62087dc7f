"""Which implementation runs an op: one registry, one resolver.

Every op takes `impl=`: "xla" (the reference, runs anywhere), "auto", or the name of a kernel
registered for that op ("pallas": the Hopper Mosaic GPU kernels). A kernel registers once, with
the device it needs and a function saying why it cannot run a given call (None when it can):

    register("gmm", "pallas", problem=gmm_problem)
    impl = resolve("gmm", impl, lhs, rhs, k, n)      # "xla" or "pallas"

"auto" picks the first registered kernel whose device is present and that can run the call,
else "xla". Asking for a kernel by name on a call it cannot run raises ValueError with its
reason. A kernel asked for by name runs whatever the device (off the GPU that is the Mosaic GPU
interpreter, which the tests use). A new kernel joins by registering; no op branches on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

from jaxmoe.ops.device import on_hopper

Impl = Literal["auto", "xla", "pallas"]
"""What `impl=` of an op accepts: "auto", the reference "xla", or the kernels "pallas"."""
REFERENCE = "xla"


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A kernel implementation of one op."""

    impl: str
    problem: Callable[..., str | None]  # why it cannot run a call (None: it can)
    device: Callable[[], bool]  # whether this machine runs it natively


_KERNELS: dict[str, list[Kernel]] = {}


def register(
    op: str,
    impl: str,
    *,
    problem: Callable[..., str | None],
    device: Callable[[], bool] = on_hopper,
) -> None:
    """Register kernel `impl` for `op`; "auto" tries kernels in registration order."""
    if impl in implementations(op):
        raise ValueError(f"register: {op} already has an implementation called {impl!r}")
    _KERNELS.setdefault(op, []).append(Kernel(impl, problem, device))


def kernels(op: str) -> tuple[Kernel, ...]:
    """The kernels registered for `op`, in the order "auto" tries them."""
    return tuple(_KERNELS.get(op, ()))


def implementations(op: str) -> tuple[str, ...]:
    """The values `impl=` accepts for `op`."""
    return ("auto", REFERENCE) + tuple(k.impl for k in kernels(op))


def check_impl(op: str, impl: str) -> None:
    """ValueError unless `impl` names an implementation of `op`."""
    if impl not in implementations(op):
        raise ValueError(f"{op}: impl must be one of {implementations(op)}, got {impl!r}")


def resolve(op: str, impl: str, *call) -> str:
    """The implementation that runs this call of `op`: REFERENCE or a registered kernel's name.
    `call` is passed to the kernels' problem functions."""
    check_impl(op, impl)
    if impl == REFERENCE:
        return REFERENCE
    if impl == "auto":
        for kernel in kernels(op):
            if kernel.device() and kernel.problem(*call) is None:
                return kernel.impl
        return REFERENCE
    problem = next(k for k in kernels(op) if k.impl == impl).problem(*call)
    if problem:
        raise ValueError(f"{op}(impl={impl!r}): {problem}; use impl='xla' or 'auto'")
    return impl
