"""The MoE layer's output and gradients, for tests that compare grouped-matmul implementations."""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmoe import MoE


def output_and_grads(config, x, dy, gmm_impl):
    """[y, d x, *d params] of sum(y * dy) + aux loss for a bf16 layer (seed 0) on `gmm_impl`."""
    model = MoE(config, x.shape[-1], param_dtype=jnp.bfloat16, gmm_impl=gmm_impl, rngs=nnx.Rngs(0))

    def loss(model, x):
        y, aux = model(x)
        return jnp.sum(y.astype(jnp.float32) * dy) + aux.total_loss, y

    (_, y), (g_model, g_x) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(model, x)
    return [y, g_x, *jax.tree.leaves(nnx.state(g_model))]
