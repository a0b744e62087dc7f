"""Determinism properties of the reference layer (D1-D3 of docs/determinism.md, "The contract"),
each with a negative control.

Bits are compared through integer views (NaN-aware, -0 != +0): `assert_bitwise`.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmoe
from jaxmoe import MoE, MoEConfig
from jaxmoe.dispatch import LocalRoute
from jaxmoe.experts import ExpertMatrices, grouped_mlp
from jaxmoe.ops import gmm

from bitwise import assert_bitwise, bits, differs

H = 32
BASE = MoEConfig(
    num_experts=8,
    top_k=2,
    ffn_hidden_size=32,
    aux_loss_coeff=1e-2,
    shared_expert_intermediate_size=16,
    shared_expert_gate=True,
)


def make(config=BASE, seed=0):
    return MoE(config, H, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))


@nnx.jit
def forward(model, x):
    return model(x)[0]


def tokens(n, seed=1):
    return jax.random.normal(jax.random.key(seed), (n, H), jnp.bfloat16)


# ------------------------------------------------------------------------------ D1 run-to-run
def step_bits(seed_tokens=48):
    """[y, d x, every parameter gradient] of one training step of the BASE layer, as NumPy
    arrays, from separately compiled executables of the forward and the gradient."""
    model, x = make(), tokens(seed_tokens)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, x):
        y, aux = nnx.merge(graphdef, params, rest)(x)
        return jnp.sum(y.astype(jnp.float32) ** 2) + aux.total_loss, y

    step = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True)).lower(params, x).compile()
    (d_params, d_x), y = step(params, x)
    return [np.asarray(a) for a in [y, d_x, *jax.tree.leaves(d_params)]]


_OTHER_PROCESS = """
import numpy as np
import test_determinism
from bitwise import bits
np.savez({out!r}, *[bits(a) for a in test_determinism.step_bits()])
"""


def test_run_to_run_forward_and_gradients_identical(tmp_path):
    """The same step compiled twice in this process, and once in another process whose XLA:CPU
    runs its Eigen ops single-threaded (another split of the work): the same bits. Negative
    control: a one-ulp change of one input element changes the layer's output."""
    # Two real compilations: the test processes' compilation cache (tests/conftest.py) keeps
    # no entry of a program that compiles in less than this.
    threshold = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
    try:
        first, second = step_bits(), step_bits()
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", threshold)
    for a, b in zip(first, second, strict=True):
        assert_bitwise(a, b)
    out = tmp_path / "other.npz"
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_cpu_multi_thread_eigen=false",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join(os.path.join(tests, d) for d in ("layer", "support")),
    )
    subprocess.run(
        [
            sys.executable,
            "-c",
            _OTHER_PROCESS.format(out=str(out)),
        ],
        env=env,
        check=True,
    )
    other = np.load(out)
    for i, a in enumerate(first):
        assert_bitwise(bits(a), other[f"arr_{i}"])
    model, x = make(), tokens(48)
    nudged = x.at[0, 0].set(jnp.nextafter(x[0, 0], jnp.inf).astype(x.dtype))
    assert differs(np.asarray(forward(model, nudged)), first[0])


def test_negative_control_combine_order_is_visible_in_bits():
    """The bitwise check has teeth: summing the same expert outputs in another order (what an
    atomic scatter-add may do) changes bits that the comparison above would catch."""
    rows = jax.random.normal(jax.random.key(3), (4, 256, H), jnp.bfloat16) * 8
    ascending = rows[0].astype(jnp.float32)
    for j in range(1, 4):
        ascending = ascending + rows[j].astype(jnp.float32)
    sequential_bf16 = rows[0]
    for j in (3, 1, 2):
        sequential_bf16 = sequential_bf16 + rows[j]
    assert differs(ascending.astype(jnp.bfloat16), sequential_bf16)


# ------------------------------------------------------------------------------ D2 batch invariance
@pytest.mark.parametrize("position", [0, 17, 64])
def test_token_alone_equals_token_in_batch(position):
    model, others, needle = make(), tokens(64, seed=2), tokens(1, seed=3)
    alone = forward(model, needle)
    batch = jnp.concatenate([others[:position], needle, others[position:]])
    assert_bitwise(forward(model, batch)[position : position + 1], alone)


def test_permuted_batch_permutes_outputs():
    model, x = make(), tokens(65, seed=4)
    perm = np.random.default_rng(0).permutation(65)
    assert_bitwise(forward(model, x[perm]), forward(model, x)[perm])


def test_empty_and_single_row_experts():
    config = BASE.replace(num_experts=16, top_k=2)
    model = make(config)
    few = tokens(3, seed=5)  # 3 tokens x 2 slots: at least 10 of 16 experts empty
    counts = np.asarray(model(few)[1].tokens_per_expert)
    assert np.sum(counts == 0) >= 10 and np.any(counts == 1)
    batch = jnp.concatenate([few, tokens(60, seed=6)])
    assert_bitwise(forward(model, batch)[:3], forward(model, few))


@pytest.mark.parametrize("alignment", [8, 32, 128])
def test_alignment_padding_never_changes_real_rows(alignment):
    reference = forward(make(BASE), tokens(40))
    padded = forward(make(BASE.replace(expert_row_alignment=alignment)), tokens(40))
    assert_bitwise(padded, reference)


def test_padding_row_contents_do_not_reach_real_rows_in_bf16():
    """Garbage (NaN) in padding rows of the expert buffer leaves real rows' bits unchanged."""
    config = BASE.replace(expert_row_alignment=8)
    model, x = make(config), tokens(20, seed=7)
    _, routing = model.router(x)
    plan = jaxmoe.make_plan(routing, config)
    real = np.asarray(plan.row_slot) < plan.num_tokens * plan.top_k
    assert not real.all()  # the buffer has padding rows
    rows, probs = jaxmoe.dispatch(x, plan), jaxmoe.gather_slots(routing.probs, plan)
    experts = model.experts

    def run(rows):
        return grouped_mlp(
            rows,
            probs,
            LocalRoute(plan, "xla"),
            ExpertMatrices(experts.fc1_kernel[...], experts.fc2_kernel[...]),
            config,
            gmm_impl="xla",
        )

    clean = run(rows)
    dirty = run(jnp.where(real[:, None], rows, jnp.nan))
    assert_bitwise(np.asarray(dirty.output)[real], np.asarray(clean.output)[real])
    assert_bitwise(dirty.combined, clean.combined)


def test_negative_control_single_row_dot_is_batch_variant():
    """Why the expert buffer has at least 8 rows: XLA:CPU computes a 1-row matmul with another
    summation order than the same row inside a larger matmul. The batch-invariance test above
    would fail on a buffer of one row; this shows the check detects such a difference."""
    lhs = tokens(8, seed=8)
    rhs = jax.random.normal(jax.random.key(9), (1, H, 256), jnp.bfloat16)
    one = gmm(lhs[:1], rhs, jnp.array([1], jnp.int32), impl="xla")
    many = gmm(lhs, rhs, jnp.array([8], jnp.int32), impl="xla")
    assert differs(one, many[:1])


# ------------------------------------------------------------------------------ D3 train == inference
def test_training_forward_equals_inference_forward():
    model, x = make(), tokens(48, seed=10)

    def loss(model, x):
        y, aux = model(x)
        return jnp.sum(y.astype(jnp.float32)) + aux.total_loss, y

    _, y_train = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model, x)[0]
    assert_bitwise(y_train, forward(model, x))


def test_negative_control_garbage_padding_changes_mxfp8_column_scales():
    """Why padding rows must be zero before any MXFP8 quantize: the columnwise (wgrad) copy has
    32-row blocks along the token axis, so garbage in a padding row changes the scales, hence
    the dequantized values, of real rows sharing its block. Zero padding leaves them alone."""
    real = tokens(20, seed=11)  # an expert block with 20 real rows

    def real_rows_after_roundtrip(padding):
        block = jnp.concatenate([real, padding])
        return jaxmoe.mxfp8.dequantize(jaxmoe.mxfp8.quantize(block, axis=0), jnp.bfloat16)[:20]

    to_32 = real_rows_after_roundtrip(jnp.zeros((12, H), jnp.bfloat16))
    to_64 = real_rows_after_roundtrip(jnp.zeros((44, H), jnp.bfloat16))
    garbage = real_rows_after_roundtrip(jnp.full((12, H), 1e4, jnp.bfloat16))
    assert_bitwise(to_64, to_32)
    assert differs(garbage, to_32)
