"""The transformer's attention and its building blocks: `Linear`, `RMSNorm`, RoPE, the masks of
packed sequences and of the KV cache, and grouped-query `Attention` on
`jax.nn.dot_product_attention`.

Matmuls run on `jaxmoe.ops.dense` (batch-invariant on the GPU kernels, like the MoE layer's
token-row matmuls) and RMSNorm's sums on `jaxmoe.ordered` (an order no compilation changes);
the attention itself is JAX's (XLA or cuDNN).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe.models.config import LMConfig
from jaxmoe.moe import EMBED, Initializer, _weight
from jaxmoe.ops import dense
from jaxmoe.ordered import broadcast_in_order, row_sums_in_order

F32 = jnp.float32

# Logical axis names of the attention's parameters besides jaxmoe.moe's EMBED and MLP:
# the query heads' and the key/value heads' features (heads x head_dim, flattened).
HEADS, KV_HEADS = "heads", "kv_heads"


class Linear(nnx.Module):
    """y = x @ kernel for x [..., K], kernel [K, N] (no bias), on `jaxmoe.ops.dense` in x's
    dtype (the kernel cast to it) with fp32 accumulation."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        axes: tuple[str | None, str | None],
        param_dtype,
        kernel_init: Initializer,
        gmm_impl: str,
        rngs: nnx.Rngs,
    ):
        self.kernel = _weight(kernel_init, rngs, (in_features, out_features), param_dtype, axes)
        self.gmm_impl = gmm_impl

    def __call__(self, x: jax.Array) -> jax.Array:
        return matmul(x, self.kernel[...], self.gmm_impl)


def matmul(x: jax.Array, w: jax.Array, impl: str) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N] in x.dtype on `jaxmoe.ops.dense`."""
    y = dense(x.reshape(-1, x.shape[-1]), w.astype(x.dtype), impl=impl)
    return y.reshape(x.shape[:-1] + (w.shape[1],))


class RMSNorm(nnx.Module):
    """x / sqrt(mean(x^2) + eps) * scale over the last axis, in fp32, rounded once to x.dtype.
    The mean's sum and the gradients' sums over the broadcast axes run in a fixed order
    (`jaxmoe.ordered`)."""

    def __init__(self, features: int, *, eps: float, param_dtype, axis_name: str | None):
        self.scale = nnx.Param(
            jnp.ones((features,), param_dtype), out_sharding=(axis_name,), eager_sharding=False
        )
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        z = x.astype(F32)
        mean_square = row_sums_in_order(z * z, keepdims=True) / x.shape[-1]
        inv_rms = broadcast_in_order(jax.lax.rsqrt(mean_square + self.eps), x.shape)
        scale = broadcast_in_order(self.scale[...].astype(F32), x.shape)
        return (z * inv_rms * scale).astype(x.dtype)


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [..., head_dim] in fp32 for integer positions [...]: HF's layout, the
    frequencies theta^(-2j/head_dim) (j < head_dim/2) repeated for both halves."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=F32) / head_dim))
    angles = positions.astype(F32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """RoPE with HF's rotate-half convention on x [B, S, heads, D] with tables [B, S, D]:
    x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], in fp32, rounded to x.dtype.
    Elementwise: a token's result depends only on its own features and position."""
    z = x.astype(F32)
    x1, x2 = jnp.split(z, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (z * cos[:, :, None, :] + rotated * sin[:, :, None, :]).astype(x.dtype)


def segment_causal_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, 1, S, S] bool for segment ids [B, S]: query t sees key s when s <= t and both have
    the same segment id (packed documents never see each other; padding, id 0, sees only
    padding). Every query sees itself, so no row of the softmax is empty."""
    s = segment_ids.shape[-1]
    causal = jnp.tril(jnp.ones((s, s), bool))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (same & causal)[:, None]


def cache_mask(lengths: jax.Array, num_new: int, max_len: int) -> jax.Array:
    """[B, 1, T, max_len] bool for T = num_new tokens appended at each row's cached length
    lengths [B]: query i sees the cache entries j <= lengths + i (its own row's earlier tokens
    and itself, none of the entries past them)."""
    last = lengths[:, None] + jnp.arange(num_new, dtype=lengths.dtype)  # [B, T]
    return (jnp.arange(max_len, dtype=lengths.dtype) <= last[:, :, None])[:, None]


# cuDNN's fused attention: on NVIDIA GPUs, for 16-bit compute and head sizes it supports.
_CUDNN_DTYPES = ("bfloat16", "float16")
_CUDNN_MAX_HEAD_DIM = 128


def attention_impl_used(config: LMConfig, backend: str | None = None) -> str:
    """Which implementation the training forward's attention runs for `config` on `backend`
    (None: the default one): "xla" or "cudnn". "auto" takes cuDNN's fused attention on a GPU
    where it applies (bf16/fp16 compute, head_dim a multiple of 8 up to 128) and XLA elsewhere
    (JAX's own implementation=None is XLA everywhere). Generation's decode steps attend to the
    cache with XLA."""
    if config.attention_impl != "auto":
        return config.attention_impl
    backend = backend or jax.default_backend()
    cudnn = (
        backend == "gpu"
        and config.dtype in _CUDNN_DTYPES
        and config.head_dim % 8 == 0
        and config.head_dim <= _CUDNN_MAX_HEAD_DIM
    )
    return "cudnn" if cudnn else "xla"


KVWrite = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE: q/k/v projections (optionally RMSNorm over
    head_dim on q and k, before RoPE), `jax.nn.dot_product_attention` under a boolean mask,
    the output projection. Parameters: q_proj.kernel [H, N D], k_proj/v_proj.kernel
    [H, K D], o_proj.kernel [N D, H], q_norm/k_norm.scale [D] with qk_norm."""

    def __init__(self, config: LMConfig, *, gmm_impl: str, rngs: nnx.Rngs, init, output_init):
        h, d = config.hidden_size, config.head_dim
        n, k = config.num_heads, config.num_kv_heads
        dtype = jnp.dtype(config.param_dtype)
        linear = functools.partial(Linear, param_dtype=dtype, gmm_impl=gmm_impl, rngs=rngs)
        self.q_proj = linear(h, n * d, axes=(EMBED, HEADS), kernel_init=init)
        self.k_proj = linear(h, k * d, axes=(EMBED, KV_HEADS), kernel_init=init)
        self.v_proj = linear(h, k * d, axes=(EMBED, KV_HEADS), kernel_init=init)
        self.o_proj = linear(n * d, h, axes=(HEADS, EMBED), kernel_init=output_init)
        norm = functools.partial(RMSNorm, d, eps=config.norm_eps, param_dtype=dtype, axis_name=None)
        self.q_norm = norm() if config.qk_norm else None
        self.k_norm = norm() if config.qk_norm else None
        self.num_heads, self.num_kv_heads, self.head_dim = n, k, d
        self.implementation = attention_impl_used(config)

    def __call__(
        self,
        x: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        mask: jax.Array | None,
        write: KVWrite | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """(out [B, T, H], (keys, values)) for x [B, T, H], the RoPE tables [B, T, D] of its
        positions and mask [B, 1, T, S] (None: causal over x's own tokens). write(k, v): where
        the new keys and values [B, T, K, D] go, returning the S keys and values to attend to (a
        KV cache); None: attend to x's own."""
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        # Materialised: XLA's FMA contraction depends on the fusion, so without the barrier a
        # prefill that also returns k and v could compute them, and the logits, in other bits.
        q, k, v = jax.lax.optimization_barrier((q, k, v))
        if write is not None:
            k, v = write(k, v)
        out = jax.nn.dot_product_attention(
            q,
            k.astype(q.dtype),
            v.astype(q.dtype),
            mask=mask,
            is_causal=mask is None,
            implementation=self.implementation if write is None else "xla",
        )
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim)), (k, v)
