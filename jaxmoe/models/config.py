"""`LMConfig`: the decoder-only MoE language model's options, validated once, and the named
configurations `CONFIGS`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

import jax.numpy as jnp

from jaxmoe.config import MoEConfig
from jaxmoe.shapes import SHAPES

# The byte-level vocabulary: ids 0..255 are the byte values, then three specials (padding,
# beginning and end of a document; `jaxmoe.data` names them).
BYTE_VOCAB_SIZE = 259

RematPolicy = Literal["none", "full", "dots_saveable"]
AttentionImpl = Literal["auto", "xla", "cudnn"]

_REMAT_POLICIES = ("none", "full", "dots_saveable")
_ATTENTION_IMPLS = ("auto", "xla", "cudnn")
LayerKind = Literal["dense", "moe"]


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Configuration of `jaxmoe.models.MoETransformer`, a pre-norm decoder-only transformer
    whose FFNs are `jaxmoe.MoE` layers (some optionally dense SwiGLU).

    Shape:
      vocab_size: V, the token ids' range [0, V).
      hidden_size: H, the residual stream's width.
      num_layers: L, the number of blocks.
      num_heads, num_kv_heads, head_dim: grouped-query attention with num_heads query heads
        sharing num_kv_heads key/value heads (num_heads a multiple of it), each head_dim wide
        (even: RoPE rotates pairs).
      max_position: the longest sequence (and KV cache) the model accepts; positions lie in
        [0, max_position).
    Attention:
      rope_theta: RoPE's base (HF's rotate-half convention).
      qk_norm: RMSNorm over head_dim on q and k before RoPE (Qwen3).
      attention_impl: `jax.nn.dot_product_attention`'s implementation: "auto" (its default,
        None: `jaxmoe.models.attention_impl_used` says what that runs on this backend), "xla"
        or "cudnn" (a GPU, bf16/fp16 compute).
    FFNs:
      moe: the `MoEConfig` of every MoE layer.
      first_k_dense: the first k layers have a dense SwiGLU FFN (DeepSeek's
        first_k_dense_replace).
      moe_layer_freq: after those, layer i is MoE when (i - first_k_dense) % moe_layer_freq == 0
        and dense otherwise: with first_k_dense = 0 Megatron's `moe_layer_freq` (an int), and
        the first layer after the dense ones is always MoE.
      dense_ffn_hidden_size: the dense FFN's size; required when any layer is dense (unused
        otherwise).
    Other:
      norm_eps: RMSNorm's epsilon.
      tie_embeddings: the output head is the token embedding transposed.
      remat: per-block rematerialisation (`nnx.remat`): "none", "full" (keep only the block's
        inputs) or "dots_saveable" (keep the matmuls' outputs, `jax.checkpoint_policies`).
      param_dtype, dtype: the parameters' and the computation's dtype, given as names
        ("float32", "bfloat16", "float16"; any `jnp.dtype` argument is stored as its name).
      init_std: Megatron's init_method_std: weights from normal(0, init_std), the output
        projections (attention out, FFN down, fc2) from normal(0, init_std / sqrt(2 L)).
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    moe: MoEConfig
    rope_theta: float = 10000.0
    qk_norm: bool = False
    norm_eps: float = 1e-6
    first_k_dense: int = 0
    dense_ffn_hidden_size: int | None = None
    moe_layer_freq: int = 1
    tie_embeddings: bool = False
    remat: RematPolicy = "none"
    param_dtype: str = "float32"
    dtype: str = "bfloat16"
    init_std: float = 0.02
    attention_impl: AttentionImpl = "auto"

    def __post_init__(self):
        def fail(field: str, why: str):
            raise ValueError(f"LMConfig.{field}: {why} (got {getattr(self, field)!r})")

        def positive_int(field: str):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                fail(field, "must be a positive int")

        def positive_float(field: str):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                fail(field, "must be a number > 0")

        def boolean(field: str):
            if not isinstance(getattr(self, field), bool):
                fail(field, "must be a bool")

        for field in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position",
            "moe_layer_freq",
        ):
            positive_int(field)
        for field in ("rope_theta", "norm_eps", "init_std"):
            positive_float(field)
        for field in ("qk_norm", "tie_embeddings"):
            boolean(field)
        if not isinstance(self.moe, MoEConfig):
            fail("moe", "must be a MoEConfig")
        if self.num_heads % self.num_kv_heads:
            fail("num_heads", f"must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            fail("head_dim", "must be even (RoPE rotates pairs of features)")
        first = self.first_k_dense
        if (
            isinstance(first, bool)
            or not isinstance(first, int)
            or not 0 <= first < self.num_layers
        ):
            fail("first_k_dense", f"must be an int in [0, num_layers) ({self.num_layers})")
        if self.dense_ffn_hidden_size is not None:
            positive_int("dense_ffn_hidden_size")
        elif "dense" in self.layer_kinds():
            fail("dense_ffn_hidden_size", f"is required: layers {self.layer_kinds()} have dense")
        if self.remat not in _REMAT_POLICIES:
            fail("remat", f"must be one of {_REMAT_POLICIES}")
        if self.attention_impl not in _ATTENTION_IMPLS:
            fail("attention_impl", f"must be one of {_ATTENTION_IMPLS}")
        for field in ("param_dtype", "dtype"):
            try:
                dtype = jnp.dtype(getattr(self, field))
            except TypeError:
                fail(field, "must name a floating dtype")
            if not jnp.issubdtype(dtype, jnp.floating):
                fail(field, "must name a floating dtype")
            object.__setattr__(self, field, dtype.name)  # one spelling, JSON-able

    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """The FFN of each layer, "dense" or "moe" (see first_k_dense and moe_layer_freq)."""
        return tuple(
            "moe"
            if i >= self.first_k_dense and (i - self.first_k_dense) % self.moe_layer_freq == 0
            else "dense"
            for i in range(self.num_layers)
        )

    def replace(self, **changes) -> LMConfig:
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def with_overrides(self, overrides: Mapping[str, Any]) -> LMConfig:
        """A copy with dotted keys applied: top-level fields ("num_layers") and the MoE
        config's ("moe.top_k"). An unknown key is a ValueError naming it."""
        top, moe = {}, {}
        moe_fields = {f.name for f in dataclasses.fields(MoEConfig)}
        top_fields = {f.name for f in dataclasses.fields(LMConfig)}
        for key, value in overrides.items():
            parts = key.split(".")
            if len(parts) == 1 and key in top_fields:
                top[key] = value
            elif len(parts) == 2 and parts[0] == "moe" and parts[1] in moe_fields:
                moe[parts[1]] = value
            else:
                raise ValueError(f"LMConfig.with_overrides: unknown key {key!r}")
        if moe:
            top["moe"] = top.get("moe", self.moe).replace(**moe)
        return self.replace(**top)

    def to_dict(self) -> dict[str, Any]:
        """The config as JSON-able values (the MoE config as a nested dict)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> LMConfig:
        """The config `to_dict` wrote; unknown keys are a ValueError naming them."""
        values = dict(values)
        moe = values.get("moe")
        if not isinstance(moe, Mapping):
            raise ValueError(
                f"LMConfig.from_dict: 'moe' must be the MoE config's dict, got {moe!r}"
            )
        for kind, given in ((cls, values), (MoEConfig, moe)):
            unknown = set(given) - {f.name for f in dataclasses.fields(kind)}
            if unknown:
                raise ValueError(f"{kind.__name__}.from_dict: unknown keys {sorted(unknown)}")
        return cls(**{**values, "moe": MoEConfig(**moe)})


# The byte-level models train on the CPU in minutes (`jaxmoe.train`); the others are published
# models' shapes (their parameter counts are tested) and the GPU benchmark's model.
_TINY_MOE = MoEConfig(num_experts=8, top_k=2, ffn_hidden_size=256, aux_loss_coeff=1e-2)

CONFIGS: dict[str, LMConfig] = {
    "qwen3_30b_a3b": LMConfig(
        vocab_size=151936,
        hidden_size=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        max_position=40960,
        rope_theta=1e6,
        qk_norm=True,
        moe=SHAPES["qwen3_30b"].config,  # norm_topk_prob: the softmax over the top-k logits
    ),
    "mixtral_8x7b": LMConfig(
        vocab_size=32000,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position=32768,
        rope_theta=1e6,
        norm_eps=1e-5,
        moe=SHAPES["mixtral"].config,
    ),
    "qwen3_moe_2b": LMConfig(
        vocab_size=151936,
        hidden_size=1024,
        num_layers=12,
        num_heads=16,
        num_kv_heads=4,
        head_dim=64,
        max_position=4096,
        rope_theta=1e6,
        qk_norm=True,
        moe=SHAPES["qwen3_30b"].config.replace(ffn_hidden_size=384),
    ),
    "tiny": LMConfig(
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_position=512,
        first_k_dense=1,
        dense_ffn_hidden_size=512,
        tie_embeddings=True,
        moe=_TINY_MOE.replace(shared_expert_intermediate_size=128, z_loss_coeff=1e-3),
    ),
    "tiny_mixtral": LMConfig(
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_position=512,
        rope_theta=1e6,
        norm_eps=1e-5,
        moe=_TINY_MOE,
    ),
}
