"""Work items handed out by an atomic counter in a Pallas Mosaic GPU kernel (Hopper).

A persistent kernel that deals its items to the CTAs in a fixed order (item i to CTA i mod C)
finishes when its slowest CTA does; where the CTAs stream at different rates (the memory
system does not serve every SM alike), the others idle at the end. With a counter in global
memory each CTA takes the next item when it has room for one: `claim` returns the counter's
value before adding one, the same number to every thread of the calling warpgroup. The
counter starts at zero on every call: `fresh_counter` makes it, as a JAX ref that the kernel
takes as an input and writes.

Mosaic's `plgpu.atomic_add` returns no old value, so `claim` is inline PTX (GPU only; the
interpreter cannot run it: kernels there deal the items in the fixed order instead).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import llvm, memref


def fresh_counter():
    """A zero int32 counter [1] as a JAX ref, for a kernel that `claim`s from it."""
    return jax.new_ref(jnp.zeros((1,), jnp.int32))


def claim(counter_gmem, ticket_smem) -> jax.Array:
    """Inside a Mosaic GPU kernel (GPU), from one warpgroup: add one to counter_gmem[0] (GMEM
    int32 [1]) and return its value before, through ticket_smem (SMEM int32 [1], the
    warpgroup's own)."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
    def fetch_add(_, counter, ticket):
        i32 = ir.IntegerType.get_signless(32)
        i64 = ir.IntegerType.get_signless(64)
        mgpu_utils.warpgroup_barrier()  # every thread has read the last ticket
        with mgpu_utils.single_thread(mgpu_utils.ThreadSubset.WARPGROUP):
            address = llvm.ptrtoint(i64, mgpu_utils.memref_ptr(counter))
            old = mgpu_utils.inline_ptx(
                "atom.global.add.u32 $0, [$1], 1;",
                address,
                result_types=i32,
                has_side_effects=True,
            )
            memref.store(old, ticket, [mgpu_utils.c(0, ir.IndexType.get())])
        mgpu_utils.warpgroup_barrier()  # the ticket is in SMEM for every thread

    fetch_add(counter_gmem, ticket_smem)
    return ticket_smem[0]
