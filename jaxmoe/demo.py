"""Train a small MoE block on synthetic data: `python -m jaxmoe.demo [--preset ...] [--steps N]`.

The block is `MoE(rmsnorm(x))`; it learns to imitate a fixed, randomly initialised teacher block
of the same shape (a learnable target), with optax Adam. Prints the relative loss
(mean squared error / mean squared target), the load-balancing loss, expert load balance and
tokens/s. Runs on the default JAX backend (the GPU when there is one).

`--precision`: "bf16" (fp32 params, bf16 compute), "fp32", "mxfp8" (fp32 params, bf16 compute,
MXFP8 expert GEMMs, dispatch and combine gradient, 32-row expert alignment) or "fp8_blockwise"
(the same in Transformer Engine's FP8 blockwise recipe, 128-row alignment; --hidden and the
preset's expert size multiples of 128). The teacher keeps bf16 experts, so every precision
learns the same target from the same initialisation.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxmoe import MoE, MoEConfig, update_expert_bias
from jaxmoe.config import PRECISION_PRESETS

PRESETS = {
    "mixtral": MoEConfig(
        num_experts=8,
        top_k=2,
        ffn_hidden_size=128,
        load_balancing_type="aux_loss",
        aux_loss_coeff=1e-2,
        z_loss_coeff=1e-3,
    ),
    "deepseek": MoEConfig(
        num_experts=16,
        top_k=4,
        ffn_hidden_size=64,
        score_function="sigmoid",
        enable_expert_bias=True,
        num_groups=4,
        group_topk=2,
        topk_scaling_factor=2.5,
        router_dtype="fp32",
        load_balancing_type="seq_aux_loss",
        aux_loss_coeff=1e-3,
        shared_expert_intermediate_size=96,
    ),
    "nemotron": MoEConfig(
        num_experts=8,
        top_k=2,
        ffn_hidden_size=192,
        activation="squared_relu",
        gated_linear_unit=False,
        pre_softmax=True,
        load_balancing_type="none",
    ),
}
# precision: (param dtype, compute dtype, MoEConfig changes for the trained block)
PRECISIONS = {
    "bf16": (jnp.float32, jnp.bfloat16, {}),
    "fp32": (jnp.float32, jnp.float32, {}),
    "mxfp8": (jnp.float32, jnp.bfloat16, PRECISION_PRESETS["mxfp8"]),
    "fp8_blockwise": (jnp.float32, jnp.bfloat16, PRECISION_PRESETS["fp8_blockwise"]),
}


class Block(nnx.Module):
    """Pre-norm MoE block: MoE(rmsnorm(x))."""

    def __init__(
        self, config: MoEConfig, hidden: int, *, param_dtype, dtype, init_std: float, rngs: nnx.Rngs
    ):
        self.norm = nnx.RMSNorm(hidden, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.moe = MoE(
            config, hidden, param_dtype=param_dtype, dtype=dtype, init_std=init_std, rngs=rngs
        )

    def __call__(self, x):
        return self.moe(self.norm(x))


def load_balance(tokens_per_expert: jax.Array) -> float:
    """max / mean tokens per expert (1.0 = perfectly balanced)."""
    counts = tokens_per_expert.astype(jnp.float32)
    return float(jnp.max(counts) / jnp.maximum(jnp.mean(counts), 1.0))


def _progress(step: int, total: int, text: str, width: int = 24) -> None:
    done = int(width * step / total)
    sys.stdout.write(f"\r[{'#' * done}{'.' * (width - done)}] {step:4d}/{total} {text}")
    sys.stdout.flush()


def train(
    preset: str = "mixtral",
    steps: int = 300,
    precision: str = "bf16",
    hidden: int = 128,
    batch: int = 16,
    seq_len: int = 64,
    learning_rate: float = 3e-3,
    seed: int = 0,
    log_every: int = 25,
    quiet: bool = False,
    row_alignment: int | None = None,
) -> dict:
    """Run the demo; returns the final metrics (also used by the tests). row_alignment: the
    trained block's expert_row_alignment (None: the precision's); it changes no value, only
    the padding, so it perturbs training at the level of the last bits."""
    config = PRESETS[preset]
    param_dtype, dtype, precision_options = PRECISIONS[precision]
    if row_alignment is not None:
        precision_options = dict(precision_options, expert_row_alignment=row_alignment)
    model = Block(
        config.replace(**precision_options),
        hidden,
        param_dtype=param_dtype,
        dtype=dtype,
        init_std=0.02,
        rngs=nnx.Rngs(seed),
    )
    teacher = Block(
        config,
        hidden,
        param_dtype=param_dtype,
        dtype=dtype,
        init_std=2.0 / hidden**0.5,
        rngs=nnx.Rngs(seed + 1000),
    )
    optimizer = nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, teacher, x):
        target = jax.lax.stop_gradient(teacher(x)[0])

        def loss_fn(model):
            y, aux = model(x)
            error = y.astype(jnp.float32) - target.astype(jnp.float32)
            mse = jnp.mean(jnp.square(error)) / jnp.mean(jnp.square(target.astype(jnp.float32)))
            return mse + aux.total_loss, (mse, aux)

        grads, (mse, aux) = nnx.grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        router = model.moe.router
        if router.expert_bias is not None:
            router.expert_bias[...] = update_expert_bias(
                router.expert_bias[...], aux.tokens_per_expert, config.bias_update_rate
            )
        return mse, aux

    key = jax.random.key(seed)
    tokens = batch * seq_len
    if not quiet:
        print(
            f"jaxmoe demo: preset={preset} precision={precision} steps={steps} "
            f"tokens/step={tokens} experts={config.num_experts} top_k={config.top_k} "
            f"backend={jax.default_backend()}"
        )
    start = compiled_at = time.perf_counter()
    metrics = {}
    for step in range(1, steps + 1):
        key, sub = jax.random.split(key)
        x = jax.random.normal(sub, (batch, seq_len, hidden), jnp.float32).astype(dtype)
        mse, aux = train_step(model, optimizer, teacher, x)
        if step == 1:
            jax.block_until_ready(mse)
            compiled_at = time.perf_counter()
        if step % log_every == 0 or step == steps:
            elapsed = max(time.perf_counter() - compiled_at, 1e-9)
            metrics = dict(
                step=step,
                loss=float(mse),
                aux_loss=float(aux.load_balancing_loss),
                z_loss=float(aux.z_loss),
                balance=load_balance(aux.tokens_per_expert),
                tokens_per_s=tokens * max(step - 1, 1) / elapsed,
            )
            if not quiet:
                _progress(
                    step,
                    steps,
                    "loss {loss:.4f}  aux {aux_loss:.5f}  balance(max/mean) "
                    "{balance:.2f}  {tokens_per_s:,.0f} tok/s".format(**metrics),
                )
                if step % (log_every * 4) == 0 or step == steps:
                    sys.stdout.write("\n")
    metrics["wall_s"] = time.perf_counter() - start
    if not quiet:
        print(f"done in {metrics['wall_s']:.1f}s (compile included)")
    return metrics


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="mixtral")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="bf16")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    train(
        args.preset,
        args.steps,
        args.precision,
        args.hidden,
        args.batch,
        args.seq_len,
        args.lr,
        args.seed,
    )


if __name__ == "__main__":
    main()
