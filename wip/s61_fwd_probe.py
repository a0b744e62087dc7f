"""Session 61 probe (not committed): the two-warpgroup SwiGLU copies kernel (copies_pipeline)
against main's kernel (two CTAs an SM, whole-tile slots) and XLA's forward then the two-copy
kernel; bits and device time in turns."""

import json
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax
import jax.numpy as jnp

from benchmarks.timing import device_seconds
from jaxmoe.ops.activation import weighted_activation_forward
from jaxmoe.ops.pallas.quantize_transpose_hopper import quantize_1x128_with_transpose_pallas as q2
from jaxmoe.ops.pallas.swiglu_quantize_hopper import (
    weighted_swiglu_quantize_1x128_with_transpose_pallas as new,
)
from jaxmoe.shapes import SHAPES
from wip.qt_main import weighted_swiglu_quantize_1x128_with_transpose_pallas as old

out = os.environ["OUT"]
res = {"device": str(jax.devices()[0].device_kind), "date": time.strftime("%Y-%m-%d"), "shapes": {}}


def bits(x):
    return jax.lax.bitcast_convert_type(
        x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    )


for name in os.environ.get("SHAPES", "mixtral,dsv3_ep8,qwen3_30b").split(","):
    c = SHAPES[name].config
    m, f = SHAPES[name].num_tokens * c.top_k, c.ffn_hidden_size
    k = jax.random.split(jax.random.key(0), 2)
    h = jax.random.normal(k[0], (m, 2 * f), jnp.bfloat16)
    p = jax.random.uniform(k[1], (m,), jnp.float32)
    fns = {
        "two_passes": jax.jit(
            lambda h, p: q2(weighted_activation_forward(h, p, "silu", True, impl="xla"))
        ),
        "main_kernel": jax.jit(lambda h, p: old(h, p)),
        "two_wgs": jax.jit(lambda h, p: new(h, p)),
        "two_wgs_s2": jax.jit(lambda h, p: new(h, p, slots=2)),
        "copy_h": jax.jit(lambda h, p: h * 2),
    }
    outs = {v: jax.block_until_ready(fn(h, p)) for v, fn in fns.items()}
    rec = {"rows": m, "ffn": f, "differing": {}}
    for v in ("main_kernel", "two_wgs", "two_wgs_s2"):
        rec["differing"][v] = [
            int(jnp.sum(bits(x) != bits(y)))
            for x, y in zip(jax.tree.leaves(outs[v]), jax.tree.leaves(outs["two_passes"]))
        ]
    del outs
    rec["us"] = {v: [] for v in fns}
    for _ in range(int(os.environ.get("TURNS", "4"))):
        for v, fn in fns.items():
            rec["us"][v].append(device_seconds(lambda: fn(h, p), iters=10) * 1e6)
    print(name, json.dumps(rec), flush=True)
    res["shapes"][name] = rec
    json.dump(res, open(f"{out}/activation_s61_fwd_probe.json", "w"), indent=1)
