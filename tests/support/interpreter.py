"""Pallas Mosaic GPU kernels in the CPU interpreter, every kernel call race-checked.

The interpreter starts a fresh race-detector state for each kernel call, so checking the
detector once at the end of a test would see only the last kernel. `race_checked_interpreter`
keeps every call's state and fails if any of them found a race.

The interpreter's wgmma multiplies with `np.matmul`, whose BLAS kernel (chosen for the CPU it runs
on: OpenBLAS takes other kernels on AVX2 and on AVX-512 machines) and the operands' widths set the
order in which an output's products are added; and it takes its A operand from SMEM only, where on
the GPU `plgpu.wgmma` also takes A from registers (the decode kernel's dequantized weights).
`race_checked_interpreter` replaces it (`_wgmma_in_k_order`): A from SMEM or from registers, each
output's products added in K order (`matmul_in_k_order`), so interpreted bits depend on the
kernel's K steps alone, on any CPU.

The interpreter clips a TMA window that runs past the end of any GMEM axis, as the GPU does for
an array's own axes (the quantize kernels' partial tiles, bitwise on the H200). But on the H200
a store to a [C, M, 32] array at [c, rows], rows running past M, wrote into the first rows at
c + 1 (the activation-backward kernel's partials, 2026-12-02): after an integer index the
window was not clipped at its axis. `race_checked_interpreter` fails such a copy, in either
direction (`_tma_clipped_only_on_unindexed_arrays`)."""

import contextlib
import functools

import jax
import numpy as np
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from jax._src.pallas.mosaic_gpu.interpret import shared_memory as memory
from jax._src.state import indexing
from jax.experimental.pallas import mosaic_gpu as plgpu


def matmul_in_k_order(a, b, dtype):
    """a [M, K] @ b [K, N] in `dtype`: each output starts at +0.0 and adds its K products in K
    order, each product and sum an elementwise IEEE operation (the same bits on any CPU; with
    bf16 or fp8 operands the products are exact in fp32, so a fused multiply-add gives them too)."""
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul_in_k_order: a {a.shape} and b {b.shape} are not [M, K], [K, N]")
    a, b = a.astype(dtype), b.astype(dtype)
    total = np.zeros((a.shape[0], b.shape[1]), dtype)
    for k in range(a.shape[1]):
        total += a[:, k, None] * b[k]
    return total


def _wgmma_in_k_order(original):
    """The interpreter's wgmma callback with each output's products summed in K order
    (`matmul_in_k_order`), taking the A operand from SMEM (an allocation key) or as a value (a
    register array)."""

    @functools.wraps(original)
    def wgmma(*, a_allocation_key_as_array, **kwargs):
        thread, shared = kwargs["thread"], gpu_callbacks._get_shared_memory()
        info = memory.GPULoggingInfo(kwargs["mesh_location"], thread, kwargs.get("source_info"))

        def access(name, allocation_key):
            key = memory.HostAllocationKey.from_array(allocation_key)
            transforms = gpu_callbacks._remove_noop_transforms(kwargs[f"{name}_transforms"])
            where = shared.access(key, jax.tree.map(int, transforms))
            return key, where, shared.get_buffer_content(key, where, thread, logging_info=info)[0]

        a = np.asarray(a_allocation_key_as_array)
        if a.ndim == 1:  # an SMEM allocation key
            a = access("a", a_allocation_key_as_array)[2]
        b = access("b", kwargs["b_allocation_key_as_array"])[2]
        acc_key, acc_where, acc = access("acc", kwargs["acc_allocation_key_as_array"])
        total = acc + matmul_in_k_order(a, b, acc.dtype)
        shared.store_buffer_content(acc_key, acc_where, total, thread, logging_info=info)
        return kwargs["token"]

    return wgmma


def _tma_clipped_only_on_unindexed_arrays(copy, gmem):
    """The interpreter's TMA copy callback, raising IndexError when the GMEM window (`gmem`:
    "src" or "dst") runs past the end of an axis that follows an integer-indexed one."""

    @gpu_callbacks.fail_on_exception  # the interpreter's clean-up after a failed kernel
    def check(*, token, thread, **kwargs):
        shared = gpu_callbacks._get_shared_memory()
        key = memory.HostAllocationKey.from_array(kwargs[f"{gmem}_allocation_key_as_array"])
        transforms = gpu_callbacks._remove_noop_transforms(kwargs[f"{gmem}_transforms"])
        window = shared.access(key, jax.tree.map(int, transforms)).range
        shape = tuple(shared.buffer_shape_and_dtype(key).shape)
        for axis, (span, size) in enumerate(zip(window, shape, strict=True)):
            indexed = [i for i in range(axis) if isinstance(window[i], int)]
            if indexed and isinstance(span, slice) and span.stop > size:
                raise IndexError(
                    f"TMA window {window} runs past the end of axis {axis} of a GMEM array "
                    f"{shape} after an integer index on axis {indexed[-1]}: the GPU does not "
                    "clip it there (tests/support/interpreter.py)"
                )

    @functools.wraps(copy)
    def checked(**kwargs):
        if any(  # most copies index no axis with an integer: skip the check's cost
            not isinstance(index, indexing.Slice)
            for transform in kwargs[f"{gmem}_transforms"]
            if isinstance(transform, indexing.NDIndexer)
            for index in transform.indices
        ):
            check(**kwargs)
        return copy(**kwargs)

    return checked


_PATCHED = {  # gpu_callbacks attribute -> wrapper
    "wgmma": _wgmma_in_k_order,
    "copy_smem_to_gmem": functools.partial(_tma_clipped_only_on_unindexed_arrays, gmem="dst"),
    "copy_gmem_to_smem": functools.partial(_tma_clipped_only_on_unindexed_arrays, gmem="src"),
}


@contextlib.contextmanager
def race_checked_interpreter():
    """Interpret Mosaic GPU kernels with the race detector; on exit, assert that no kernel
    called inside raced. Yields the list of per-call detector states."""
    states = []
    original = gpu_callbacks.GPURaceDetectionState

    def recording(*args, **kwargs):
        state = original(*args, **kwargs)
        states.append(state)
        return state

    gpu_callbacks.GPURaceDetectionState = recording
    originals = {name: getattr(gpu_callbacks, name) for name in _PATCHED}
    for name, wrap in _PATCHED.items():
        setattr(gpu_callbacks, name, wrap(originals[name]))
    try:
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
            yield states
    finally:
        gpu_callbacks.GPURaceDetectionState = original
        for name, function in originals.items():
            setattr(gpu_callbacks, name, function)
    raced = sum(bool(state.races_found) for state in states)
    assert not raced, f"race detected in {raced} of {len(states)} interpreted kernel calls"
