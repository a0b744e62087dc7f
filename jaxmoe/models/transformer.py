"""`MoETransformer`: a decoder-only language model whose FFNs are `jaxmoe.MoE` layers.

    tokens -> embed -> L x [x + attn(norm(x)); x + ffn(norm(x))] -> final norm -> head -> logits

Pre-norm blocks (RMSNorm), grouped-query attention with RoPE over packed sequences (a token
sees the earlier tokens of its own segment), FFNs dense SwiGLU or MoE (`LMConfig.layer_kinds`).
Parameters (flax [in, out] layout, logical axis names for sharding):
  embed.embedding [V, H]; layers[i].input_norm.scale [H]; layers[i].attention.{q,k,v,o}_proj
  .kernel, .{q,k}_norm.scale (`jaxmoe.models.attention.Attention`); layers[i]
  .post_attention_norm.scale [H]; layers[i].ffn: dense gate_up.kernel [H, 2F] ([gate; up]) and
  down.kernel [F, H], or the MoE's own (`jaxmoe.moe`); final_norm.scale [H]; lm_head.kernel
  [H, V] (none when tied: the head is embed.embedding transposed).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxmoe.models.attention import (
    Attention,
    Linear,
    RMSNorm,
    cache_mask,
    matmul,
    rope_tables,
    segment_causal_mask,
)
from jaxmoe.models.config import LayerKind, LMConfig
from jaxmoe.moe import EMBED, MLP, MoE, MoEAux, megatron_normal
from jaxmoe.ops.activation import gated_activation
from jaxmoe.ordered import sum_in_order

VOCAB = "vocab"  # logical axis name of the vocabulary

_REMAT_POLICIES = {"full": None, "dots_saveable": jax.checkpoint_policies.dots_saveable}


@struct.dataclass
class LMAux:
    """The MoE layers' auxiliary values, stacked in layer order (L_moe = the MoE layers).

    load_balancing_loss, z_loss: [L_moe] fp32, coefficients applied (`jaxmoe.MoEAux`).
    tokens_per_expert: [L_moe, E] int32 kept (token, expert) pairs, padding excluded.
    The caller adds `total_loss` to its objective: nothing is added silently."""

    load_balancing_loss: jax.Array
    z_loss: jax.Array
    tokens_per_expert: jax.Array

    @property
    def total_loss(self) -> jax.Array:
        """Every MoE layer's load-balancing and z losses summed (in a fixed order)."""
        return sum_in_order(self.load_balancing_loss + self.z_loss)

    @classmethod
    def stack(cls, auxes: Sequence[MoEAux]) -> LMAux:
        """The layers' `MoEAux` stacked."""
        return cls(
            load_balancing_loss=jnp.stack([a.load_balancing_loss for a in auxes]),
            z_loss=jnp.stack([a.z_loss for a in auxes]),
            tokens_per_expert=jnp.stack([a.tokens_per_expert for a in auxes]),
        )


@struct.dataclass
class KVCache:
    """The attention keys and values of the tokens so far, for generation (`MoETransformer
    .decode`): k, v [L, B, max_len, kv_heads, head_dim] (after RoPE); lengths [B] int32, the
    number of valid entries of each row (its entries [0, lengths) are valid, left-aligned)."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @property
    def max_len(self) -> int:
        """The entries each row holds at most."""
        return self.k.shape[2]


@dataclasses.dataclass(frozen=True)
class ParameterCount:
    """A model's parameters: `total`, and `active`, those one token uses (`count_parameters`)."""

    total: int
    active: int


class Embedding(nnx.Module):
    """The token embedding [V, H]; `attend` is the tied output head (h @ embedding^T)."""

    def __init__(self, config: LMConfig, *, init, gmm_impl: str, rngs: nnx.Rngs):
        shape = (config.vocab_size, config.hidden_size)
        self.embedding = nnx.Param(
            init(rngs.params(), shape, jnp.dtype(config.param_dtype)),
            out_sharding=(VOCAB, EMBED),
            eager_sharding=False,
        )
        self.gmm_impl = gmm_impl

    def __call__(self, tokens: jax.Array, dtype) -> jax.Array:
        """[..., H] rows in `dtype`; an id outside [0, V) under a trace (unchecked) gets a NaN
        row, so that it shows in the logits instead of reading another token's row."""
        table = self.embedding[...]
        return jnp.take(table, tokens, axis=0, mode="fill", fill_value=jnp.nan).astype(dtype)

    def attend(self, h: jax.Array) -> jax.Array:
        """h [..., H] @ embedding^T -> [..., V] in h.dtype."""
        return matmul(h, self.embedding[...].T, self.gmm_impl)


class DenseFFN(nnx.Module):
    """The dense SwiGLU FFN: down(silu(gate) * up) with [gate; up] = gate_up(x), the activation
    in fp32 rounded once (as the MoE's experts)."""

    def __init__(self, config: LMConfig, *, gmm_impl: str, rngs: nnx.Rngs, init, output_init):
        h, f = config.hidden_size, config.dense_ffn_hidden_size
        linear = functools.partial(
            Linear, param_dtype=jnp.dtype(config.param_dtype), gmm_impl=gmm_impl, rngs=rngs
        )
        self.gate_up = linear(h, 2 * f, axes=(EMBED, MLP), kernel_init=init)
        self.down = linear(f, h, axes=(MLP, EMBED), kernel_init=output_init)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(gated_activation(self.gate_up(x), "silu", True).astype(x.dtype))


class Block(nnx.Module):
    """One pre-norm transformer block: x + attention(input_norm(x)), then
    x + ffn(post_attention_norm(x)); `kind` "dense" (`DenseFFN`) or "moe" (`jaxmoe.MoE`)."""

    def __init__(self, config: LMConfig, kind: LayerKind, *, gmm_impl: str, rngs: nnx.Rngs):
        h, dtype = config.hidden_size, jnp.dtype(config.param_dtype)
        init = megatron_normal(config.init_std)
        output_init = megatron_normal(config.init_std / math.sqrt(2.0 * config.num_layers))
        kw = dict(gmm_impl=gmm_impl, rngs=rngs, init=init, output_init=output_init)
        self.kind = kind
        self.input_norm = RMSNorm(h, eps=config.norm_eps, param_dtype=dtype, axis_name=EMBED)
        self.attention = Attention(config, **kw)
        self.post_attention_norm = RMSNorm(
            h, eps=config.norm_eps, param_dtype=dtype, axis_name=EMBED
        )
        if kind == "dense":
            self.ffn = DenseFFN(config, **kw)
        else:
            self.ffn = MoE(
                config.moe,
                h,
                param_dtype=dtype,
                dtype=jnp.dtype(config.dtype),
                init_std=config.init_std,
                num_layers=config.num_layers,
                gmm_impl=gmm_impl,
                rngs=rngs,
            )

    def __call__(
        self,
        x: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        mask: jax.Array,
        *,
        padding_mask: jax.Array | None,
        route_for: Callable | None,
        expert_weights: Any,
        write=None,
    ) -> tuple[jax.Array, MoEAux | None, tuple[jax.Array, jax.Array]]:
        """(x [B, T, H], the MoE's aux (None for a dense block), the attended keys and values);
        the arguments as `Attention`'s and `MoE.forward_with_stages`'s."""
        attended, kv = self.attention(self.input_norm(x), rope, mask, write)
        x = x + attended
        h = self.post_attention_norm(x)
        if self.kind == "dense":
            return x + self.ffn(h), None, kv
        if route_for is None:
            y, aux = self.ffn(h, padding_mask=padding_mask, expert_weights=expert_weights)
        else:
            y, aux, _ = self.ffn.forward_with_stages(
                h, padding_mask=padding_mask, expert_weights=expert_weights, route_for=route_for
            )
        return x + y, aux, kv


class MoETransformer(nnx.Module):
    """The decoder-only MoE language model of `LMConfig` (module docstring for its layout).

    Args:
      config: the `LMConfig`.
      rngs: `nnx.Rngs`; "params" initialises the weights (Megatron's: normal(0, init_std),
        the output projections normal(0, init_std / sqrt(2 L)), norms at one), "jitter" drives
        the MoE's input jitter when configured.
      gmm_impl: the implementation of every matmul (the MoE's `gmm_impl`; the attention
        projections, dense FFNs and head run on `jaxmoe.ops.dense` with it).

    `model(tokens, segment_ids=, positions=)` -> (logits, `LMAux`); `hidden` and `head` are its
    two halves; `prefill` (that forward, keeping the keys and values) and `decode` generate
    with a KV cache (`jaxmoe.generate`).
    """

    def __init__(self, config: LMConfig, *, rngs: nnx.Rngs, gmm_impl: str = "auto"):
        if not isinstance(config, LMConfig):
            raise TypeError(
                f"MoETransformer: config must be an LMConfig, got {type(config).__name__}"
            )
        self.config = config
        self.dtype = jnp.dtype(config.dtype)
        init = megatron_normal(config.init_std)
        self.embed = Embedding(config, init=init, gmm_impl=gmm_impl, rngs=rngs)
        self.layers = nnx.List(
            [Block(config, kind, gmm_impl=gmm_impl, rngs=rngs) for kind in config.layer_kinds()]
        )
        self.final_norm = RMSNorm(
            config.hidden_size,
            eps=config.norm_eps,
            param_dtype=jnp.dtype(config.param_dtype),
            axis_name=EMBED,
        )
        self.lm_head = (
            None
            if config.tie_embeddings
            else Linear(
                config.hidden_size,
                config.vocab_size,
                axes=(EMBED, VOCAB),
                param_dtype=jnp.dtype(config.param_dtype),
                kernel_init=init,
                gmm_impl=gmm_impl,
                rngs=rngs,
            )
        )

    # ------------------------------------------------------------------ the MoE layers
    def moe_layers(self) -> list[nnx.Module]:
        """The MoE FFNs in layer order (`jaxmoe.MoE`, or what `with_moe_layers` put there)."""
        return [block.ffn for block in self.layers if block.kind == "moe"]

    def quantize_expert_weights(self) -> list:
        """Every MoE layer's `quantize_expert_weights()` in layer order (fp8 experts: make them
        once per optimizer step and pass them as `expert_weights=` to each micro-batch)."""
        return [moe.quantize_expert_weights() for moe in self.moe_layers()]

    def with_moe_layers(self, fn: Callable[[MoE], nnx.Module]) -> MoETransformer:
        """A copy of the model with each MoE layer replaced by fn(layer), e.g.
        `jaxmoe.mxfp8_inference` (anything called like `MoE`, and with `forward_with_stages`
        where `route_for` is passed); this model is left as it is."""
        model = nnx.clone(self)
        for block in model.layers:
            if block.kind == "moe":
                block.ffn = fn(block.ffn)
        return model

    # ------------------------------------------------------------------ forward
    def __call__(
        self,
        tokens: jax.Array,
        *,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        route_for: Callable | None = None,
        expert_weights: Sequence | None = None,
    ) -> tuple[jax.Array, LMAux]:
        """(logits [B, S, V] in the compute dtype, `LMAux`) for tokens [B, S] of ids in [0, V).

        segment_ids: [B, S] int (None: one segment a row): packed documents; a token attends
          only to the earlier-or-equal tokens of its own segment; id 0 marks padding (left out
          of the MoE losses and token counts).
        positions: [B, S] int in [0, max_position) for RoPE (None: 0, 1, ... in every row; pass
          positions restarting at 0 in each segment for packed documents).
        route_for: passed to every MoE layer's `forward_with_stages` (expert parallelism).
        expert_weights: one entry per MoE layer, its `quantize_expert_weights()` (None: each
          layer quantizes in the call).
        Bad inputs (not integers, shapes, ids or positions out of range, S > max_position)
        raise before anything is traced; ids and positions are checked when concrete."""
        h, aux = self.hidden(
            tokens,
            segment_ids=segment_ids,
            positions=positions,
            route_for=route_for,
            expert_weights=expert_weights,
        )
        return self.head(h), aux

    def hidden(
        self,
        tokens: jax.Array,
        *,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        route_for: Callable | None = None,
        expert_weights: Sequence | None = None,
    ) -> tuple[jax.Array, LMAux]:
        """(the final-normed hidden states [B, S, H] in the compute dtype, `LMAux`): `__call__`
        without the head (for a loss computed over chunks of the sequence)."""
        h, aux, _ = self._forward(tokens, segment_ids, positions, route_for, expert_weights)
        return h, aux

    def _forward(self, tokens, segment_ids, positions, route_for, expert_weights, keep_kv=False):
        """(h, `LMAux`, each layer's attended (keys, values) [B, S, K, D] with keep_kv, else
        None) of `hidden`'s arguments: the one forward of training, evaluation and prefill."""
        tokens, segment_ids, positions = self._checked_inputs(tokens, segment_ids, positions)
        per_layer = self._expert_weights_per_layer(expert_weights)
        b, s = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        padding_mask = None if segment_ids is None else segment_ids == 0
        # One segment a row: the plain causal mask, which cuDNN applies without a mask array.
        mask = None if segment_ids is None else segment_causal_mask(segment_ids)
        rope = rope_tables(positions, self.config.head_dim, self.config.rope_theta)

        def run(block, x, rope, mask, padding_mask, weights):
            y, aux, kv = block(
                x,
                rope,
                mask,
                padding_mask=padding_mask,
                route_for=route_for,
                expert_weights=weights,
            )
            # Only when asked: more outputs of a remat block would change the training program.
            return (y, aux, kv) if keep_kv else (y, aux, None)

        if self.config.remat != "none":
            run = nnx.remat(run, policy=_REMAT_POLICIES[self.config.remat])
        x, auxes, kvs = self.embed(tokens, self.dtype), [], []
        for block, weights in zip(self.layers, per_layer, strict=True):
            x, aux, kv = run(block, x, rope, mask, padding_mask, weights)
            kvs.append(kv)
            if aux is not None:
                auxes.append(aux)
        return self.final_norm(x), LMAux.stack(auxes), kvs if keep_kv else None

    def head(self, h: jax.Array) -> jax.Array:
        """The logits [..., V] of final-normed hidden states h [..., H], in h's dtype."""
        return self.embed.attend(h) if self.lm_head is None else self.lm_head(h)

    # ------------------------------------------------------------------ generation
    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        """An empty `KVCache` for `batch` rows of up to `max_len` (<= max_position) tokens, in
        `dtype` (None: the compute dtype)."""
        for name, value in (("batch", batch), ("max_len", max_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"init_cache: {name} must be a positive int, got {value!r}")
        if max_len > self.config.max_position:
            raise ValueError(
                f"init_cache: max_len ({max_len}) exceeds max_position ({self.config.max_position})"
            )
        c = self.config
        shape = (c.num_layers, batch, max_len, c.num_kv_heads, c.head_dim)
        zeros = jnp.zeros(shape, self.dtype if dtype is None else dtype)
        return KVCache(k=zeros, v=zeros, lengths=jnp.zeros((batch,), jnp.int32))

    def prefill(
        self,
        tokens: jax.Array,
        *,
        lengths: jax.Array | None = None,
        max_len: int | None = None,
        route_for: Callable | None = None,
        expert_weights: Sequence | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """(the final-normed hidden states [B, S, H], the `KVCache` of the prompts) for prompts
        tokens [B, S], each row's first lengths[b] tokens real and the rest padding (None: all
        S). This is `hidden`'s forward with segment_ids 1 on the real tokens and 0 on the
        padding, the training forward itself: `head` of the result gives `__call__`'s logits
        bits for those tokens and segment ids. The cache holds max_len (None: S; at most
        max_position) entries a row, the S tokens' keys and values first, and lengths; `decode`
        continues from it. route_for, expert_weights: as `__call__`'s."""
        tokens, _, _ = self._checked_inputs(tokens, None, None)
        b, s = tokens.shape
        max_len = s if max_len is None else max_len
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < s:
            raise ValueError(f"prefill: max_len must be an int >= S ({s}), got {max_len!r}")
        if max_len > self.config.max_position:
            raise ValueError(
                f"prefill: max_len ({max_len}) exceeds max_position ({self.config.max_position})"
            )
        if lengths is None:
            segment_ids, lengths = None, jnp.full((b,), s, jnp.int32)
        else:
            if getattr(lengths, "shape", None) != (b,):
                raise ValueError(f"prefill: lengths must be [{b}], got {lengths!r}")
            _check_concrete_range("lengths", lengths, 0, s + 1)
            lengths = jnp.asarray(lengths, jnp.int32)
            segment_ids = (jnp.arange(s) < lengths[:, None]).astype(jnp.int32)
        h, _, kvs = self._forward(tokens, segment_ids, None, route_for, expert_weights, True)
        empty = [(0, 0), (0, 0), (0, max_len - s), (0, 0), (0, 0)]
        k, v = (jnp.pad(jnp.stack(arrays), empty) for arrays in zip(*kvs))
        return h, KVCache(k=k, v=v, lengths=lengths)

    def decode(
        self,
        tokens: jax.Array,
        cache: KVCache,
        *,
        new_lengths: jax.Array | None = None,
        route_for: Callable | None = None,
        expert_weights: Sequence | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """(logits [B, T, V], the cache with them appended) for tokens [B, T] following each
        row's cached tokens: row b's tokens sit at positions cache.lengths[b] + arange(T) and
        see only its own valid cache entries and themselves, causally. The cache comes from
        `prefill` (the training forward's bits) or `init_cache` (empty: the prompts decoded
        like any tokens, in the attention's other summation order).

        new_lengths: [B] int, how many of each row's T tokens are real (rows of different
        prompt lengths in one batch, each prompt left-aligned, the rest padding: ignored by
        the MoE losses, and later calls overwrite their cache entries); None: all T. The row's
        length grows by it and must stay within max_len (checked when concrete; under a trace,
        entries past max_len are dropped). route_for, expert_weights: as `__call__`'s."""
        tokens, _, _ = self._checked_inputs(tokens, None, None)
        per_layer = self._expert_weights_per_layer(expert_weights)
        b, t = tokens.shape
        if cache.k.shape[:2] != (self.config.num_layers, b) or t > cache.max_len:
            raise ValueError(
                f"decode: tokens {tokens.shape} do not fit a cache of {cache.k.shape[1]} rows "
                f"of {cache.max_len} entries ({self.config.num_layers} layers; cache "
                f"{cache.k.shape})"
            )
        if new_lengths is None:
            count = jnp.full((b,), t, jnp.int32)
        else:
            if getattr(new_lengths, "shape", None) != (b,):
                raise ValueError(f"decode: new_lengths must be [{b}], got {new_lengths!r}")
            count = jnp.asarray(new_lengths, jnp.int32)
        _check_concrete_range("new_lengths", count, 0, t + 1)
        _check_concrete_range(
            "cache.lengths + new_lengths", cache.lengths + count, 0, cache.max_len + 1
        )
        padding_mask = None if new_lengths is None else jnp.arange(t) >= count[:, None]
        positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)
        rope = rope_tables(positions, self.config.head_dim, self.config.rope_theta)
        mask = cache_mask(cache.lengths, t, cache.max_len)
        writer = _CacheWriter(cache, positions)
        x = self.embed(tokens, self.dtype)
        for i, (block, weights) in enumerate(zip(self.layers, per_layer, strict=True)):
            x, _, _ = block(
                x,
                rope,
                mask,
                padding_mask=padding_mask,
                route_for=route_for,
                expert_weights=weights,
                write=functools.partial(writer.write, i),
            )
        logits = self.head(self.final_norm(x))
        return logits, KVCache(k=writer.k, v=writer.v, lengths=cache.lengths + count)

    # ------------------------------------------------------------------ checks
    def _checked_inputs(self, tokens, segment_ids, positions):
        """The inputs as int32 arrays, or a TypeError/ValueError naming the bad one."""
        c = self.config
        if not hasattr(tokens, "dtype") or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise TypeError(
                f"MoETransformer: tokens must be an integer array, got "
                f"{getattr(tokens, 'dtype', type(tokens).__name__)}"
            )
        if tokens.ndim != 2 or 0 in tokens.shape:
            raise ValueError(
                f"MoETransformer: tokens must be [B, S] (non-empty), got {tokens.shape}"
            )
        if tokens.shape[1] > c.max_position:
            raise ValueError(
                f"MoETransformer: sequence length {tokens.shape[1]} exceeds max_position "
                f"({c.max_position})"
            )
        checked = []
        for name, value, high in (
            ("tokens", tokens, c.vocab_size),
            ("segment_ids", segment_ids, None),
            ("positions", positions, c.max_position),
        ):
            if value is None:
                checked.append(None)
                continue
            if not hasattr(value, "dtype") or not jnp.issubdtype(value.dtype, jnp.integer):
                raise TypeError(f"MoETransformer: {name} must be an integer array")
            if value.shape != tokens.shape:
                raise ValueError(
                    f"MoETransformer: {name} must have the tokens' shape {tokens.shape}, got "
                    f"{value.shape}"
                )
            _check_concrete_range(name, value, 0, high)
            checked.append(jnp.asarray(value, jnp.int32))
        return tuple(checked)

    def _expert_weights_per_layer(self, expert_weights) -> list:
        """One entry per layer: the MoE layers' quantized expert weights (or None), None for
        the dense ones."""
        kinds = self.config.layer_kinds()
        num_moe = kinds.count("moe")
        if expert_weights is None:
            return [None] * len(kinds)
        if not isinstance(expert_weights, Sequence) or len(expert_weights) != num_moe:
            raise ValueError(
                f"MoETransformer: expert_weights must be a list of {num_moe} entries (one per "
                f"MoE layer), got {type(expert_weights).__name__}"
                + (f" of {len(expert_weights)}" if isinstance(expert_weights, Sequence) else "")
            )
        per_moe = iter(expert_weights)
        return [next(per_moe) if kind == "moe" else None for kind in kinds]


class _CacheWriter:
    """Writes each layer's new keys and values into the cache at the rows' positions (entries
    past max_len dropped) and keeps the updated arrays."""

    def __init__(self, cache: KVCache, positions: jax.Array):
        self.k, self.v = cache.k, cache.v
        self.rows = jnp.arange(positions.shape[0])[:, None]
        self.positions = positions

    def write(self, layer: int, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
        index = (layer, self.rows, self.positions)
        self.k = self.k.at[index].set(k.astype(self.k.dtype), mode="drop")
        self.v = self.v.at[index].set(v.astype(self.v.dtype), mode="drop")
        return self.k[layer], self.v[layer]


def _check_concrete_range(name: str, value, low: int, high: int | None) -> None:
    """ValueError unless low <= value (< high); values under a trace cannot be checked."""
    if isinstance(value, jax.core.Tracer):
        return
    array = np.asarray(value)
    bad = (array < low) if high is None else (array < low) | (array >= high)
    if np.any(bad):
        bound = f">= {low}" if high is None else f"in [{low}, {high})"
        raise ValueError(f"MoETransformer: {name} must be {bound}, got {array[bad].flat[0]}")


def count_parameters(config: LMConfig) -> ParameterCount:
    """The parameter counts of `MoETransformer(config)`, from the shapes alone
    (`nnx.eval_shape`: no weight is made).

    total: every `nnx.Param` (the aux-loss-free expert bias is not one); a tied embedding once.
    active: the parameters one token uses: every parameter except the routed experts', plus
    top_k of each MoE layer's E routed experts (shared experts, routers, attention, norms, the
    embedding and the output head all count). This is the convention of the published counts:
    Mixtral-8x7B 46.7B / 12.9B; Qwen3-30B-A3B 30.5B / 3.35B (published as 3.3B)."""
    model = nnx.eval_shape(lambda: MoETransformer(config, rngs=nnx.Rngs(0)))
    total = _num_params(model)
    routed = sum(_num_params(moe.experts) for moe in model.moe_layers())
    e, k = config.moe.num_experts, config.moe.top_k
    return ParameterCount(total=total, active=total - routed // e * (e - k))


def _num_params(module: nnx.Module) -> int:
    return sum(math.prod(p.shape) for p in jax.tree.leaves(nnx.state(module, nnx.Param)))
