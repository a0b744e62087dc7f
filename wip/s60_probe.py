"""Session 60 probe (not committed): the one-pass two-warpgroup SwiGLU backward-quantize kernel
against the two-kernel route, both with the products behind an optimization barrier, and main's
kernel against the unbarriered two-kernel route; bits and device time in turns."""

import json
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax
import jax.numpy as jnp

from benchmarks.timing import device_seconds
from jaxmoe.ops.pallas import activation_backward_hopper as abh
from jaxmoe.ops.pallas.activation_tiles import spread_rows
from jaxmoe.ops.pallas.quantize_transpose_hopper import quantize_1x128_with_transpose_pallas as q2
from jaxmoe.ops.pallas.swiglu_backward_quantize_hopper import (
    weighted_swiglu_backward_quantize_1x128_with_transpose_pallas as fused_new,
)
from jaxmoe.shapes import SHAPES
from wip.bwdq_main import weighted_swiglu_backward_quantize_1x128_with_transpose_pallas as fused_old

out = os.environ["OUT"]
res = {"device": str(jax.devices()[0].device_kind), "date": time.strftime("%Y-%m-%d"), "shapes": {}}


def bits(x):
    return jax.lax.bitcast_convert_type(
        x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    )


def backward(h, p, g, barrier):
    m, two_f = h.shape
    k = abh._kernel(m, two_f // 2, jnp.dtype(h.dtype), False, barrier, None)
    return k(h, g, spread_rows(p))


for name in os.environ.get("SHAPES", "mixtral,dsv3_ep8,qwen3_30b").split(","):
    c = SHAPES[name].config
    m, f = SHAPES[name].num_tokens * c.top_k, c.ffn_hidden_size
    k = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(k[0], (m, 2 * f), jnp.bfloat16)
    g = jax.random.normal(k[1], (m, f), jnp.bfloat16)
    p = jax.random.uniform(k[2], (m,), jnp.float32)

    def two(h, p, g, barrier):
        dh, parts = backward(h, p, g, barrier)
        return q2(dh), parts

    fns = {
        "two_kernels_barrier": jax.jit(lambda h, p, g: two(h, p, g, True)),
        "two_kernels_plain": jax.jit(lambda h, p, g: two(h, p, g, False)),
        "one_pass_two_wgs": jax.jit(lambda h, p, g: fused_new(h, p, g)),
        "main_kernel": jax.jit(lambda h, p, g: fused_old(h, p, g)),
        "backward_barrier": jax.jit(lambda h, p, g: backward(h, p, g, True)),
        "backward_plain": jax.jit(lambda h, p, g: backward(h, p, g, False)),
    }
    outs = {v: jax.block_until_ready(fn(h, p, g)) for v, fn in fns.items()}
    rec = {"rows": m, "ffn": f, "compare": {}}

    def cmp(label, a, b, outs=outs):
        (ca, pa), (cb, pb) = outs[a], outs[b]
        copies = [
            int(jnp.sum(bits(x) != bits(y)))
            for x, y in zip(jax.tree.leaves(ca), jax.tree.leaves(cb))
        ]

        def full(parts):
            if parts.shape[1] == f // 4:
                pr = parts.reshape(m, f // 256, 2, 32)
                return (pr[:, :, 0] + pr[:, :, 1]).reshape(m, -1)
            return parts

        partials = int(jnp.sum(bits(full(pa)) != bits(full(pb))))
        rec["compare"][label] = {
            "copies_differing": copies,
            "partials_differing": partials,
            "partials": int(full(pa).size),
        }

    cmp("one_pass_two_wgs vs two_kernels_barrier", "one_pass_two_wgs", "two_kernels_barrier")
    cmp("main_kernel vs two_kernels_plain", "main_kernel", "two_kernels_plain")
    cmp("one_pass_two_wgs vs two_kernels_plain", "one_pass_two_wgs", "two_kernels_plain")
    cmp("two_kernels_barrier vs two_kernels_plain", "two_kernels_barrier", "two_kernels_plain")
    dh_b, dh_p = outs["backward_barrier"][0], outs["backward_plain"][0]
    rec["compare"]["backward d_h barrier vs plain"] = int(jnp.sum(bits(dh_b) != bits(dh_p)))
    del outs, cmp
    rec["us"] = {v: [] for v in fns}
    for _ in range(int(os.environ.get("TURNS", "4"))):
        for v, fn in fns.items():
            rec["us"][v].append(device_seconds(lambda: fn(h, p, g), iters=10) * 1e6)
    print(name, json.dumps(rec), flush=True)
    res["shapes"][name] = rec
    json.dump(res, open(f"{out}/activation_s60_probe.json", "w"), indent=1)
