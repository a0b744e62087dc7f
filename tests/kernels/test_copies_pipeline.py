"""What the SwiGLU copy kernels share on `copies_pipeline` (the forward's
`swiglu_quantize_hopper`, the backward's `swiglu_backward_quantize_hopper`): the ring's default
size and its refusals, and lowering for sm_90a at the layers' real shapes within the shared
memory of one CTA an SM. Their bits are tested in tests/kernels/test_swiglu_quantize_pallas.py and
tests/kernels/test_swiglu_backward_quantize_pallas.py."""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.mosaic.gpu.core import artificial_shared_memory_limit

from jaxmoe.ops.pallas import swiglu_backward_quantize_hopper as backward
from jaxmoe.ops.pallas import swiglu_quantize_hopper as forward
from jaxmoe.ops.pallas.row_pipeline import smem_per_cta
from jaxmoe.shapes import SHAPES

BF16 = jnp.bfloat16
S = jax.ShapeDtypeStruct


def forward_call(m, f, live):
    fn = lambda h, p, live: forward.weighted_swiglu_quantize_1x128_with_transpose_pallas(  # noqa: E731
        h, p, arithmetic="float", live_rows=live
    )
    return fn, (S((m, 2 * f), BF16), S((m,), jnp.float32), live)


def backward_call(m, f, live):
    fn = lambda h, p, g, live: (  # noqa: E731
        backward.weighted_swiglu_backward_quantize_1x128_with_transpose_pallas(
            h, p, g, arithmetic="float", live_rows=live
        )
    )
    return fn, (S((m, 2 * f), BF16), S((m,), jnp.float32), S((m, f), BF16), live)


# kernel -> (module, its default slots a warpgroup, a call (fn, operand shapes) at M, F)
KERNELS = {"forward": (forward, 3, forward_call), "backward": (backward, 3, backward_call)}


@pytest.mark.parametrize("kernel", KERNELS)
def test_ring_slots_fit_the_cta_share(kernel):
    """As many 32-row slots a warpgroup by default as fit beside the tiles, at most three (the
    forward's four input windows fit three; the backward's three would fit a fourth, measured
    slower); a count past that, or none, is refused."""
    module, default, _ = KERNELS[kernel]
    assert module.ring_slots(None) == default
    assert module.ring_slots(2) == 2
    for bad in (default + 1, 0):
        with pytest.raises(ValueError, match="slots a warpgroup: the ring takes 1 to 3"):
            module.ring_slots(bad)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", ["qwen3_30b", "mixtral", "dsv3_ep8"])
def test_lowers_at_real_shapes(kernel, shape):
    """Lowering for sm_90a at the layers' expert rows within the shared memory of one CTA an
    SM, with and without a live row count."""
    config = SHAPES[shape].config
    m, f = SHAPES[shape].num_tokens * config.top_k, config.ffn_hidden_size
    call = KERNELS[kernel][2]
    with artificial_shared_memory_limit(smem_per_cta(1)):
        for live in (None, S((), jnp.int32)):
            fn, args = call(m, f, live)
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def test_profile_script_runs_both_kernels(interpret):
    """benchmarks/research/profile_gmm.py's SwiGLU ops (for Nsight Compute) run the two kernels on fc1's
    output: the forward's copies are the forward then the quantize, the backward's those of the
    backward kernel then the quantize kernel."""
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.research import profile_gmm
    from jaxmoe.ops import quantize_1x128_with_transpose, weighted_activation_forward
    from jaxmoe.ops.pallas.activation_backward_hopper import weighted_swiglu_backward_pallas

    from bitwise import assert_bitwise

    m, n = 256, 512
    keys = jax.random.split(jax.random.key(3), 3)  # profile_gmm.swiglu_call's operands
    h = jax.random.normal(keys[0], (m, n), jnp.bfloat16)
    p = jax.random.uniform(keys[1], (m,), jnp.float32)
    g = jax.random.normal(keys[2], (m, n // 2), jnp.bfloat16)
    forward_copies = profile_gmm.swiglu_call("swiglu_copies", m, n)()
    a = weighted_activation_forward(h, p, "silu", True, impl="xla")
    want = quantize_1x128_with_transpose(a, impl="xla")
    for ours, theirs in zip(jax.tree.leaves(forward_copies), jax.tree.leaves(want), strict=True):
        assert_bitwise(np.asarray(ours), np.asarray(theirs))
    backward_copies, _ = profile_gmm.swiglu_call("swiglu_backward_copies", m, n)()
    d_h, _ = weighted_swiglu_backward_pallas(h, p, g)
    want = quantize_1x128_with_transpose(d_h, impl="xla")
    for ours, theirs in zip(jax.tree.leaves(backward_copies), jax.tree.leaves(want), strict=True):
        assert_bitwise(np.asarray(ours), np.asarray(theirs))
