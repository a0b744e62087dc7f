"""Inputs shared by the quantize kernel tests: values over many binades with NaN, Inf, denormals
and whole zero/denormal blocks, finite normal-range values, and dispatch rows."""

import jax
import jax.numpy as jnp

SPECIALS = [
    jnp.nan,
    -jnp.nan,
    jnp.inf,
    -jnp.inf,
    -0.0,
    1e-40,
    -3e-39,
    2e-45,
    3e38,
    448.0,
    449.0,
    57344.0,
    1.0,
]


def tensor(shape, dtype, seed=0):
    """Random values over many binades, with whole blocks of specials, zeros and denormals."""
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], shape) * jnp.exp2(
        jax.random.randint(keys[1], shape, -20, 20).astype(jnp.float32)
    )
    flat = x.reshape(-1)
    picks = jax.random.randint(keys[2], (64,), 0, flat.size)
    flat = flat.at[picks].set(jnp.asarray(SPECIALS * 5)[:64])
    flat = flat.at[:32].set(0.0).at[32:64].set(1e-40)  # an all-zero and a denormal block
    return flat.reshape(shape).astype(dtype)


def normal_range(shape, dtype, seed=0):
    """Finite values whose scaled copies stay fp32 normals: what the "float" arithmetic can be
    checked on in the CPU interpreter (XLA:CPU flushes denormals; the GPU does not)."""
    keys = jax.random.split(jax.random.key(seed), 2)
    return (
        jax.random.normal(keys[0], shape)
        * jnp.exp2(jax.random.randint(keys[1], shape, -20, 20).astype(jnp.float32))
    ).astype(dtype)


def row_tokens(num_tokens, num_rows, seed=4):
    """Dispatch rows: random tokens, every 7th row a padding row (token T)."""
    tokens = jax.random.randint(jax.random.key(seed), (num_rows,), 0, num_tokens)
    return tokens.at[::7].set(num_tokens).astype(jnp.int32)


def gathered(x, row_token):
    """The rows x[row_token] with zero rows for padding (row_token == T)."""
    return jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[row_token]
