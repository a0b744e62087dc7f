"""benchmarks/research/gmm_mxfp8.py's transposing-quantize part off the GPU: the --quantize-variants
configs, the bytes each kernel moves, each timing's share of the copy of as many bytes, and a
pass over the kernels in the interpreter with the timer and the copies stubbed out."""

import jax.numpy as jnp
import pytest

from benchmarks.research import gmm_mxfp8 as bench
from jaxmoe import fp8_blockwise
from jaxmoe.ops.pallas.quantize_transpose_hopper import TransposeQuantizeConfig


def test_quantize_variants_parse_into_configs():
    configs = bench.quantize_configs("two:ctas_per_sm=2,transpose=in_place;plain:")
    assert configs == {
        "two": TransposeQuantizeConfig(ctas_per_sm=2, transpose="in_place"),
        "plain": TransposeQuantizeConfig(),
    }
    assert len(bench.quantize_configs(bench.DEFAULT_QUANTIZE_VARIANTS)) == 7
    assert bench.quantize_configs("") == {}
    with pytest.raises(ValueError, match="no TransposeQuantizeConfig field"):
        bench.quantize_configs("a:stages=2")
    with pytest.raises(ValueError, match="ctas_per_sm must be one of"):
        bench.quantize_configs("a:ctas_per_sm=5")
    with pytest.raises(SystemExit):
        bench.main(["--quantize-variants", "a:transpose=never"])
    with pytest.raises(SystemExit):
        bench.main(["--quantize-inputs", "x,w"])


def test_bytes_bits_and_shares_of_copy():
    """Read once, every fp8 copy and fp32 scale written; bits compared as bits; shares against
    the copy of the same bytes at the same shape, records without one left out."""
    a = jnp.zeros((256, 512), jnp.bfloat16)
    n = a.size
    assert bench.transposing_bytes("1x128_with_transpose", a) == 2 * n + 2 * n + 8 * n // 128
    assert bench.transposing_bytes("1x128_transposed", a) == 2 * n + n + 4 * n // 128
    q = fp8_blockwise.quantize_1x128(a, 1)  # read: its fp8 bytes and a scale per 128
    assert bench.transposing_bytes("1x128_requantize_transposed", q) == 2 * (n + 4 * n // 128)
    w = jnp.zeros((2, 256, 384), jnp.float32)
    assert bench.transposing_bytes("128x128_with_transpose", w) == 4 * w.size + 2 * w.size + 4 * 12
    record = [
        dict(shape="s", impl="k", tbps=1.5, bytes=10),
        dict(shape="s", impl="d2d_copy_a", tbps=3.0, bytes=10),
        dict(shape="t", impl="k", tbps=1.0, bytes=10),  # no copy at t
        dict(shape="s", impl="gemm", tflops=900.0),
    ]
    assert bench.same_bits(jnp.array([0.0, jnp.nan]), jnp.array([0.0, jnp.nan]))
    assert not bench.same_bits(jnp.array([0.0]), jnp.array([-0.0]))
    assert bench.shares_of_copy(record) == [dict(shape="s", impl="k", tbps=1.5, share_of_copy=0.5)]


def test_transposing_kernels_run_with_each_config(interpret, monkeypatch):
    """Every kernel, arithmetic and config is queued with its bytes next to a copy of them,
    and each one's bits equal the default's; a config that does not fit the input is
    skipped."""
    queued = []

    def run(op, impl, fn, work, unit, calls, **fields):
        queued.append((impl, work, fields))

    class Torch:
        uint8 = None

        @staticmethod
        def empty(*args, **kwargs):
            return None

    x = jnp.linspace(-3, 3, 256 * 384, dtype=jnp.float32).reshape(256, 384)
    configs = bench.quantize_configs(
        "split:ctas_per_sm=2,slots=2,output_slots=1,transpose=in_place;registers:"
        "column_source=registers"
    )
    bench.bench_transposing_quantize(
        dict(x=x), jnp.zeros((1, 128, 256), jnp.bfloat16), run, Torch, configs
    )
    impls = [impl for impl, _, _ in queued]
    assert impls == [
        "pallas_exact_quantize_128x128_with_transpose",
        "pallas_float_quantize_128x128_with_transpose",
        "pallas_float_clipped_quantize_128x128_with_transpose",
        "pallas_split_quantize_128x128_with_transpose",
        "pallas_registers_quantize_128x128_with_transpose",
        "d2d_copy_for_128x128_with_transpose",
        "pallas_exact_quantize_1x128_with_transpose[x]",
        "pallas_float_quantize_1x128_with_transpose[x]",
        "pallas_float_clipped_quantize_1x128_with_transpose[x]",
        "pallas_registers_quantize_1x128_with_transpose[x]",  # split: fp32 does not fit
        "d2d_copy_for_1x128_with_transpose[x]",
        "pallas_exact_quantize_1x128_transposed[x]",
        "pallas_float_quantize_1x128_transposed[x]",
        "pallas_float_clipped_quantize_1x128_transposed[x]",
        "pallas_registers_quantize_1x128_transposed[x]",
        "d2d_copy_for_1x128_transposed[x]",
        "pallas_exact_quantize_1x128_requantize_transposed[x]",
        "pallas_float_quantize_1x128_requantize_transposed[x]",
        "pallas_float_clipped_quantize_1x128_requantize_transposed[x]",
        "pallas_split_quantize_1x128_requantize_transposed[x]",
        "pallas_registers_quantize_1x128_requantize_transposed[x]",
        "d2d_copy_for_1x128_requantize_transposed[x]",
    ]
    compared = [fields for impl, _, fields in queued if not impl.startswith("d2d_copy")]
    assert all(fields["bitwise_default"] for fields in compared)  # arithmetics and configs
    assert {work for impl, work, _ in queued if "1x128_transposed" in impl} == {
        bench.transposing_bytes("1x128_transposed", x)
    }


def test_large_inputs_rotate_over_fewer_copies():
    """Inputs of more than four L2s' bytes rotate over two copies (a mixtral weight's eight did
    not fit an H100); small ones over as many as keep four L2s between two reads of a copy."""
    l2 = bench.L2_BYTES
    assert bench.distinct_copies(1_879_048_192) == 2
    assert bench.distinct_copies(4 * l2) == 2
    assert bench.distinct_copies(l2) == 4
    assert bench.distinct_copies(1024) == bench.QUANTIZE_COPIES
    made = []
    items = bench.rotating(lambda: made.append(len(made)) or len(made) - 1, bench.L2_BYTES)
    assert made == [0, 1, 2, 3] and items == [0, 1, 2, 3] * (bench.QUANTIZE_COPIES // 4)
