"""The tiles that the weighted SwiGLU kernels (`activation_forward_hopper.py`,
`activation_backward_hopper.py`) stream through `row_pipeline`.

For h [M, 2F] ([gate; up]) a tile is ROWS rows by CHUNKS chunks of 32 columns of F; tiles walk
a row band's chunks, then the next band. Each operand's chunk is one TMA into a [ROWS, 32] SMEM
array, loaded in one register layout (`layout()`), so a thread holds the same rows and lanes of
every chunk. The per-row probability p is spread over 32 lanes ([M, 32] fp32, `spread_rows`) so
that it loads in that layout too. Given a live row count (`jaxmoe.ops.live_rows`) only the row
bands holding rows below it run."""

from __future__ import annotations

import dataclasses

import jax
import jax.experimental.mosaic.gpu as mgpu
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxmoe.ints import cdiv
from jaxmoe.mxfp8 import BLOCK_SIZE
from jaxmoe.ops.pallas.row_pipeline import live_tiles

ROWS = 16  # rows a tile: a [16, 32] chunk is one 4-element vector a thread
CHUNKS = 8  # 32-column chunks a tile (the backward's row sums: 3 tree levels in registers)
COLUMNS = BLOCK_SIZE * CHUNKS  # F must be a multiple of this
HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def swiglu_problem(h_shape, h_dtype, dtypes=HALF_DTYPES) -> str | None:
    """Why a weighted SwiGLU kernel taking h of `dtypes` cannot take h (None: it can)."""
    if len(h_shape) != 2 or h_shape[1] % 2:
        return f"needs h [M, 2F], got {tuple(h_shape)}"
    if jnp.dtype(h_dtype) not in dtypes:
        names = " or ".join(jnp.dtype(d).name for d in dtypes)
        return f"needs h in {names}, got {h_dtype}"
    m, two_f = h_shape
    if m == 0 or (two_f // 2) % COLUMNS:
        return f"needs M > 0 and F a multiple of {COLUMNS}, got M={m}, F={two_f // 2}"
    return None


def weighted_swiglu(gate, up, p):
    """silu(gate) * up * p in fp32, in `jaxmoe.ops.activation.gated_activation`'s order
    (silu(gate) = gate * sigmoid(gate), times up, then times p), for every kernel that computes
    the weighted activation: their bits equal XLA's on the GPU (docs/kernels/activation.md)."""
    return ((gate * jax.nn.sigmoid(gate)) * up) * p


def weighted_swiglu_backward(gate, up, g, p, layout=None):
    """(d gate, d up, g * silu(gate) * up) in fp32 of the weighted SwiGLU for its gradient g, for
    every kernel that computes the backward (their bits agree): with s = sigmoid(gate),
    d up = g p silu(gate) and d gate = g p up s + (g p up gate) (s (1 - s)), as JAX's autodiff
    orders them; the third is the per-element term of the probability gradient, which the
    kernels sum.

    Compiled for the GPU (`layout`: the operands' register layout; None when interpreted), the
    products that an add consumes (d gate's two terms, and the third output) pass through an
    LLVM optimization barrier: Mosaic GPU marks float arithmetic `contract`, so LLVM would
    otherwise fuse a product into the add as it sees fit, which depends on the code around it
    (a first build of the one-pass backward-quantize kernel, without the barrier, gave a quarter
    of the row sums' partials another last bit than the two-kernel route: docs/kernels/activation.md).
    Each operation then rounds on its own, in every kernel alike."""
    s = jax.nn.sigmoid(gate)
    act = gate * s
    ct = g * p
    d_act = ct * up
    first, second, product = _unfused(
        layout, d_act * s, (d_act * gate) * (s * (1.0 - s)), g * (act * up)
    )
    return first + second, ct * act, product


def _unfused(layout, *products):
    """`products` as they are; on the GPU through one LLVM optimization barrier, so that no add
    that consumes them is fused with the multiply that made them."""
    if layout is None:
        return products
    like = plgpu.ShapeDtypeStruct(products[0].shape, products[0].dtype, layout=layout)

    @plgpu.inline_mgpu(arg_types=(layout,) * len(products), return_type=(like,) * len(products))
    def barrier(_, *arrays):
        out = mgpu.optimization_barrier(*arrays)
        return tuple(out) if len(arrays) > 1 else (out,)

    return barrier(*products)


def layout():
    """The register layout of every [ROWS, 32] chunk."""
    return plgpu.Layout.WG_STRIDED((ROWS, BLOCK_SIZE), vec_size=ROWS * BLOCK_SIZE // 128)


def spread_rows(probs: jnp.ndarray) -> jnp.ndarray:
    """p [M] as fp32 [M, 32]: each row's value in every lane (M x 128 bytes)."""
    return jnp.broadcast_to(probs.astype(jnp.float32)[:, None], (probs.shape[0], BLOCK_SIZE))


@dataclasses.dataclass(frozen=True)
class ChunkTiles:
    """The tile walk over M rows and F columns (F a multiple of COLUMNS)."""

    m: int
    f: int

    @property
    def chunk_tiles(self) -> int:
        """Tiles a row band."""
        return self.f // COLUMNS

    @property
    def num_tiles(self) -> int:
        return cdiv(self.m, ROWS) * self.chunk_tiles

    def count(self, live_gmem):
        """The tiles to run: all, or (a live count in live_gmem) the bands below it."""
        if live_gmem is None:
            return self.num_tiles
        return live_tiles(live_gmem, self.m, ROWS, self.chunk_tiles)

    def place(self, t):
        """(rows, first column of F, chunk tile) of tile t."""
        rows = pl.ds((t // self.chunk_tiles) * ROWS, ROWS)
        chunk_tile = lax.rem(t, self.chunk_tiles)
        return rows, chunk_tile * COLUMNS, chunk_tile

    def fetch(self, sources, in_smem, p_gmem, p_smem):
        """`row_pipeline`'s fetch: each (array, column offset) of `sources` into in_smem[slot, a,
        chunk], p's rows into p_smem[slot]."""

        def fetch(t):
            rows, col0, _ = self.place(t)

            def issue(slot, barrier):
                for q in range(CHUNKS):
                    for a, (src, offset) in enumerate(sources):
                        columns = pl.ds(offset + col0 + q * BLOCK_SIZE, BLOCK_SIZE)
                        plgpu.copy_gmem_to_smem(
                            src.at[rows, columns], in_smem.at[slot, a, q], barrier
                        )
                plgpu.copy_gmem_to_smem(p_gmem.at[rows], p_smem.at[slot], barrier)

            return issue

        return fetch

    def store_chunks(self, t, slot, outputs, out_smem):
        """Start the TMA stores of out_smem[slot, a, chunk] into each (array, column offset) of
        `outputs`; returns the tile's chunk tile."""
        rows, col0, chunk_tile = self.place(t)
        for q in range(CHUNKS):
            for a, (dst, offset) in enumerate(outputs):
                columns = pl.ds(offset + col0 + q * BLOCK_SIZE, BLOCK_SIZE)
                plgpu.copy_smem_to_gmem(
                    out_smem.at[slot, a, q], dst.at[rows, columns], commit_group=False
                )
        return chunk_tile


def loads_per_tile(num_sources: int) -> int:
    """TMA loads a tile: each source's chunks and p's rows (a barrier's arrivals)."""
    return num_sources * CHUNKS + 1
