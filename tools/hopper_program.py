"""The program XLA builds for an H200 from jaxmoe's layer, compiled on a machine without a GPU:
the kernels it launches, in order (XLA's fusions, sorts and scatters, and the Pallas kernels,
which appear as custom calls), and its HLO. For counting and naming kernels between GPU runs;
times still come from the GPU (benchmarks/).

    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 PYTHONPATH=. <python> \\
        tools/hopper_program.py [--shape qwen3_30b] [--tokens 64] [--precision mxfp8]
        [--step inference|train] [--ep R [--transport dense|ragged]] [--hlo FILE]

<python>: a Python 3.12 whose JAX has the CUDA plugin, e.g. a separate environment made with
`pip install "jax[cuda13]==0.11.2" flax` (about 4 GB; no GPU or driver needed). JAX_PLATFORMS
keeps JAX's own work on the CPU, JAX_SKIP_CUDA_CONSTRAINTS_CHECK lets the plugin load without a
driver. The program is compiled for a compile-only device of `jax.experimental.topologies`
described by `H200_TARGET` (XLA's GpuTargetConfigProto); jaxmoe makes its choices for that
device (`jaxmoe.ops.device.compiling_for`), so the Pallas kernels are the ones an H200 runs.

--step inference: the layer's forward, (y, the token counts), as `benchmarks/decode.py` times
it (--precision mxfp8: `jaxmoe.mxfp8_inference`'s layer). --step train: the value and gradient
(w.r.t. the parameters and x) of sum(y) + the auxiliary losses, in the shape's precision.
--ep R: that training step under `jaxmoe.expert_parallel_forward` over a (data, ep) = (1, R)
mesh of R compile-only H200s, --tokens a GPU (`benchmarks/ep.py`'s layer part); the program is
one GPU's, its collectives listed with the kernels. The first line also gives the memory XLA
assigns one GPU (arguments, outputs, temporaries).
"""

from __future__ import annotations

import argparse
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150754820096
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 feature_extension: ACCELERATED_FEATURES }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  device_vendor: "NVIDIA Corporation"
  platform_version: "Compute Capability 9.0a"
  device_address_bits: 64
  name: "NVIDIA H200"
  driver_version: "13.0.0"
  runtime_version: "13.0.0"
  compile_time_toolkit_version: "13.0.0"
  dnn_version: "9.10.0"
  cub_version: "3.1.2"
}
platform_name: "CUDA"
device_description_str: "NVIDIA H200"
"""

# Instructions of the entry computation that launch work on the GPU (the rest are parameters,
# tuples, bitcasts and constants, which move no data).
LAUNCHING = ("fusion", "custom-call", "sort", "scatter", "gather", "reduce", "copy", "while")
# Collectives (and their asynchronous halves: all-to-all-start, all-gather-done, ...).
COLLECTIVES = (
    "all-to-all",
    "ragged-all-to-all",
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "collective-permute",
)
_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][\w-]*)\(")


def launches(hlo_text: str) -> list[dict]:
    """The entry computation's launching instructions (kernels and collectives, both halves of
    an asynchronous one) of a compiled module's HLO text, in order: name, opcode, result shape
    and the op_name of its metadata ('' without)."""
    entry = hlo_text[hlo_text.index("\nENTRY") :]
    found = []
    for line in entry.splitlines()[1:]:
        m = _INSTRUCTION.match(line)
        if m is None or not (m.group(3) in LAUNCHING or is_collective(m.group(3))):
            continue
        op_name = re.search(r'op_name="([^"]*)"', line)
        found.append(
            dict(
                name=m.group(1),
                opcode=m.group(3),
                shape=m.group(2),
                op_name=op_name.group(1) if op_name else "",
            )
        )
    return found


def is_collective(opcode: str) -> bool:
    """Whether an HLO opcode is a collective or one half of an asynchronous one."""
    base = opcode.removesuffix("-start").removesuffix("-done")
    return base in COLLECTIVES


def hopper_devices(count: int = 1) -> list:
    """`count` compile-only H200s (`H200_TARGET`) of one process; needs JAX's CUDA plugin."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="cuda", topology_name="", topology=f"1x1x{count}", target_config=H200_TARGET
    )
    return list(topology.devices)


def program(
    shape_name: str,
    tokens: int,
    precision: str,
    step: str,
    devices: list,
    transport: str = "dense",
):
    """The compiled executable of the layer's `step` at `shape_name` with `tokens` tokens, for
    `devices`: one, or R > 1 for the training step over a (1, R) mesh (`tokens` a GPU, the
    exchange by `transport`)."""
    from jaxmoe.expert_parallel import expert_parallel_forward, state_spec
    from jaxmoe.inference import mxfp8_inference
    from jaxmoe.moe import MoE
    from jaxmoe.ops.device import compiling_for
    from jaxmoe.shapes import DEEPSEEK_V3_FULL, SHAPES

    shapes = {**SHAPES, DEEPSEEK_V3_FULL.name: DEEPSEEK_V3_FULL}
    shape = shapes[shape_name].with_precision(precision)
    inference = step == "inference" and precision == "mxfp8"
    ranks = len(devices)
    if ranks > 1 and step != "train":
        raise ValueError("--ep compiles the training step only (--step train)")

    def build():
        layer = MoE(shape.config, shape.hidden_size, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        return mxfp8_inference(layer) if inference else layer

    graphdef, params, rest = nnx.split(nnx.eval_shape(build), nnx.Param, ...)
    if ranks == 1:
        on_device = jax.sharding.SingleDeviceSharding(devices[0])
        placement = lambda path: on_device  # noqa: E731
        tokens_on = on_device
        forward = lambda model, x: model(x)  # noqa: E731
    else:
        mesh = jax.sharding.Mesh(np.array(devices).reshape(1, ranks), ("data", "ep"))
        placement = lambda path: NamedSharding(mesh, state_spec(path, "ep"))  # noqa: E731
        tokens_on = NamedSharding(mesh, P(mesh.axis_names))
        forward = lambda model, x: expert_parallel_forward(  # noqa: E731
            model, x, mesh, transport=transport
        )
    abstract = lambda tree: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda path, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placement(path)), tree
    )
    x = jax.ShapeDtypeStruct((ranks, tokens, shape.hidden_size), jnp.bfloat16, sharding=tokens_on)

    def outputs(params, x, rest):
        return forward(nnx.merge(graphdef, params, rest), x)

    if step == "inference":
        fn = lambda params, x, rest: (lambda y, aux: (y, aux.tokens_per_expert))(  # noqa: E731
            *outputs(params, x, rest)
        )
    else:

        def loss(params, x, rest):
            y, aux = outputs(params, x, rest)
            return jnp.sum(y.astype(jnp.float32)) + jnp.sum(aux.total_loss)

        fn = jax.value_and_grad(loss, argnums=(0, 1))
    with compiling_for(devices[0]):
        traced = jax.jit(fn).trace(abstract(params), x, abstract(rest))
    return traced.lower().compile()


def memory_line(compiled) -> str:
    """One GPU's memory in the compiled program (XLA's buffer assignment): its arguments,
    outputs and temporaries, in GiB."""
    stats = compiled.memory_analysis()
    gib = lambda n: n / 2**30  # noqa: E731
    return (
        f"memory a GPU: arguments {gib(stats.argument_size_in_bytes):.3g} GiB, outputs "
        f"{gib(stats.output_size_in_bytes):.3g} GiB, temporaries "
        f"{gib(stats.temp_size_in_bytes):.3g} GiB"
    )


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shape", default="qwen3_30b", help="jaxmoe.shapes.SHAPES or deepseek_v3_full"
    )
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--precision", default="mxfp8", choices=["bf16", "mxfp8", "fp8_blockwise"])
    parser.add_argument("--step", default="inference", choices=["inference", "train"])
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel degree (train step)")
    parser.add_argument("--transport", default="dense", help="the exchange's, with --ep")
    parser.add_argument("--hlo", help="also write the compiled HLO text here")
    args = parser.parse_args(argv)
    compiled = program(
        args.shape, args.tokens, args.precision, args.step, hopper_devices(args.ep), args.transport
    )
    text = compiled.as_text()
    if args.hlo:
        with open(args.hlo, "w") as f:
            f.write(text)
    found = launches(text)
    where = f", ep = {args.ep} ({args.transport})" if args.ep > 1 else ""
    print(
        f"{args.shape} {args.step} {args.precision}, {args.tokens} tokens{where}: "
        f"{len(found)} launches; {memory_line(compiled)}"
    )
    for k in found:
        print(f"  {k['name']:40s} {k['opcode']:12s} {k['shape'][:48]:48s} {k['op_name'][-60:]}")
    return found


if __name__ == "__main__":
    sys.exit(main() is None)
