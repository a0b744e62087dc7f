"""The narrow-tile dense kernel (`jaxmoe/ops/pallas/dense_narrow_hopper.py`): the grouped-matmul
kernel's bits (one group) at every config, in the CPU interpreter (race detector on) and, marked
`gpu`, on an H100/H200 at the routers of the benchmark shapes; where `dense` takes it; its
refusals. In the interpreter both kernels add each K step's products in K order
(tests/support/interpreter.py), so their bits are `in_k_steps`'s on any CPU; the negative control
is that another K step gives other bits."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmoe.ops.dense import dense
from jaxmoe.ops.gmm import gmm
from jaxmoe.ops.pallas.dense_narrow_hopper import (
    NarrowConfig,
    default_narrow_config,
    dense_narrow_pallas,
    fits_one_wave,
)
from jaxmoe.shapes import SHAPES

from bitwise import assert_bitwise, differs
from interpreter import matmul_in_k_order
from jaxprs import KERNEL_PRIMITIVE, equations

BF16, F32 = jnp.bfloat16, jnp.float32


def operands(m, k, n, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), F32).astype(BF16)
    w = (jax.random.normal(kw, (k, n), F32) / np.sqrt(k)).astype(BF16)
    return x, w


def grouped_kernel_product(x, w, out_dtype):
    """x @ w on the grouped-matmul kernel with one group: the bits dense had before."""
    return gmm(
        x,
        w[None],
        np.array([x.shape[0]], np.int32),
        impl="pallas",
        preferred_element_type=out_dtype,
    )


def in_k_steps(x, w, tile_k):
    """x @ w in fp32 as the interpreted kernels add it: each K step's products in K order from
    +0.0 (`matmul_in_k_order`, the interpreter's wgmma), the steps' sums added in order."""
    x, w = np.asarray(x), np.asarray(w)
    total = np.zeros((x.shape[0], w.shape[1]), np.float32)
    for start in range(0, x.shape[1], tile_k):
        step = slice(start, start + tile_k)
        total += matmul_in_k_order(x[:, step], w[step], np.float32)
    return total


# Each with the grouped kernel's K step (128 where K allows, else 64): the interpreter's wgmma
# starts each step's sum from +0.0, so interpreted bits depend on the K step; on the GPU they do
# not (the gpu test below).
CONFIGS = {
    "n64_k128": (NarrowConfig(64, 128, 4), 128, 512, 128),
    "n32_k64_two_row_tiles": (NarrowConfig(32, 64, 2), 128, 192, 64),
    "n16_one_k_step": (NarrowConfig(16, 64, 1), 64, 64, 64),
}


@pytest.mark.parametrize("out_dtype", [BF16, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", CONFIGS.values(), ids=CONFIGS.keys())
def test_narrow_kernel_gives_the_grouped_kernels_bits(interpret, case, out_dtype):
    config, m, k, n = case
    x, w = operands(m, k, n)
    got = np.asarray(dense_narrow_pallas(x, w, out_dtype=out_dtype, config=config))
    assert_bitwise(got, np.asarray(grouped_kernel_product(x, w, out_dtype)))
    assert_bitwise(got, in_k_steps(x, w, config.tile_k).astype(out_dtype))


def test_negative_control_another_k_step_gives_other_bits():
    """The checks above can fail: the same products in K steps of 64 and of 128, or in one
    step, differ in fp32."""
    x, w = operands(64, 256, 64)
    sums = [in_k_steps(x, w, tile_k) for tile_k in (64, 128, 256)]
    assert differs(sums[0], sums[1]) and differs(sums[1], sums[2])


def test_dense_takes_the_narrow_kernel_where_the_product_fits_one_wave(monkeypatch):
    """At 64 tokens the routers of the benchmark shapes fit one wave of 64 x 64 tiles on 132
    SMs and run on the narrow kernel; a training-size router (8192 tokens) does not."""
    monkeypatch.setattr(sys.modules["jaxmoe.ops.dense"], "num_sms", lambda: 132)
    s = jax.ShapeDtypeStruct

    def kernels(tokens, shape_name):
        shape = SHAPES[shape_name]
        x = s((tokens, shape.hidden_size), BF16)
        w = s((shape.hidden_size, shape.config.num_experts), BF16)
        jaxpr = jax.make_jaxpr(lambda x, w: dense(x, w, impl="pallas"))(x, w).jaxpr
        return [e.params["name"] for e in equations(jaxpr) if e.primitive.name == KERNEL_PRIMITIVE]

    for shape_name in ("qwen3_30b", "mixtral", "dsv3_ep8"):
        assert kernels(64, shape_name) == ["dense_narrow"]
    assert kernels(8192, "qwen3_30b") == ["gmm"]
    assert fits_one_wave(64 * 132, 64, 132) and not fits_one_wave(64 * 133, 64, 132)


def test_refuses_bad_problems():
    x, w = operands(64, 256, 128)
    for bad in (NarrowConfig(tile_n=8), NarrowConfig(tile_n=128), NarrowConfig(tile_k=256)):
        with pytest.raises(ValueError, match="tile_"):
            dense_narrow_pallas(x, w, out_dtype=BF16, config=bad)
    with pytest.raises(ValueError, match="max_concurrent_steps"):
        dense_narrow_pallas(x, w, out_dtype=BF16, config=NarrowConfig(max_concurrent_steps=3))
    with pytest.raises(ValueError, match="multiple of 64"):
        dense_narrow_pallas(x[:40], w, out_dtype=BF16, config=default_narrow_config(256))
    with pytest.raises(ValueError, match="multiple of tile_n"):
        dense_narrow_pallas(x, w[:, :96], out_dtype=BF16, config=NarrowConfig(tile_n=64))
    with pytest.raises(ValueError, match="both be bf16 or fp16"):
        dense_narrow_pallas(x, w.astype(F32), out_dtype=BF16, config=default_narrow_config(256))
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        dense_narrow_pallas(x, w[:128], out_dtype=BF16, config=default_narrow_config(256))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [64, 256])
@pytest.mark.parametrize("shape_name", ["qwen3_30b", "mixtral", "dsv3_ep8"])
def test_gpu_routers_take_the_grouped_kernels_bits(shape_name, tokens):
    """On an H100/H200: the routers of the benchmark shapes (dsv3_ep8's logits in fp32, as its
    router_dtype) on the narrow kernel give the grouped kernel's bits, with the column tiles
    and K steps of every config, and a token's logits do not depend on the batch."""
    shape = SHAPES[shape_name]
    out_dtype = F32 if shape.config.router_dtype == "fp32" else BF16
    x, w = operands(tokens, shape.hidden_size, 64 * -(-shape.config.num_experts // 64), seed=1)
    want = np.asarray(grouped_kernel_product(x, w, out_dtype))
    for tile_n, tile_k in ((16, 128), (32, 128), (64, 128), (64, 64)):
        config = NarrowConfig(tile_n, tile_k, 4)
        assert_bitwise(
            np.asarray(dense_narrow_pallas(x, w, out_dtype=out_dtype, config=config)), want
        )
    alone = dense_narrow_pallas(
        jnp.pad(x[5:6], ((0, 63), (0, 0))),
        w,
        out_dtype=out_dtype,
        config=default_narrow_config(shape.hidden_size),
    )
    assert_bitwise(np.asarray(alone)[:1], want[5:6])
