"""`MoEConfig`: every option of the MoE layer, validated once.

Field names follow Megatron-Core's `TransformerConfig` without the `moe_` / `moe_router_` prefixes
(see `MoEConfig.from_megatron` for the mapping). Semantics are those of megatron-core 0.19.2
(docs/numerics.md), with the fused-kernel numerics where Megatron has two paths.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any, Literal

ScoreFunction = Literal["softmax", "sigmoid", "sqrtsoftplus"]
LoadBalancingType = Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"]
Activation = Literal["silu", "gelu", "squared_relu"]
Precision = Literal["bf16", "mxfp8", "fp8_blockwise"]

_SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
_LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
_ACTIVATIONS = ("silu", "gelu", "squared_relu")
_PRECISIONS = ("bf16", "mxfp8", "fp8_blockwise")
MXFP8_ALIGNMENTS = (32, 128, 256)


# The precision recipes as option sets of `MoEConfig` (`MoEConfig.with_precision`): the routed
# experts' GEMMs, the dispatched rows and the combine's gradient in one recipe, with the expert
# row alignment that recipe's blocks need.
PRECISION_PRESETS: dict[str, dict[str, Any]] = {
    "bf16": {},
    "mxfp8": dict(
        expert_precision="mxfp8",
        dispatch_dtype="mxfp8",
        combine_bwd_dtype="mxfp8",
        expert_row_alignment=32,
    ),
    "fp8_blockwise": dict(
        expert_precision="fp8_blockwise",
        dispatch_dtype="fp8_blockwise",
        combine_bwd_dtype="fp8_blockwise",
        expert_row_alignment=128,
    ),
}


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Configuration of a Megatron-style MoE layer.

    Routing:
      num_experts: number of routed experts E.
      top_k: experts per token k.
      score_function: "softmax", "sigmoid" or "sqrtsoftplus".
      pre_softmax: softmax over all E before top-k (softmax only); otherwise top-k runs on the raw
        logits and the softmax is over the k selected values.
      topk_scaling_factor: multiply the final probabilities by this.
      num_groups, group_topk: group-limited routing (experts split into `num_groups` contiguous
        groups; only the best `group_topk` groups are eligible).
      enable_expert_bias, bias_update_rate: aux-loss-free balancing; the fp32 bias changes expert
        selection only (sigmoid/sqrtsoftplus).
      router_dtype: "param" (logits rounded to the layer's compute dtype, Megatron's default) or
        "fp32".
      load_balancing_type, aux_loss_coeff: "aux_loss", "seq_aux_loss", "global_aux_loss" or "none".
      z_loss_coeff: z-loss coefficient (None: off).
      input_jitter_eps: multiplicative U(1-eps, 1+eps) jitter on the router input (also at eval,
        as in Megatron).
      capacity_factor, token_drop_policy, pad_expert_input_to_capacity: token dropping. Each
        expert keeps at most `capacity(T)` tokens: with policy "probs" those with the largest
        probability, with "position" the earliest routed ones. Token order (for "position" and
        for ties of "probs") is Megatron's, sequence-major: for x [..., S, H], earlier sequence
        position first, and at the same position the lower batch index (leading axes flattened)
        first, i.e. the order of Megatron's [S, B] input; for x [T, H], the given order. Feed
        Megatron's [S, B, H] batch as x.transpose(1, 0, 2) and the same tokens are kept.
        pad_expert_input_to_capacity pads every expert's block with zero rows to `capacity(T)`
        (rounded up to expert_row_alignment); Megatron pads with real tokens at probability 0,
        which gives the same outputs and gradients.
    Experts:
      ffn_hidden_size: F, the per-expert FFN size.
      activation, gated_linear_unit: "silu" + GLU = SwiGLU; "squared_relu"; "gelu"; each with or
        without GLU. fc1's output is [gate; up] along the feature axis.
      add_bias_linear: router, fc1 and fc2 biases.
      shared_expert_intermediate_size, shared_expert_gate: shared expert of size Fs (None: none),
        optionally scaled by sigmoid(x @ gate).
    Precision and layout:
      expert_row_alignment: each expert's row block is padded with zero rows to a multiple of this
        (1: no padding; 32/128/256 for MXFP8).
      expert_precision: "bf16", "mxfp8" or "fp8_blockwise" expert GEMMs (the last: Transformer
        Engine's Float8BlockScaling, `jaxmoe.ops.fp8_blockwise_gmm`; expert_row_alignment a
        multiple of 128).
      dispatch_dtype: wire/compute dtype of the dispatched tokens: "bf16", "mxfp8" (32-wide
        blocks along H) or "fp8_blockwise" (1x128 blocks along H), independent of the experts'
        precision (`jaxmoe.wire`).
      combine_bwd_dtype: dtype of the gradient dispatched back through the combine, the same
        three choices.
    """

    num_experts: int
    ffn_hidden_size: int
    top_k: int = 2
    score_function: ScoreFunction = "softmax"
    pre_softmax: bool = False
    topk_scaling_factor: float | None = None
    num_groups: int | None = None
    group_topk: int | None = None
    enable_expert_bias: bool = False
    bias_update_rate: float = 1e-3
    router_dtype: Literal["param", "fp32"] = "param"
    load_balancing_type: LoadBalancingType = "aux_loss"
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float | None = None
    input_jitter_eps: float | None = None
    capacity_factor: float | None = None
    token_drop_policy: Literal["probs", "position"] = "probs"
    pad_expert_input_to_capacity: bool = False
    activation: Activation = "silu"
    gated_linear_unit: bool = True
    add_bias_linear: bool = False
    shared_expert_intermediate_size: int | None = None
    shared_expert_gate: bool = False
    expert_row_alignment: int = 1
    expert_precision: Precision = "bf16"
    dispatch_dtype: Precision = "bf16"
    combine_bwd_dtype: Precision = "bf16"

    def __post_init__(self):
        def fail(field: str, why: str):
            raise ValueError(f"MoEConfig.{field}: {why} (got {getattr(self, field)!r})")

        def positive_int(field: str):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                fail(field, "must be a positive int")

        def choice(field: str, allowed):
            if getattr(self, field) not in allowed:
                fail(field, f"must be one of {allowed}")

        positive_int("num_experts")
        positive_int("ffn_hidden_size")
        positive_int("top_k")
        positive_int("expert_row_alignment")
        choice("score_function", _SCORE_FUNCTIONS)
        choice("router_dtype", ("param", "fp32"))
        choice("load_balancing_type", _LOAD_BALANCING)
        choice("token_drop_policy", ("probs", "position"))
        choice("activation", _ACTIVATIONS)
        choice("expert_precision", _PRECISIONS)
        choice("dispatch_dtype", _PRECISIONS)
        choice("combine_bwd_dtype", _PRECISIONS)

        if self.top_k > self.num_experts:
            fail("top_k", f"must be <= num_experts ({self.num_experts})")
        if self.pre_softmax and self.score_function != "softmax":
            fail("pre_softmax", "only applies to score_function='softmax'")
        if self.score_function == "softmax" and self.top_k == 1 and not self.pre_softmax:
            fail(
                "pre_softmax",
                "top-1 softmax routing needs pre_softmax=True "
                "(a softmax over one selected logit is always 1)",
            )
        if self.topk_scaling_factor is not None and not self.topk_scaling_factor > 0:
            fail("topk_scaling_factor", "must be > 0 or None")
        if (self.num_groups is None) != (self.group_topk is None):
            fail("num_groups", "num_groups and group_topk must be set together")
        if self.num_groups is not None:
            positive_int("num_groups")
            positive_int("group_topk")
            if self.num_experts % self.num_groups:
                fail("num_groups", f"num_experts ({self.num_experts}) must be divisible by it")
            if self.group_topk > self.num_groups:
                fail("group_topk", f"must be <= num_groups ({self.num_groups})")
            if self.top_k // self.group_topk > self.num_experts // self.num_groups:
                fail("group_topk", "top_k // group_topk exceeds the experts per group")
            if self.top_k > self.group_topk * (self.num_experts // self.num_groups):
                fail("top_k", "exceeds the experts available in group_topk groups")
        if self.enable_expert_bias and self.score_function == "softmax":
            fail("enable_expert_bias", "needs score_function 'sigmoid' or 'sqrtsoftplus'")
        if not self.bias_update_rate >= 0:
            fail("bias_update_rate", "must be >= 0")
        if not self.aux_loss_coeff >= 0:
            fail("aux_loss_coeff", "must be >= 0")
        if self.z_loss_coeff is not None and not self.z_loss_coeff >= 0:
            fail("z_loss_coeff", "must be >= 0 or None")
        if self.input_jitter_eps is not None and not 0 < self.input_jitter_eps < 1:
            fail("input_jitter_eps", "must be in (0, 1) or None")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            fail("capacity_factor", "must be > 0 or None")
        if self.pad_expert_input_to_capacity and self.capacity_factor is None:
            fail("pad_expert_input_to_capacity", "needs capacity_factor")
        if self.shared_expert_intermediate_size is not None:
            positive_int("shared_expert_intermediate_size")
            if self.add_bias_linear:
                fail("add_bias_linear", "shared experts have no bias (Megatron forbids it)")
        elif self.shared_expert_gate:
            fail("shared_expert_gate", "needs shared_expert_intermediate_size")
        if self.uses_mxfp8 and self.expert_row_alignment not in MXFP8_ALIGNMENTS:
            fail("expert_row_alignment", f"MXFP8 paths need one of {MXFP8_ALIGNMENTS}")
        if self.expert_precision == "fp8_blockwise" and self.expert_row_alignment % 128:
            fail(
                "expert_row_alignment",
                "fp8_blockwise experts need a multiple of 128 (their weight gradient's 1x128 "
                "blocks along the rows must not mix experts)",
            )

    # ------------------------------------------------------------------ derived quantities
    @property
    def uses_mxfp8(self) -> bool:
        """Whether any option (experts, dispatch, combine gradient) runs in MXFP8."""
        return "mxfp8" in (self.expert_precision, self.dispatch_dtype, self.combine_bwd_dtype)

    @property
    def fc1_output_size(self) -> int:
        """Width of fc1's output: 2F for GLU ([gate; up]), F otherwise."""
        return 2 * self.ffn_hidden_size if self.gated_linear_unit else self.ffn_hidden_size

    def capacity(self, num_tokens: int) -> int | None:
        """Per-expert capacity for `num_tokens` local tokens (Megatron's `get_capacity`), or None."""
        if self.capacity_factor is None:
            return None
        return math.ceil((num_tokens * self.top_k / self.num_experts) * self.capacity_factor)

    def replace(self, **changes) -> MoEConfig:
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def with_precision(self, precision: str) -> MoEConfig:
        """A copy in one of `PRECISION_PRESETS`: "bf16" (unchanged), "mxfp8" (experts, dispatch
        and combine gradient in MXFP8, 32-row expert alignment) or "fp8_blockwise" (the same in
        FP8 blockwise, 128-row alignment)."""
        if precision not in PRECISION_PRESETS:
            raise ValueError(
                f"precision must be one of {tuple(PRECISION_PRESETS)}, got {precision!r}"
            )
        options = PRECISION_PRESETS[precision]
        return self.replace(**options) if options else self

    # ------------------------------------------------------------------ Megatron interop
    @classmethod
    def from_megatron(cls, args: Mapping[str, Any], **overrides) -> MoEConfig:
        """Build a config from Megatron-Core names (a `TransformerConfig.__dict__`, saved `args`,
        or a checkpoint's config.json).

        Megatron options that jaxmoe does not implement raise ValueError when they are set to a
        non-default value, so nothing is silently ignored. `overrides` use jaxmoe names.
        """
        args = dict(args)
        unsupported = {
            "moe_apply_probs_on_input": False,
            "moe_latent_size": None,
            "moe_mlp_glu_interleave_size": None,
            "moe_router_force_load_balancing": False,
            "moe_router_force_biased": None,
            "moe_enable_routing_replay": False,
            "moe_router_topk_limited_devices": None,
            "moe_router_quantile_balancing_ema": 0.0,
        }
        for key, default in unsupported.items():
            if args.get(key, default) not in (default, None, False, 0, 0.0):
                raise ValueError(f"from_megatron: {key}={args[key]!r} is not supported by jaxmoe")
        if args.get("activation_func_clamp_value") is not None:
            raise ValueError("from_megatron: activation_func_clamp_value is not supported")
        if args.get("glu_linear_offset", 0.0) not in (0, 0.0, None):
            raise ValueError("from_megatron: glu_linear_offset != 0 is not supported")

        num_experts = args.get("num_moe_experts")
        if num_experts is None:
            raise ValueError("from_megatron: num_moe_experts is missing (not an MoE config)")
        ffn = args.get("moe_ffn_hidden_size") or args.get("ffn_hidden_size")
        if ffn is None:
            raise ValueError("from_megatron: neither moe_ffn_hidden_size nor ffn_hidden_size given")

        router_dtype = args.get("moe_router_dtype")
        if router_dtype in (None, "None"):
            router_dtype = "param"
        elif router_dtype != "fp32":
            raise ValueError(
                f"from_megatron: moe_router_dtype={router_dtype!r} is not supported "
                "(jaxmoe supports the param dtype and fp32)"
            )

        balancing = args.get("moe_router_load_balancing_type", "aux_loss")
        coeff = args.get("moe_aux_loss_coeff", 0.0)
        if isinstance(balancing, (list, tuple)):
            if len(balancing) != 1:
                raise ValueError(
                    f"from_megatron: several load-balancing types {balancing} are not supported"
                )
            balancing = balancing[0]
            coeff = coeff[0] if isinstance(coeff, (list, tuple)) else coeff
        if balancing in ("sinkhorn", "quantile_balancing"):
            raise ValueError(f"from_megatron: load balancing {balancing!r} is not supported")

        expert_precision = "bf16"
        alignment = 1
        if args.get("fp8") and args.get("fp8_recipe") == "mxfp8":
            expert_precision, alignment = "mxfp8", 32
        elif args.get("fp8") == "e4m3" and args.get("fp8_recipe") == "blockwise":
            expert_precision, alignment = "fp8_blockwise", 128
        elif args.get("fp8"):
            raise ValueError(
                f"from_megatron: fp8 recipe {args.get('fp8_recipe')!r} with format "
                f"{args.get('fp8')!r} is not supported (mxfp8, or blockwise with e4m3)"
            )

        fields = dict(
            num_experts=int(num_experts),
            ffn_hidden_size=int(ffn),
            top_k=int(args.get("moe_router_topk", 2)),
            score_function=args.get("moe_router_score_function", "softmax"),
            pre_softmax=bool(args.get("moe_router_pre_softmax", False)),
            topk_scaling_factor=args.get("moe_router_topk_scaling_factor"),
            num_groups=args.get("moe_router_num_groups"),
            group_topk=args.get("moe_router_group_topk"),
            enable_expert_bias=bool(args.get("moe_router_enable_expert_bias", False)),
            bias_update_rate=float(args.get("moe_router_bias_update_rate", 1e-3)),
            router_dtype=router_dtype,
            load_balancing_type=balancing,
            aux_loss_coeff=float(coeff or 0.0),
            z_loss_coeff=args.get("moe_z_loss_coeff"),
            input_jitter_eps=args.get("moe_input_jitter_eps"),
            capacity_factor=args.get("moe_expert_capacity_factor"),
            token_drop_policy=args.get("moe_token_drop_policy", "probs"),
            pad_expert_input_to_capacity=bool(args.get("moe_pad_expert_input_to_capacity", False)),
            activation=_megatron_activation(args),
            gated_linear_unit=bool(args.get("gated_linear_unit", False)),
            add_bias_linear=bool(args.get("add_bias_linear", True)),
            shared_expert_intermediate_size=args.get("moe_shared_expert_intermediate_size"),
            shared_expert_gate=bool(args.get("moe_shared_expert_gate", False)),
            expert_row_alignment=alignment,
            expert_precision=expert_precision,
            dispatch_dtype=args.get("moe_dispatch_fwd_dtype", "bf16"),
            combine_bwd_dtype=args.get("moe_combine_bwd_dtype", "bf16"),
        )
        fields.update(overrides)
        return cls(**fields)


def selective_precision(
    config: MoEConfig,
    num_layers: int,
    *,
    first_bf16: int = 0,
    last_bf16: int = 0,
    bf16_layers: Iterable[int] = (),
) -> tuple[MoEConfig, ...]:
    """One config per layer: `config` (the MXFP8 layers' config) everywhere except the chosen
    layers, which run fully in bf16 (Megatron's selective precision: `first_last_layers_bf16`
    with `num_layers_at_start_in_bf16` / `num_layers_at_end_in_bf16`, or per-module recipes).

    The bf16 layers are the first `first_bf16`, the last `last_bf16` and those listed (0-based)
    in `bf16_layers`; they get expert_precision, dispatch_dtype and combine_bwd_dtype "bf16" and
    keep every other field (the row alignment never changes real rows' bits).
    Example: `selective_precision(cfg, 24, first_bf16=2, last_bf16=4)`."""
    if not config.uses_mxfp8:
        raise ValueError(
            "selective_precision: config has no MXFP8 option; it describes the MXFP8 layers"
        )
    for name, value, low in (
        ("num_layers", num_layers, 1),
        ("first_bf16", first_bf16, 0),
        ("last_bf16", last_bf16, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"selective_precision: {name} must be an int >= {low}, got {value!r}")
    if first_bf16 + last_bf16 > num_layers:
        raise ValueError(
            f"selective_precision: first_bf16 + last_bf16 ({first_bf16} + "
            f"{last_bf16}) exceeds num_layers ({num_layers})"
        )
    chosen = set(range(first_bf16)) | set(range(num_layers - last_bf16, num_layers))
    for layer in bf16_layers:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
            raise ValueError(
                f"selective_precision: bf16_layers entries must be layer indices "
                f"in [0, {num_layers}), got {layer!r}"
            )
        chosen.add(layer)
    bf16 = config.replace(expert_precision="bf16", dispatch_dtype="bf16", combine_bwd_dtype="bf16")
    return tuple(bf16 if layer in chosen else config for layer in range(num_layers))


def _megatron_activation(args: Mapping[str, Any]) -> str:
    """Megatron's activation: an explicit name, or the repr of `activation_func`."""
    name = args.get("activation")
    if name is None:
        func = str(args.get("activation_func", "gelu"))
        match = re.search(r"function (\w+)", func)
        name = match.group(1) if match else func
    aliases = {"silu": "silu", "swiglu": "silu", "gelu": "gelu", "squared_relu": "squared_relu"}
    if name not in aliases:
        raise ValueError(
            f"from_megatron: activation {name!r} is not supported "
            f"(supported: {sorted(set(aliases))})"
        )
    return aliases[name]
