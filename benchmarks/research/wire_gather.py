"""The dispatch of an MXFP8 wire copy, as its readers consume it, on one GPU: the copy's rows
gathered into the expert buffer and dequantized to bf16 (what fc1 and the experts' rows read),
either with the data rows on the dispatch kernel and XLA's dequantization after it
(`kernel`), or with XLA's gather, which XLA fuses into the dequantization (`xla`, the route
under expert parallelism, where the copy itself moves). On one device the copy need not exist:
`one_pass` makes the same rows from the tokens in one kernel (`dispatch_fake_quantize`, the
layer's route there since 2026-12-04 evening), to be compared with the token quantize
(`quantize`, timed alone) plus either route. All give the same bits.

    python -m benchmarks.research.wire_gather [--shapes dsv3_ep8,qwen3_30b]
        [--tokens 64,256,1024,4096] [--iters 20] [--tag TAG] [--out DIR]

Tokens routed to top-k distinct experts (a fixed draw); device time per call from a JAX
profile (host time off the GPU, for the CPU smoke test), median of three turns. Writes
wire_gather_<date>[_tag].json.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import (
    add_output_arguments,
    environment,
    log,
    result_path,
    write_result,
)
from benchmarks.timing import device_seconds, time_it
from jaxmoe import mxfp8
from jaxmoe.ops.permute import dispatch_rows
from jaxmoe.ops.quantize import dispatch_fake_quantize, quantize
from jaxmoe.shapes import SHAPES, TINY_SHAPES

BF16 = jnp.bfloat16
ROUTES = ("kernel", "xla")  # from the token copy
FROM_TOKENS = ("quantize", "one_pass")  # from the tokens: the copy alone; the rows in one pass


def gathered_rows(copy: mxfp8.MXTensor, row_token: jax.Array, route: str) -> jax.Array:
    """The dispatched copy's rows in bf16: its data rows on the dispatch kernel ("kernel")
    or XLA's gather ("xla"); the scale rows on XLA's gather either way."""
    data_impl = "pallas" if route == "kernel" else "xla"
    moved = mxfp8.MXTensor(
        data=dispatch_rows(copy.data, row_token, impl=data_impl),
        scale=dispatch_rows(copy.scale, row_token, impl="xla"),
        axis=copy.axis,
        fmt=copy.fmt,
    )
    return mxfp8.dequantize(moved, BF16)


def operands(shape_name: str, tokens: int):
    """(x [T, H], row_token [T * k]): each token's k experts distinct, rows in expert order
    (the plan's layout without padding)."""
    shape = (SHAPES | TINY_SHAPES)[shape_name]
    config = shape.config
    rng = np.random.default_rng(tokens)
    experts = np.stack([rng.permutation(config.num_experts)[: config.top_k] for _ in range(tokens)])
    row_token = np.argsort(experts.ravel(), kind="stable") // config.top_k
    x = jax.random.normal(jax.random.key(tokens), (tokens, shape.hidden_size), BF16)
    return x, jnp.asarray(row_token, jnp.int32)


def main(argv=None) -> dict:
    """Parse the command line (`argv`: None for sys.argv), time every route at every shape and
    token count, writing the JSON after each; returns the result (with `path`)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="dsv3_ep8,qwen3_30b")
    parser.add_argument("--tokens", default="64,256,1024,4096")
    parser.add_argument("--iters", type=int, default=20)
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    path = result_path(args.out, "wire_gather", args.tag)
    result = environment("wire_gather", command=" ".join(sys.argv), records=[])
    on_gpu = jax.devices()[0].platform == "gpu"
    calls = {
        route: jax.jit(lambda c, r, route=route: gathered_rows(c, r, route)) for route in ROUTES
    }
    from_tokens = {
        "quantize": jax.jit(lambda x, r: quantize(x, axis=1, impl="auto")),
        "one_pass": jax.jit(lambda x, r: dispatch_fake_quantize(x, r, impl="auto")),
    }
    bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16)
    for shape_name in args.shapes.split(","):
        for tokens in map(int, args.tokens.split(",")):
            x, row_token = operands(shape_name, tokens)
            copy = from_tokens["quantize"](x, row_token)
            outs = {route: call(copy, row_token) for route, call in calls.items()}
            outs["one_pass"] = from_tokens["one_pass"](x, row_token)
            same_bits = all(
                bool(jnp.array_equal(bits(outs[route]), bits(outs["xla"])))
                for route in ("kernel", "one_pass")
            )
            args_of = {
                **{r: (copy, row_token) for r in ROUTES},
                **{r: (x, row_token) for r in FROM_TOKENS},
            }
            times = {route: [] for route in args_of}
            for _ in range(3):
                for route, call in {**calls, **from_tokens}.items():
                    run = lambda call=call, a=args_of[route]: call(*a)
                    seconds = (device_seconds if on_gpu else time_it)(run, iters=args.iters)
                    times[route].append(seconds * 1e6)
            record = dict(
                shape=shape_name,
                tokens=tokens,
                fp8_row_bytes=int(row_token.shape[0]) * copy.shape[1],
                same_bits=same_bits,
                **{f"{route}_us": statistics.median(times[route]) for route in times},
            )
            result["records"].append(record)
            log(
                f"{shape_name} T={tokens:5d} {record['fp8_row_bytes'] / 2**20:8.1f} MiB of rows: "
                f"kernel {record['kernel_us']:8.2f} us, xla {record['xla_us']:8.2f} us "
                f"(+ quantize {record['quantize_us']:8.2f}), one pass "
                f"{record['one_pass_us']:8.2f} us, same_bits={same_bits}"
            )
            write_result(result, path)
    return dict(result, path=path)


if __name__ == "__main__":
    main()
