"""GEMM recipes of the routed experts: how fc1, fc2 and the combine run for one
`MoEConfig.expert_precision` ("bf16", "mxfp8", "fp8_blockwise"). The expert MLP
(`jaxmoe.experts.grouped_mlp`) asks `recipe_for(config)` and never branches on precision; a new
recipe joins by subclassing `ExpertRecipe` and registering in RECIPES.

A recipe decides the GEMM arithmetic only: the rounding points around it (fc1 output, the
weighted activation, fc2 output, the combine) are the expert MLP's and the same for every
recipe (docs/numerics.md, "Experts and rounding points"). A recipe may make fc2's quantized
copies of the activation from fc1's output directly (`activation_copies`: FP8-blockwise SwiGLU
experts, in one kernel pass that never writes the activation), with the bits of quantizing
the activation, and run fc1 and the activation as one VJP whose backward makes fc1's copies of
d h as the activation's backward computes it (`fc1_and_activation`: the same experts, d h never
written), with the bits of quantizing d h.

The token-level options ("mxfp8" or "fp8_blockwise", `jaxmoe.wire`) work with every recipe
(docs/numerics.md, "MXFP8" and "FP8 blockwise"):
  * dispatch_dtype: the tokens were quantized along H before the dispatch (`rows_quantized`),
    and the rows are its dequantized values (`jaxmoe.dispatch.dequantized_rows`: only the
    quantized copy travels). Experts of the copy's format use it as fc1's fprop operand as it
    is (MXFP8 experts an MXFP8 copy, FP8-blockwise experts a 1x128 one) and quantize the rows
    along the tokens for fc1's weight gradient (a copy derived from the wire format, as
    Transformer Engine's MXFP8 all-to-all does); other experts take the rows as their input.
  * combine_bwd_dtype: the gradient of y is quantized along H at token level, before it is
    dispatched back to the rows, and only that copy is dispatched. Experts of the copy's format
    use it as fc2's dgrad operand as it is (so fc2 and the combine share one custom VJP,
    `_fc2_and_combine`): MXFP8 experts quantize its dequantized rows columnwise for fc2's
    weight gradient, FP8-blockwise experts requantize that copy from its fp8 bytes (the same
    bits); the other experts take the dequantized rows as their output gradient
    (FP8-blockwise experts quantize an MXFP8 copy's rows again in 1x128 blocks along H).
Quantizers are the identity for the gradient (straight-through), as in Transformer Engine.
"""

from __future__ import annotations

import abc
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values

from jaxmoe.config import MoEConfig
from jaxmoe.fp8_blockwise import BlockwiseTensor
from jaxmoe.mxfp8 import MXTensor
from jaxmoe.ops import fp8_blockwise_gmm, gmm
from jaxmoe.ops.activation import (
    not_swiglu,
    weighted_activation_backward,
    weighted_activation_backward_quantize_1x128_with_transpose,
    weighted_activation_forward,
    weighted_activation_quantize_1x128_with_transpose,
)
from jaxmoe.ops.fp8_blockwise_gmm import (
    BlockwiseWeights,
    fp8_blockwise_gmm_backward,
    fp8_blockwise_gmm_forward,
    quantize_blockwise_weights,
)
from jaxmoe.ops.mxfp8_gmm import (
    Mxfp8Weights,
    mxfp8_gmm,
    mxfp8_gmm_backward,
    mxfp8_gmm_forward,
    quantize_mxfp8_weights,
)
from jaxmoe.wire import QuantizedRows, quantize_tokens

F32 = jnp.float32


@struct.dataclass
class ExpertWeightsMx:
    """The MXFP8 copies of the experts' fc1 and fc2 weights (`Mxfp8Recipe.quantize_weights`)."""

    fc1: Mxfp8Weights
    fc2: Mxfp8Weights


@struct.dataclass
class ExpertWeightsBlockwise:
    """The FP8-blockwise copies of the experts' fc1 and fc2 weights
    (`Fp8BlockwiseRecipe.quantize_weights`)."""

    fc1: BlockwiseWeights
    fc2: BlockwiseWeights


ExpertWeights = ExpertWeightsMx | ExpertWeightsBlockwise  # a recipe's quantized weight copies


class ExpertRecipe(abc.ABC):
    """How the routed experts' GEMMs run. Subclasses implement `fc1` and `fc2_and_combine`, and
    `quantize_weights` when they have weight copies to share."""

    name: str

    @abc.abstractmethod
    def fc1(
        self,
        rows: jax.Array,
        kernel: jax.Array,
        route: Any,
        *,
        rows_quantized: QuantizedRows | None,
        weights,
        out_dtype,
        impl: str,
    ) -> jax.Array:
        """fc1's fp32-accumulated product rows @ kernel[expert], in out_dtype, over the route's
        groups (`route.group_sizes`, `route.groups_per_weight` groups per expert). kernel may be
        wider than rows (fp32 copies under expert parallelism): the products round it to rows'
        dtype, its gradient keeps its dtype. rows_quantized: the dispatched quantized copy of
        rows (dispatch_dtype not "bf16", `jaxmoe.wire`) or None; weights: this recipe's
        `quantize_weights` made earlier in the step, or None."""

    @abc.abstractmethod
    def fc2_and_combine(
        self,
        a: jax.Array,
        kernel: jax.Array,
        row_bias: jax.Array | None,
        route: Any,
        *,
        weights,
        combine_bwd_dtype: str,
        impl: str,
        a_quantized: Any = None,
    ) -> tuple[jax.Array, jax.Array]:
        """(out [M, H], route.to_tokens(out) [T, H]): fc2 of the activation a rounded to
        a.dtype, plus row_bias (fp32, or None) before that rounding, then the combine
        (`jaxmoe.dispatch.LocalRoute` says what a route provides). a_quantized: this recipe's
        `activation_copies` of a, or None."""

    def fc1_and_activation(
        self,
        rows: jax.Array,
        kernel: jax.Array,
        probs: jax.Array,
        route: Any,
        *,
        rows_quantized: QuantizedRows | None,
        weights,
        config: MoEConfig,
        impl: str,
        activation_impl: str,
    ) -> tuple[jax.Array, jax.Array] | None:
        """(h, a): fc1 in rows' dtype (no bias) and the weighted activation
        a = round(act(h) * probs) (probs [M] fp32; `jaxmoe.ops.weighted_activation_forward`
        with activation_impl), with the bits of `fc1` then the expert MLP's activation, as one
        VJP whose backward hands fc1's backward its quantized copies of d h made by the
        activation's backward (FP8-blockwise SwiGLU experts: d h is then never in memory); or
        None: the expert MLP runs the two itself."""
        return None

    def activation_copies(
        self, h: jax.Array, probs: jax.Array, config: MoEConfig, live_rows, impl: str
    ) -> Any:
        """fc2's quantized copies of the weighted activation a = round(act(h) * probs), made
        from h by a kernel that never writes a (passed to `fc2_and_combine` as a_quantized), or
        None: fc2 quantizes a itself."""
        return None

    def quantize_weights(self, fc1_kernel: jax.Array, fc2_kernel: jax.Array, impl: str):
        """Copies of the expert weights to share between the micro-batches of a step."""
        raise ValueError(
            f"quantize_expert_weights: the experts run in {self.name}, which has "
            "no quantized weight copies"
        )


def add_row_bias(out: jax.Array, row_bias: jax.Array | None) -> jax.Array:
    """round(f32 out + row_bias), or out without a bias."""
    return out if row_bias is None else (out.astype(F32) + row_bias).astype(out.dtype)


class Bf16Recipe(ExpertRecipe):
    """The GEMMs in the compute dtype with fp32 accumulation (`jaxmoe.ops.gmm`)."""

    name = "bf16"

    def check_copies(self, weights) -> None:
        """Raise unless `weights` (expert_weights=) are None or this recipe's copies."""
        if weights is not None:
            raise ValueError(
                f"grouped_mlp: expert_weights are quantized copies; the experts run in {self.name}"
            )

    def gemm(self, lhs, kernel, route, out_dtype, impl, copies=None, lhs_quantized=None):
        """lhs [M, K] @ kernel[expert] over the route's groups, fp32 accumulation, in out_dtype
        (copies: this recipe's quantized copies of kernel, or None; lhs_quantized: the
        dispatched quantized copy of lhs, `jaxmoe.wire`, or None: a recipe of its format
        multiplies it as it is, the bf16 recipe never reads it). A route with a live row count
        leaves the rows past its groups unwritten (`jaxmoe.ops.live_rows`)."""
        return gmm(
            lhs,
            kernel,
            route.group_sizes,
            impl=impl,
            preferred_element_type=out_dtype,
            groups_per_weight=route.groups_per_weight,
            write_rows_past_groups=route.live_rows is None,
        )

    def fc1(self, rows, kernel, route, *, rows_quantized, weights, out_dtype, impl):
        self.check_copies(weights)
        copies = None if weights is None else weights.fc1
        return self.gemm(rows, kernel, route, out_dtype, impl, copies, rows_quantized)

    def fc2_and_combine(
        self, a, kernel, row_bias, route, *, weights, combine_bwd_dtype, impl, a_quantized=None
    ):
        self.check_copies(weights)
        copies = None if weights is None else weights.fc2
        with jax.named_scope("fc2"):
            out = add_row_bias(self.gemm(a, kernel, route, a.dtype, impl, copies), row_bias)
        with jax.named_scope("combine"):
            if combine_bwd_dtype != "bf16":
                combined = _combine_with_quantized_gradient(out, route, combine_bwd_dtype, impl)
            else:
                combined = route.to_tokens(out)
        return out, combined


class Mxfp8Recipe(ExpertRecipe):
    """Transformer Engine's MXFP8 recipe for every GEMM, forward and backward
    (`jaxmoe.ops.mxfp8_gmm`), on the compute-dtype copy of the weights; fc2 quantizes the
    activation after its single rounding, as TE does. Columnwise (wgrad) copies come from the
    compute-dtype rows (with dispatch_dtype "mxfp8", the dequantized wire rows)."""

    name = "mxfp8"

    def fc1(self, rows, kernel, route, *, rows_quantized, weights, out_dtype, impl):
        return mxfp8_gmm(
            rows,
            kernel,
            route.group_sizes,
            lhs_rowwise=rows_quantized if isinstance(rows_quantized, MXTensor) else None,
            # The dispatched rows are the copy's values (`jaxmoe.dispatch.dequantized_rows`).
            lhs_is_dequantized=isinstance(rows_quantized, MXTensor),
            impl=impl,
            rhs_quantized=None if weights is None else weights.fc1,
            preferred_element_type=out_dtype,
            groups_per_weight=route.groups_per_weight,
        )

    def fc2_and_combine(
        self, a, kernel, row_bias, route, *, weights, combine_bwd_dtype, impl, a_quantized=None
    ):
        fc2_weights = None if weights is None else weights.fc2
        if kernel is None:  # inference on the stored fprop copy alone
            return _fc2_then_combine(a, None, row_bias, route, fc2_weights, None, impl, self)
        return _fc2_and_combine(
            a, kernel, row_bias, route, fc2_weights, None, combine_bwd_dtype, impl, self
        )

    def fc2_forward(self, a, kernel, route, fc2_weights, impl, a_quantized=None):
        """(fc2's output rows in a.dtype, residuals for `fc2_backward`) (`_fc2_and_combine`);
        a_quantized: `activation_copies` (None for this recipe)."""
        if kernel is None:
            out = mxfp8_gmm(
                a,
                None,
                route.group_sizes,
                impl=impl,
                rhs_quantized=fc2_weights,
                preferred_element_type=a.dtype,
                groups_per_weight=route.groups_per_weight,
            )
            return out, None
        return mxfp8_gmm_forward(
            a, kernel, route.group_sizes, None, a.dtype, impl, fc2_weights, route.groups_per_weight
        )

    def fc2_backward(self, residuals, d_rows, grad_quantized):
        """(d a, d kernel) of fc2 for the row gradient d_rows; grad_quantized: the combine
        gradient's wire copy (its dequantized values are d_rows), or None."""
        grad_rowwise = grad_quantized if isinstance(grad_quantized, MXTensor) else None
        return mxfp8_gmm_backward(residuals, d_rows, grad_rowwise)

    def quantize_weights(self, fc1_kernel, fc2_kernel, impl):
        return ExpertWeightsMx(
            fc1=quantize_mxfp8_weights(fc1_kernel, impl),
            fc2=quantize_mxfp8_weights(fc2_kernel, impl),
        )


class Fp8BlockwiseRecipe(Bf16Recipe):
    """Transformer Engine's FP8 blockwise recipe (`Float8BlockScaling`: 1x128 activations and
    gradients, 128x128 weights) for fc1 and fc2, forward and backward
    (`jaxmoe.ops.fp8_blockwise_gmm`); the rest as the bf16 recipe. fc1 takes dispatched 1x128
    tokens (dispatch_dtype "fp8_blockwise") as they are, and its wgrad copy is requantized from
    their fp8 bytes (the rows' dequantized values are then never computed); with dispatch_dtype
    "mxfp8" the rows are the dequantized wire rows, quantized again in 1x128 blocks."""

    name = "fp8_blockwise"

    def check_copies(self, weights) -> None:
        """ValueError unless `weights` is None or this recipe's weight copies."""
        if weights is not None and not isinstance(weights, ExpertWeightsBlockwise):
            raise ValueError(
                "grouped_mlp: expert_weights must be this layer's quantize_expert_weights() "
                "(fp8_blockwise copies)"
            )

    def fc2_and_combine(
        self, a, kernel, row_bias, route, *, weights, combine_bwd_dtype, impl, a_quantized=None
    ):
        self.check_copies(weights)
        fc2_weights = None if weights is None else weights.fc2
        return _fc2_and_combine(
            a, kernel, row_bias, route, fc2_weights, a_quantized, combine_bwd_dtype, impl, self
        )

    def fc1_and_activation(
        self, rows, kernel, probs, route, *, rows_quantized, weights, config, impl, activation_impl
    ):
        """SwiGLU experts: fc1 and the activation in one VJP whose backward makes d h's two
        1x128 copies in one pass over h and the activation's gradient
        (`ops.weighted_activation_backward_quantize_1x128_with_transpose`, the bits fc1's own
        quantize of d h gives) and hands them to fc1's backward. Other activations: None."""
        if not_swiglu(config.activation, config.gated_linear_unit):
            return None
        self.check_copies(weights)
        return _fc1_and_swiglu(
            rows,
            kernel,
            probs,
            route,
            None if weights is None else weights.fc1,
            rows_quantized if isinstance(rows_quantized, BlockwiseTensor) else None,
            impl,
            activation_impl,
        )

    def activation_copies(self, h, probs, config, live_rows, impl):
        """fc2's two 1x128 copies of a (its fprop and wgrad operands) for SwiGLU experts, from
        h in one pass (`ops.weighted_activation_quantize_1x128_with_transpose`, the bits fc2's
        own quantize of a gives): the forward then never computes a. Other activations: None
        (a would be computed twice)."""
        if probs is None or not_swiglu(config.activation, config.gated_linear_unit):
            return None
        return weighted_activation_quantize_1x128_with_transpose(
            h,
            probs,
            config.activation,
            config.gated_linear_unit,
            live_rows=live_rows,
            impl=impl,
        )

    def fc2_forward(self, a, kernel, route, fc2_weights, impl, a_quantized=None):
        """As `Mxfp8Recipe.fc2_forward`, in FP8 blockwise; a_quantized: `activation_copies`
        (rowwise, transposed) or None (a quantized here)."""
        rowwise, transposed = (None, None) if a_quantized is None else a_quantized
        return fp8_blockwise_gmm_forward(
            a,
            kernel,
            route.group_sizes,
            lhs_quantized=rowwise,
            lhs_t_quantized=transposed,
            rhs_quantized=fc2_weights,
            out_dtype=a.dtype,
            impl=impl,
            groups_per_weight=route.groups_per_weight,
            write_rows_past_groups=route.live_rows is None,
        )

    def fc2_backward(self, residuals, d_rows, grad_quantized):
        """As `Mxfp8Recipe.fc2_backward`: a 1x128 wire copy is fc2's dgrad operand as it is and
        its fp8 bytes give the weight gradient's copy (`fp8_blockwise_gmm_backward`)."""
        wire = grad_quantized if isinstance(grad_quantized, BlockwiseTensor) else None
        return fp8_blockwise_gmm_backward(residuals, d_rows, wire)

    def quantize_weights(self, fc1_kernel, fc2_kernel, impl):
        return ExpertWeightsBlockwise(
            fc1=quantize_blockwise_weights(fc1_kernel, impl=impl),
            fc2=quantize_blockwise_weights(fc2_kernel, impl=impl),
        )

    def gemm(self, lhs, kernel, route, out_dtype, impl, copies=None, lhs_quantized=None):
        """lhs rows @ kernel[expert] over the route's groups in FP8 blockwise
        (`fp8_blockwise_gmm`): copies, the kernel's 128x128 copies made earlier in the step (or
        None); lhs_quantized, the rows' 1x128 wire copy when they came quantized."""
        return fp8_blockwise_gmm(
            lhs,
            kernel,
            route.group_sizes,
            lhs_quantized=lhs_quantized if isinstance(lhs_quantized, BlockwiseTensor) else None,
            lhs_is_dequantized=isinstance(lhs_quantized, BlockwiseTensor),  # the wire rows
            rhs_quantized=copies,
            impl=impl,
            preferred_element_type=out_dtype,
            groups_per_weight=route.groups_per_weight,
            write_rows_past_groups=route.live_rows is None,
        )


RECIPES: dict[str, ExpertRecipe] = {
    recipe.name: recipe for recipe in (Bf16Recipe(), Mxfp8Recipe(), Fp8BlockwiseRecipe())
}


def recipe_for(config: MoEConfig) -> ExpertRecipe:
    """The recipe of `config.expert_precision`."""
    return RECIPES[config.expert_precision]


def _gradient_rows(
    route, grad: jax.Array, wire_dtype: str, impl: str
) -> tuple[QuantizedRows, jax.Array]:
    """combine_bwd_dtype "mxfp8" / "fp8_blockwise": the token-level output gradient quantized
    along H once and sent to the expert rows quantized alone; (that copy, its dequantized rows
    in grad.dtype). The rows are what every other use of the gradient reads (fc2's weight-
    gradient copy and bias gradient; the whole backward pass of experts of another format)."""
    return route.to_experts_with_values(quantize_tokens(grad, wire_dtype, impl), grad.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _combine_with_quantized_gradient(out, route, wire_dtype, impl):
    """route.to_tokens(out), whose gradient reaches the rows quantized in wire_dtype (experts
    that are not MXFP8)."""
    return route.to_tokens(out)


def _combine_with_quantized_gradient_fwd(out, route, wire_dtype, impl):
    return route.to_tokens(out), route


def _combine_with_quantized_gradient_bwd(wire_dtype, impl, route, grad):
    return _gradient_rows(route, grad, wire_dtype, impl)[1], None


_combine_with_quantized_gradient.defvjp(
    _combine_with_quantized_gradient_fwd, _combine_with_quantized_gradient_bwd
)


@struct.dataclass
class _Fc2CombineResiduals:
    gemm: Any  # the recipe's fc2 residuals
    route: Any
    has_bias: bool = struct.field(pytree_node=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _fc2_and_combine(
    a, fc2_kernel, row_bias, route, fc2_weights, a_quantized, combine_bwd_dtype, gmm_impl, recipe
):
    """(out, route.to_tokens(out)) with out = the recipe's fc2 of the activation a (+ the
    per-row bias; `recipe.fc2_forward`; a_quantized: the recipe's `activation_copies` of a,
    or None).

    One custom VJP for both, so that the backward can quantize the token-level gradient before
    dispatching it and hand that copy to fc2's backward (`recipe.fc2_backward`), which uses it
    as it is where it is of the recipe's own format (combine_bwd_dtype "mxfp8" for MXFP8
    experts, "fp8_blockwise" for FP8-blockwise ones) and takes the dequantized rows otherwise."""
    return _fc2_then_combine(
        a, fc2_kernel, row_bias, route, fc2_weights, a_quantized, gmm_impl, recipe
    )


def _fc2_then_combine(a, fc2_kernel, row_bias, route, fc2_weights, a_quantized, gmm_impl, recipe):
    """`_fc2_and_combine` without its VJP (also MXFP8 inference on the stored fprop copy)."""
    with jax.named_scope("fc2"):
        out, _ = recipe.fc2_forward(a, fc2_kernel, route, fc2_weights, gmm_impl, a_quantized)
        out = add_row_bias(out, row_bias)
    with jax.named_scope("combine"):
        return out, route.to_tokens(out)


def _fc2_and_combine_fwd(
    a, fc2_kernel, row_bias, route, fc2_weights, a_quantized, combine_bwd_dtype, gmm_impl, recipe
):
    a, fc2_kernel, row_bias, route, fc2_weights, a_quantized = custom_vjp_primal_tree_values(
        (a, fc2_kernel, row_bias, route, fc2_weights, a_quantized)
    )
    with jax.named_scope("fc2"):
        out, gemm_residuals = recipe.fc2_forward(
            a, fc2_kernel, route, fc2_weights, gmm_impl, a_quantized
        )
        out = add_row_bias(out, row_bias)
    residuals = _Fc2CombineResiduals(
        gemm=gemm_residuals, route=route, has_bias=row_bias is not None
    )
    with jax.named_scope("combine"):
        combined = route.to_tokens(out)
    return (out, combined), residuals


def _fc2_and_combine_bwd(combine_bwd_dtype, gmm_impl, recipe, residuals, cotangents):
    d_out, d_combined = cotangents
    route = residuals.route
    if isinstance(d_combined, SymbolicZero):  # only the fc2_output stage is used
        d_combined = jnp.zeros(d_combined.shape, d_combined.dtype)
    with jax.named_scope("combine"):
        grad_quantized = None
        if not isinstance(d_out, SymbolicZero):
            # The fc2_output stage itself is differentiated: the dispatched token gradient is no
            # longer the whole row gradient, so the sum is quantized on the compute side.
            d_rows = route.to_experts(d_combined) + d_out
        elif combine_bwd_dtype != "bf16":
            grad_quantized, d_rows = _gradient_rows(route, d_combined, combine_bwd_dtype, gmm_impl)
        else:
            d_rows = route.to_experts(d_combined)
    with jax.named_scope("fc2"):
        d_a, d_kernel = recipe.fc2_backward(residuals.gemm, d_rows, grad_quantized)
    d_row_bias = d_rows.astype(F32) if residuals.has_bias else None
    return d_a, d_kernel, d_row_bias, None, None, None


_fc2_and_combine.defvjp(_fc2_and_combine_fwd, _fc2_and_combine_bwd, symbolic_zeros=True)


@struct.dataclass
class _Fc1ActivationResiduals:
    gemm: Any  # fc1's `Fp8BlockwiseGmmResiduals`
    h: jax.Array
    probs: jax.Array
    live_rows: Any


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _fc1_and_swiglu(rows, kernel, probs, route, fc1_weights, rows_quantized, gmm_impl, act_impl):
    """(h, a) of FP8-blockwise fc1 (`Fp8BlockwiseRecipe.gemm`'s bits) and the weighted SwiGLU
    (`Fp8BlockwiseRecipe.fc1_and_activation`)."""
    return _fc1_then_swiglu(
        rows, kernel, probs, route, fc1_weights, rows_quantized, gmm_impl, act_impl
    )[0]


def _fc1_and_swiglu_fwd(
    rows, kernel, probs, route, fc1_weights, rows_quantized, gmm_impl, act_impl
):
    primals = custom_vjp_primal_tree_values(
        (rows, kernel, probs, route, fc1_weights, rows_quantized)
    )
    return _fc1_then_swiglu(*primals, gmm_impl, act_impl)


def _fc1_then_swiglu(rows, kernel, probs, route, fc1_weights, rows_quantized, gmm_impl, act_impl):
    """((h, a), the backward's residuals)."""
    with jax.named_scope("fc1"):
        h, gemm_residuals = fp8_blockwise_gmm_forward(
            rows,
            kernel,
            route.group_sizes,
            lhs_quantized=rows_quantized,
            lhs_is_dequantized=rows_quantized is not None,  # the dispatched wire rows
            rhs_quantized=fc1_weights,
            out_dtype=rows.dtype,
            impl=gmm_impl,
            groups_per_weight=route.groups_per_weight,
            write_rows_past_groups=route.live_rows is None,
        )
    with jax.named_scope("activation"):
        a = weighted_activation_forward(
            h, probs, "silu", True, live_rows=route.live_rows, impl=act_impl
        )
    residuals = _Fc1ActivationResiduals(gemm_residuals, h, probs, route.live_rows)
    return (h, a), residuals


def _fc1_and_swiglu_bwd(gmm_impl, act_impl, residuals, cotangents):
    d_h_direct, d_a = cotangents
    h, probs, live_rows = residuals.h, residuals.probs, residuals.live_rows
    if isinstance(d_a, SymbolicZero):  # only the fc1_output stage is used
        d_a = jnp.zeros(d_a.shape, d_a.dtype)
    with jax.named_scope("activation"):
        if isinstance(d_h_direct, SymbolicZero):
            d_h_rowwise, d_h_t, d_probs = (
                weighted_activation_backward_quantize_1x128_with_transpose(
                    h, probs, d_a, "silu", True, live_rows=live_rows, impl=act_impl
                )
            )
            d_h = None
        else:
            # The fc1_output stage itself is differentiated: fc1's gradient is the sum.
            d_h, d_probs = weighted_activation_backward(
                h, probs, d_a, "silu", True, live_rows=live_rows, impl=act_impl
            )
            d_h, d_h_rowwise, d_h_t = d_h + d_h_direct, None, None
    with jax.named_scope("fc1"):
        d_rows, d_kernel = fp8_blockwise_gmm_backward(residuals.gemm, d_h, d_h_rowwise, d_h_t)
    return d_rows, d_kernel, d_probs, None, None, None


_fc1_and_swiglu.defvjp(_fc1_and_swiglu_fwd, _fc1_and_swiglu_bwd, symbolic_zeros=True)
