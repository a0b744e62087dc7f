"""MXFP8 grouped-matmul benchmark on one GPU: jaxmoe MXFP8 vs jaxmoe bf16 vs torch.

    python -m benchmarks.research.gmm_mxfp8 [--shapes mixtral,qwen3_30b,dsv3_ep8] [--out DIR]

For each shape of `benchmarks/gmm.py`'s `SHAPES` (the layer sizes of `jaxmoe/shapes.py`;
Dirichlet-skewed group sizes rounded down to multiples of 128, the FP8-blockwise layer's
alignment and a multiple of MXFP8's 32: every implementation gets the same groups), in one
process, GEMMs on already-quantized operands:
  fwd    x @ W[g]        jaxmoe_mxfp8 (`Mxfp8Kernel.FP8_WGMMA`: the fp8 kernel) |
                         jaxmoe_mxfp8_dequant (DEQUANTIZE: bf16 copies, then the bf16 kernel;
                         the recipe's) | jaxmoe_mxfp8_fused (FUSED_DEQUANTIZE: the same bits,
                         dequantized in SMEM) | jaxmoe_bf16 |
                         torch_scaled_grouped_mm (fp8 rowwise scales) | torch_grouped_mm (bf16)
                         | jaxmoe_fp8_blockwise (`ops.gmm` on BlockwiseTensors: TE's FP8 blockwise
                         recipe, 1x128 x 128x128 blocks, on the 128-block fp8 kernel; the fprop
                         reads the weights' transposed copy that `quantize_blockwise_weights`
                         makes once a step, as the layer does) | torch_scaled_mm_dense (one
                         dense fp8 matmul of the same M x K x N, rowwise scales: the fp8 ceiling)
  dgrad  dy @ W[g]^T     the same but the dense one
  wgrad  x_g^T @ dy_g    jaxmoe_mxfp8 (dequantize + bf16 tgmm) | jaxmoe_fp8_blockwise
                         (`ops.tgmm` on the K-major BlockwiseTensors the layer makes,
                         `tokens_last`) | jaxmoe_bf16 | torch (both)
  quantize               x rowwise and columnwise, and the fused gather + rowwise quantize
                         (dispatch_quantize), on XLA (the reference) and on the Pallas kernels,
                         MXFP8 and FP8 blockwise 1x128 rowwise (`_1x128`; its scales are as many
                         bytes: an fp32 per 128 elements); the transposing FP8-blockwise kernels
                         (`quantize_transpose_hopper`): the weights' 128x128 copies of W, and the
                         activations' two copies (1x128_with_transpose) and transposed copy alone
                         (1x128_transposed) of x and of dy (`[dy]`: fc1's output gradient at
                         mixtral), under `default_transpose_config` in each
                         arithmetic ("float_clipped": "float" with the clip the GPU's
                         saturating convert makes redundant) and under each
                         --quantize-variants config ("float"); each one's bits compared
                         with the default's (`bitwise_default`). Each
                         against a device-to-device copy of the same bytes (the bandwidth
                         ceiling: read the input, write every output and scale); the summary
                         prints each one's share of its copy's bandwidth.

    python -m benchmarks.research.gmm_mxfp8 --ops quantize --shapes mixtral \
        [--quantize-variants "name:field=value,...;..."] [--quantize-inputs x,dy]

Writes gmm_mxfp8_<date>.json (+ .png) and prints TFLOP/s and the ratios the issue targets.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks.gmm import SHAPES, bar_plot, cell, group_sizes_for
from benchmarks.report import add_output_arguments, parse_variants
from benchmarks.timing import device_seconds, sync, time_round_robin
from jaxmoe.fp8_blockwise import BLOCK, BlockwiseTensor, quantize_1x128, quantize_128x128
from jaxmoe.mxfp8 import BLOCK_SIZE
from jaxmoe.ops import Mxfp8Kernel, dispatch_quantize, gmm, quantize, tgmm
from jaxmoe.ops.fp8_blockwise_gmm import quantize_blockwise_weights
from jaxmoe.ops.pallas.hopper import L2_BYTES
from jaxmoe.ops.pallas.quantize_hopper import (
    ARITHMETIC,
    gather_quantize_1x128_pallas,
    gather_quantize_rowwise_pallas,
    quantize_1x128_pallas,
    quantize_columnwise_pallas,
    quantize_rowwise_pallas,
)
from jaxmoe.ops.pallas.quantize_transpose_hopper import (
    TransposeQuantizeConfig,
    quantize_1x128_transposed_pallas,
    quantize_1x128_with_transpose_pallas,
    quantize_128x128_pallas,
    requantize_1x128_transposed_pallas,
)

BF16 = jnp.bfloat16
QUANTIZE_COPIES = 8  # kernel calls per timed call of a quantize kernel (see `batched`)
# The activations' transposing kernels under `TransposeQuantizeConfig`s other than their default
# (`default_transpose_config`: two CTAs an SM, two input slots and one output slot, C in place,
# the tile in registers; docs/kernels/quantize.md): the field defaults (one CTA, as first written), one
# CTA with the tile in registers, the split ring with the column encode from SMEM and with the
# rowwise copy under the wgmma, two CTAs with one slot each, three and four CTAs (four: the
# transposed copy alone fits).
DEFAULT_QUANTIZE_VARIANTS = ";".join(
    [
        "one_cta:",
        "one_cta_registers:column_source=registers",
        "two_ctas_split_smem:ctas_per_sm=2,slots=2,output_slots=1,transpose=in_place",
        "two_ctas_split_under_wgmma:ctas_per_sm=2,slots=2,output_slots=1,transpose=in_place,"
        "column_source=registers,rowwise_encode=under_wgmma",
        "two_ctas:ctas_per_sm=2,transpose=in_place,column_source=registers",
        "three_ctas:ctas_per_sm=3,transpose=in_place",
        "four_ctas:ctas_per_sm=4,transpose=in_place",
    ]
)


def quantize_configs(text: str) -> dict[str, TransposeQuantizeConfig]:
    """--quantize-variants ("name:field=value,...;...") as `TransposeQuantizeConfig`s; ValueError
    for an unknown field or a bad value."""
    configs = {}
    for name, fields in parse_variants(text).items():
        unknown = set(fields) - {f.name for f in dataclasses.fields(TransposeQuantizeConfig)}
        if unknown:
            raise ValueError(
                f"--quantize-variants {name}: no TransposeQuantizeConfig field {unknown}"
            )
        configs[name] = TransposeQuantizeConfig(**fields)
    return configs


def aligned_sizes(m: int, g: int) -> np.ndarray:
    """Dirichlet sizes rounded down to multiples of 128: what the FP8-blockwise layer's padding
    gives, and multiples of MXFP8's 32 too, so that every implementation multiplies the same
    groups."""
    return (group_sizes_for("dirichlet", m, g) // BLOCK * BLOCK).astype(np.int32)


def torch_rowwise_fp8(torch, t, dim):
    """torch fp8 e4m3 copy of t with one fp32 scale per slice along `dim` (amax / 448)."""
    amax = t.float().abs().amax(dim=dim, keepdim=True).clamp_min(1e-12)
    scale = amax / 448.0
    return (t.float() / scale).to(torch.float8_e4m3fn), scale.squeeze(dim)


def bench_shape(
    name,
    iters,
    torch,
    record,
    ops=("fwd", "dgrad", "wgrad", "quantize"),
    quantize_variants=DEFAULT_QUANTIZE_VARIANTS,
    quantize_inputs=("x", "dy"),
):
    m, k, n, g = SHAPES[name]
    sizes = aligned_sizes(m, g)
    flops = 2.0 * float(sizes.sum()) * k * n
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, k), BF16)
    w = (jax.random.normal(kw, (g, k, n), BF16) * 0.02).astype(BF16)
    dy = jax.random.normal(kd, (m, n), BF16)
    gs = jnp.asarray(sizes)

    def report(op, impl, seconds, work, unit, **fields):
        value = work / seconds / 1e12
        if unit == "tbps":
            fields["bytes"] = work  # matched with the copy of as many bytes (`shares_of_copy`)
        record.append(
            dict(shape=name, op=op, impl=impl, ms=seconds * 1e3, **{unit: value}, **fields)
        )
        print(
            f"  {name:10s} {op:8s} {impl:26s} {seconds * 1e3:8.3f} ms {value:8.1f} "
            f"{'TF/s' if unit == 'tflops' else 'TB/s'}",
            flush=True,
        )

    def failed(op, impl, e):  # a competitor that cannot run this case
        record.append(
            dict(shape=name, op=op, impl=impl, error=f"{type(e).__name__}: {str(e)[:300]}")
        )
        print(f"  {name:10s} {op:8s} {impl:26s} FAILED {type(e).__name__}: {str(e)[:200]}")

    pending = []  # this op's GEMM calls, timed together in turns by `time_pending`

    def run(op, impl, fn, work=flops, unit="tflops", calls=None, **fields):
        """A GEMM call (calls None): queued for `time_pending`; with `calls` (fn makes that many
        calls of the op, too short for the host clock): timed now from device records
        (`device_seconds`), the record getting `fields`. Seconds per call."""
        if calls is None:
            pending.append((op, impl, fn, work, unit))
            return
        try:
            report(op, impl, device_seconds(fn, calls=calls, iters=iters), work, unit, **fields)
        except Exception as e:
            failed(op, impl, e)

    def time_pending():
        """The queued calls, host-clocked, taking turns (`time_round_robin`: the H200's
        power-limited clock drifts alike for all of them)."""
        ready = []
        for entry in pending:
            try:
                sync(entry[2]())
                ready.append(entry)
            except Exception as e:
                failed(entry[0], entry[1], e)
        seconds = time_round_robin([entry[2] for entry in ready], iters=iters)
        for (op, impl, _, work, unit), t in zip(ready, seconds):
            report(op, impl, t, work, unit)
        pending.clear()

    # The MXFP8 weights' copies are K-major: [G, N, K] (fprop) and [G, K, N] blocked along N.
    mx, mx_dequant, mx_fused = (
        jax.jit(
            functools.partial(
                gmm, transpose_rhs=True, impl="pallas", preferred_element_type=BF16, kernel=kernel
            )
        )
        for kernel in (Mxfp8Kernel.FP8_WGMMA, Mxfp8Kernel.DEQUANTIZE, Mxfp8Kernel.FUSED_DEQUANTIZE)
    )
    bf = jax.jit(
        functools.partial(gmm, impl="pallas", preferred_element_type=BF16),
        static_argnames="transpose_rhs",
    )
    offs = torch.from_numpy(np.cumsum(sizes).astype(np.int32)).cuda()
    tx, tw, tdy = (torch.from_dlpack(a) for a in (x, w, dy))

    if "quantize" in ops:
        bench_quantize(x, run, torch)
        configs = quantize_configs(quantize_variants)
        activations = {a: v for a, v in dict(x=x, dy=dy).items() if a in quantize_inputs}
        bench_transposing_quantize(activations, w, run, torch, configs)
    if not {"fwd", "dgrad", "wgrad"} & set(ops):
        return
    # Quantized operands, each blocked along its GEMM's contraction dim (K-major for Hopper).
    x_q, dy_q = quantize(x, axis=1), quantize(dy, axis=1)
    w_fprop = quantize(jnp.swapaxes(w, 1, 2), axis=2)  # [G, N, K], blocks along K
    w_dgrad = quantize(w, axis=2)  # [G, K, N], blocks along N
    x_col, dy_col = quantize(x, axis=0), quantize(dy, axis=0)
    jax.block_until_ready((x_q, dy_q, w_fprop, w_dgrad, x_col, dy_col))
    blockwise = jax.jit(
        functools.partial(gmm, impl="pallas", preferred_element_type=BF16),
        static_argnames="transpose_rhs",
    )
    x_b, dy_b, w_b = quantize_1x128(x), quantize_1x128(dy), quantize_128x128(w)
    w_bt = quantize_blockwise_weights(w).transposed  # [G, N, K]: the fprop's copy

    # ---- fwd: out[M, N]
    if "fwd" in ops:
        run("fwd", "jaxmoe_mxfp8", lambda: mx(x_q, w_fprop, gs))
        run("fwd", "jaxmoe_mxfp8_dequant", lambda: mx_dequant(x_q, w_fprop, gs))
        run("fwd", "jaxmoe_mxfp8_fused", lambda: mx_fused(x_q, w_fprop, gs))
        run("fwd", "jaxmoe_fp8_blockwise", lambda: blockwise(x_b, w_bt, gs, transpose_rhs=True))
        run("fwd", "jaxmoe_bf16", lambda: bf(x, w, gs))
        tx8, sx = torch_rowwise_fp8(torch, tx, 1)
        tw8, sw = torch_rowwise_fp8(torch, tw.transpose(-2, -1).contiguous(), 2)  # [G, N, K]
        run(
            "fwd",
            "torch_scaled_grouped_mm",
            lambda: torch._scaled_grouped_mm(
                tx8, tw8.transpose(-2, -1), sx, sw, offs=offs, out_dtype=torch.bfloat16
            ),
        )
        run("fwd", "torch_grouped_mm", lambda: torch._grouped_mm(tx, tw, offs=offs))
        tw8_dense, sw_dense = tw8[0], sw[0]  # one expert's [N, K] copy for all M rows
        run(
            "fwd",
            "torch_scaled_mm_dense",
            lambda: torch._scaled_mm(
                tx8,
                tw8_dense.t(),
                scale_a=sx[:, None],
                scale_b=sw_dense[None, :],
                out_dtype=torch.bfloat16,
            ),
            work=2.0 * m * k * n,
        )
        time_pending()
        err = jnp.linalg.norm((mx(x_q, w_fprop, gs) - bf(x, w, gs)).astype(jnp.float32))
        record.append(
            dict(
                shape=name,
                op="fwd",
                impl="jaxmoe_mxfp8",
                rel_error_vs_bf16=float(err / jnp.linalg.norm(bf(x, w, gs).astype(jnp.float32))),
            )
        )

    # ---- dgrad: dx[M, K]
    if "dgrad" in ops:
        run("dgrad", "jaxmoe_mxfp8", lambda: mx(dy_q, w_dgrad, gs))
        run("dgrad", "jaxmoe_mxfp8_dequant", lambda: mx_dequant(dy_q, w_dgrad, gs))
        run("dgrad", "jaxmoe_mxfp8_fused", lambda: mx_fused(dy_q, w_dgrad, gs))
        run("dgrad", "jaxmoe_fp8_blockwise", lambda: blockwise(dy_b, w_b, gs, transpose_rhs=True))
        run("dgrad", "jaxmoe_bf16", lambda: bf(dy, w, gs, transpose_rhs=True))
        tdy8, sdy = torch_rowwise_fp8(torch, tdy, 1)
        tw8d, swd = torch_rowwise_fp8(torch, tw, 2)  # [G, K, N]
        run(
            "dgrad",
            "torch_scaled_grouped_mm",
            lambda: torch._scaled_grouped_mm(
                tdy8, tw8d.transpose(-2, -1), sdy, swd, offs=offs, out_dtype=torch.bfloat16
            ),
        )
        twt = tw.transpose(-2, -1)
        run("dgrad", "torch_grouped_mm", lambda: torch._grouped_mm(tdy, twt, offs=offs))
        time_pending()

    # ---- wgrad: dW[G, K, N]
    if "wgrad" in ops:
        mx_t = jax.jit(functools.partial(tgmm, impl="pallas", preferred_element_type=BF16))
        bf_t = jax.jit(functools.partial(tgmm, impl="pallas", preferred_element_type=BF16))
        blockwise_t = jax.jit(
            functools.partial(tgmm, impl="pallas", preferred_element_type=BF16, tokens_last=True)
        )
        x_bt, dy_bt = quantize_1x128(x.T, 1), quantize_1x128(dy.T, 1)  # the layer's copies
        run("wgrad", "jaxmoe_mxfp8", lambda: mx_t(x_col, dy_col, gs))
        run(
            "wgrad",
            "jaxmoe_fp8_blockwise",
            lambda: blockwise_t(x_bt, dy_bt, gs),
        )
        run("wgrad", "jaxmoe_bf16", lambda: bf_t(x, dy, gs))
        # 2d x 2d (ragged K): torch wants one scale per row of each operand *per group*; unit
        # scales on directly cast data time the same kernel (the values are irrelevant here).
        txt8 = tx.t().contiguous().to(torch.float8_e4m3fn)  # [K, M]
        tdyt8 = tdy.t().contiguous().to(torch.float8_e4m3fn)  # [N, M]
        sxt = torch.ones(k * g, device="cuda", dtype=torch.float32)
        sdyt = torch.ones(n * g, device="cuda", dtype=torch.float32)
        run(
            "wgrad",
            "torch_scaled_grouped_mm",
            lambda: torch._scaled_grouped_mm(
                txt8, tdyt8.t(), sxt, sdyt, offs=offs, out_dtype=torch.bfloat16
            ),
        )
        txt = tx.t()
        run("wgrad", "torch_grouped_mm", lambda: torch._grouped_mm(txt, tdy, offs=offs))
        time_pending()


def distinct_copies(nbytes: int) -> int:
    """How many distinct copies of an input of nbytes a timed call rotates over: as many as keep
    four L2s of other bytes between two reads of one copy (so none is read from the L2), at
    least 2, at most QUANTIZE_COPIES. A mixtral weight (1.9 GB) gets 2: eight copies of it,
    eight outputs and eight copy pairs did not fit an H100's 80 GB."""
    return min(QUANTIZE_COPIES, max(2, -(-4 * L2_BYTES // max(nbytes, 1))))


def rotating(make, nbytes: int) -> list:
    """QUANTIZE_COPIES items, `distinct_copies(nbytes)` of them made by make() and taken in
    turn."""
    distinct = [make() for _ in range(distinct_copies(nbytes))]
    return [distinct[i % len(distinct)] for i in range(QUANTIZE_COPIES)]


def batched(fn, *args):
    """One jitted call that applies fn QUANTIZE_COPIES times, over `rotating` copies of args
    (rotating inputs, as separate steps would, and fewer host dispatches per kernel)."""
    many = jax.jit(lambda sets: [fn(*a) for a in sets])
    copy = functools.partial(jax.tree.map, lambda a: jnp.array(a, copy=True))
    nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(args))
    sets = rotating(lambda: [copy(a) for a in args], nbytes)
    return lambda: many(sets)


def bench_quantize(x, run, torch):
    """Quantize x (bytes read + written) against a device copy of the same bytes. The fused
    dispatch gathers x's rows from m/2 tokens (each token twice, shuffled, 5% padding rows).
    Every implementation runs QUANTIZE_COPIES times over rotating input copies and is timed on the
    device (`device_seconds`): one quantize kernel (50-200 us) is shorter than JAX's host
    dispatch of a call, so a host clock would time the host."""
    m = x.shape[0]
    q_bytes = x.size * 2 + x.size + x.size // BLOCK_SIZE
    kernels = {
        "rowwise": quantize_rowwise_pallas,
        "columnwise": quantize_columnwise_pallas,
        "1x128_rowwise": quantize_1x128_pallas,
    }
    references = {
        "rowwise": functools.partial(quantize, axis=1, impl="xla"),
        "columnwise": functools.partial(quantize, axis=0, impl="xla"),
        "1x128_rowwise": functools.partial(quantize_1x128, axis=1),  # the XLA reference
    }
    for kind, fn in references.items():
        run_quantize(run, f"xla_quantize_{kind}", q_bytes, fn, x)
        for arithmetic in ARITHMETIC:
            fn = functools.partial(kernels[kind], arithmetic=arithmetic)
            run_quantize(run, f"pallas_{arithmetic}_quantize_{kind}", q_bytes, fn, x)
    tokens = x[: m // 2]
    row_token = jax.random.permutation(jax.random.key(1), jnp.arange(m) % (m // 2))
    row_token = jnp.where(jax.random.uniform(jax.random.key(2), (m,)) < 0.05, m // 2, row_token)
    gathers = {"": gather_quantize_rowwise_pallas, "_1x128": gather_quantize_1x128_pallas}
    for suffix, kernel in gathers.items():
        recipe = "fp8_blockwise" if suffix else "mxfp8"
        fn = functools.partial(dispatch_quantize, recipe=recipe, impl="xla")
        run_quantize(run, f"xla_dispatch_quantize{suffix}", q_bytes, fn, tokens, row_token)
        for arithmetic in ARITHMETIC:
            fn = functools.partial(kernel, arithmetic=arithmetic)
            run_quantize(
                run,
                f"pallas_{arithmetic}_dispatch_quantize{suffix}",
                q_bytes,
                fn,
                tokens,
                row_token,
            )
    run_copy(run, torch, "d2d_copy_same_bytes", q_bytes)


def run_quantize(run, impl, nbytes, fn, *args, **fields):
    """Time QUANTIZE_COPIES calls of fn on rotating copies of args (`batched`) as a quantize
    that moves nbytes."""
    run(
        "quantize",
        impl,
        batched(fn, *args),
        work=nbytes,
        unit="tbps",
        calls=QUANTIZE_COPIES,
        **fields,
    )


def run_copy(run, torch, impl, nbytes):
    """Time QUANTIZE_COPIES device-to-device copies that read and write nbytes in all (over
    `rotating` buffer pairs)."""
    pairs = rotating(
        lambda: tuple(torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda") for _ in "ab"),
        nbytes // 2,
    )

    def copies():
        for src, dst in pairs:
            dst.copy_(src)
        return dst

    run("quantize", impl, copies, work=nbytes, unit="tbps", calls=QUANTIZE_COPIES)


def transposing_bytes(kind, a):
    """Bytes a transposing quantize kernel moves on input a: a read (a 1 x 128 copy: its fp8
    data and scales), every copy and scale written (fp8 data, an fp32 scale per 128 x 128
    weight block or per 128 activations)."""
    if isinstance(a, BlockwiseTensor):
        a, read = a.data, a.data.size + a.scale_inv.size * 4
    else:
        read = a.size * a.dtype.itemsize
    elements = a.size
    return {
        "128x128_with_transpose": read + 2 * elements + 4 * (elements // BLOCK**2),
        "1x128_with_transpose": read + 2 * elements + 2 * 4 * (elements // BLOCK),
        "1x128_transposed": read + elements + 4 * (elements // BLOCK),
        "1x128_requantize_transposed": read + elements + 4 * (elements // BLOCK),
    }[kind]


def requantize_bf16(q, **kwargs):
    """The wgrad copy of a dispatched 1 x 128 copy's bf16 values, from its fp8 bytes."""
    return requantize_1x128_transposed_pallas(q.data, q.scale_inv, BF16, **kwargs)


def same_bits(a, b) -> bool:
    """Whether two arrays of one dtype hold the same bits (NaNs and signed zeros included)."""
    unsigned = jnp.dtype(f"uint{a.dtype.itemsize * 8}")
    return bool(
        jnp.array_equal(
            lax.bitcast_convert_type(a, unsigned), lax.bitcast_convert_type(b, unsigned)
        )
    )


def bench_transposing_quantize(activations, w, run, torch, configs):
    """The transposing FP8-blockwise kernels, each next to a copy of its bytes: the weights'
    on w, the activations' on each of `activations` (name -> [M, K] array) and the requantize
    on its 1 x 128 copy, in each arithmetic under the default config, then under each of
    `configs` (name -> `TransposeQuantizeConfig`) in the default arithmetic; every one's
    output bits compared with the default's (`bitwise_default`)."""
    inputs = [("128x128_with_transpose", quantize_128x128_pallas, "", w)]
    for name, a in activations.items():
        inputs += [
            (kind, kernel, f"[{name}]", a)
            for kind, kernel in [
                ("1x128_with_transpose", quantize_1x128_with_transpose_pallas),
                ("1x128_transposed", quantize_1x128_transposed_pallas),
            ]
        ]
        copy = quantize_1x128(a, 1)  # the dispatched copy the layer requantizes
        inputs.append(("1x128_requantize_transposed", requantize_bf16, f"[{name}]", copy))
    for kind, kernel, suffix, a in inputs:
        nbytes = transposing_bytes(kind, a)
        default = jax.tree.leaves(jax.jit(kernel)(a))
        for arithmetic in ARITHMETIC:
            fn = functools.partial(kernel, arithmetic=arithmetic)
            same = all(map(same_bits, jax.tree.leaves(jax.jit(fn)(a)), default))
            impl = f"pallas_{arithmetic}_quantize_{kind}{suffix}"
            run_quantize(run, impl, nbytes, fn, a, bitwise_default=same)
        for variant, config in configs.items():
            fn = functools.partial(kernel, config=config)
            try:
                same = all(map(same_bits, jax.tree.leaves(jax.jit(fn)(a)), default))
            except Exception as e:  # a ring that does not fit (ValueError), or a compile error
                print(f"  quantize {kind}{suffix} {variant} FAILED {type(e).__name__}: {e}")
                continue
            run_quantize(
                run,
                f"pallas_{variant}_quantize_{kind}{suffix}",
                nbytes,
                fn,
                a,
                bitwise_default=bool(same),
            )
        del default
        run_copy(run, torch, f"d2d_copy_for_{kind}{suffix}", nbytes)


def summarize(record):
    table = {}
    for r in record:
        if "tflops" in r:
            table.setdefault((r["shape"], r["op"]), {})[r["impl"]] = r["tflops"]
    ratios = []
    print(
        f"\n{'shape':10s} {'op':6s} {'mxfp8':>7s} {'dequant':>7s} {'bf16':>7s} {'t_fp8':>7s} "
        f"{'t_bf16':>7s} {'mx/bf16':>8s} {'mx/t_fp8':>8s}"
    )
    for (shape, op), t in table.items():
        ours, bf16, tfp8 = (
            t.get("jaxmoe_mxfp8"),
            t.get("jaxmoe_bf16"),
            t.get("torch_scaled_grouped_mm"),
        )
        ratio = dict(
            shape=shape,
            op=op,
            mxfp8_vs_jaxmoe_bf16=ours / bf16 if ours and bf16 else None,
            mxfp8_vs_torch_scaled=ours / tfp8 if ours and tfp8 else None,
            dequant_vs_jaxmoe_bf16=(
                t["jaxmoe_mxfp8_dequant"] / bf16 if "jaxmoe_mxfp8_dequant" in t and bf16 else None
            ),
            # issue 17's targets: FP8 blockwise against jaxmoe bf16 and torch's rowwise fp8
            fp8_blockwise_vs_jaxmoe_bf16=(
                t["jaxmoe_fp8_blockwise"] / bf16 if "jaxmoe_fp8_blockwise" in t and bf16 else None
            ),
            fp8_blockwise_vs_torch_scaled=(
                t["jaxmoe_fp8_blockwise"] / tfp8 if "jaxmoe_fp8_blockwise" in t and tfp8 else None
            ),
        )
        ratios.append(ratio)
        print(
            f"{shape:10s} {op:6s} {cell(ours)} {cell(t.get('jaxmoe_mxfp8_dequant'))} "
            f"{cell(bf16)} {cell(tfp8)} {cell(t.get('torch_grouped_mm'))} "
            f"{cell(ratio['mxfp8_vs_jaxmoe_bf16'], True)} "
            f"{cell(ratio['mxfp8_vs_torch_scaled'], True)}"
        )
    shape = None
    for share in shares_of_copy(record):
        if share["shape"] != shape:
            shape = share["shape"]
            print(f"\n{shape}: quantize TB/s, share of a device copy of the same bytes")
        ratios.append(dict(share, op="quantize"))
        print(f"  {share['impl']:58s} {share['tbps']:6.2f} {share['share_of_copy']:6.1%}")
    return ratios


def shares_of_copy(record):
    """Each bandwidth record's (shape, impl, tbps, share_of_copy): its TB/s over that of the
    device copy (impl d2d_copy_*) of as many bytes at the same shape; records without one are
    left out."""
    copies = {
        (r["shape"], r["bytes"]): r["tbps"]
        for r in record
        if "tbps" in r and r["impl"].startswith("d2d_copy")
    }
    return [
        dict(
            shape=r["shape"],
            impl=r["impl"],
            tbps=r["tbps"],
            share_of_copy=r["tbps"] / copies[r["shape"], r["bytes"]],
        )
        for r in record
        if "tbps" in r
        and not r["impl"].startswith("d2d_copy")
        and (r["shape"], r["bytes"]) in copies
    ]


def plot(record, shapes, path):
    bar_plot(
        record,
        shapes,
        [
            "jaxmoe_mxfp8",
            "jaxmoe_mxfp8_dequant",
            "jaxmoe_fp8_blockwise",
            "jaxmoe_bf16",
            "torch_scaled_grouped_mm",
            "torch_grouped_mm",
            "torch_scaled_mm_dense",
        ],
        "MXFP8 and FP8 blockwise vs bf16 grouped matmul on one H200",
        path,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument(
        "--ops",
        default="fwd,dgrad,wgrad,quantize",
        help="subset to run; a subset's JSON gets the ops in its name",
    )
    parser.add_argument(
        "--quantize-variants",
        default=DEFAULT_QUANTIZE_VARIANTS,
        help="the activations' transposing kernels under these TransposeQuantizeConfigs too: "
        '"name:field=value,...;..." ("" for none)',
    )
    parser.add_argument(
        "--quantize-inputs",
        default="x,dy",
        help="the activations the transposing kernels quantize (x [M, K], dy [M, N])",
    )
    add_output_arguments(parser, tag=False)
    args = parser.parse_args(argv)
    try:
        quantize_configs(args.quantize_variants)
    except ValueError as e:
        parser.error(str(e))
    quantize_inputs = [a for a in args.quantize_inputs.split(",") if a]
    if set(quantize_inputs) - {"x", "dy"}:
        parser.error(f"--quantize-inputs: x and/or dy, got {args.quantize_inputs!r}")
    import torch

    device = jax.devices()[0]
    shapes = args.shapes.split(",")
    record = []
    for name in shapes:
        bench_shape(
            name,
            args.iters,
            torch,
            record,
            args.ops.split(","),
            args.quantize_variants,
            quantize_inputs,
        )
    ratios = summarize(record)
    date = datetime.date.today().isoformat()
    os.makedirs(args.out, exist_ok=True)
    result = dict(
        benchmark="gmm_mxfp8",
        date=date,
        device=device.device_kind,
        jax=jax.__version__,
        torch=torch.__version__,
        python=platform.python_version(),
        shapes={s: dict(zip(("M", "K", "N", "G"), SHAPES[s])) for s in shapes},
        method="GEMMs: per op, the implementations take turns over 5 repeats of back-to-back "
        "calls (at least iters and 0.2 s each, after as many untimed calls), synchronised, "
        "median; operands quantized "
        "beforehand (quantization timed separately as op 'quantize'); bf16 out; FLOPs "
        "count the routed rows only. Quantize kernels and the copy: device time (JAX "
        f"profiler GPU records / CUDA events) over {args.iters} runs of "
        f"{QUANTIZE_COPIES} calls on rotating input copies, per call",
        results=record,
        ratios=ratios,
    )
    ops = args.ops.split(",")
    suffix = "" if set(ops) == {"fwd", "dgrad", "wgrad", "quantize"} else "_" + "_".join(ops)
    path = os.path.join(args.out, f"gmm_mxfp8_{date}{suffix}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    plot(record, shapes, path.replace(".json", ".png"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
