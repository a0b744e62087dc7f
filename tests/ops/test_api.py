"""jaxmoe.ops's grouped-matmul API: `gmm` and `tgmm` pick the recipe by the operands' types (each
pair reaches its implementation: the bits of calling it directly, and the three recipes give
different bits on the same values, so the comparison can tell them apart), refuse mixed pairs
with a TypeError naming both types, take one `impl` selector (`Impl`) and, for MXTensors, an
`Mxfp8Kernel`; every exported name is documented and the old names are gone."""

import inspect
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmoe.ops
from jaxmoe import fp8_blockwise as fb
from jaxmoe.mxfp8 import quantize
from jaxmoe.ops import GmmConfig, Impl, Mxfp8Kernel, TgmmConfig, gmm, registry, tgmm
from jaxmoe.ops.array_gmm import _gmm_arrays, _tgmm_arrays
from jaxmoe.ops.fp8_blockwise_gmm import _gmm_blockwise, _tgmm_blockwise
from jaxmoe.ops.mxtensor_gmm import _gmm_mxtensor, _tgmm_mxtensor
from jaxmoe.ops.pallas.gmm_decode_hopper import DecodeConfig

from bitwise import assert_bitwise, differs

M, K, N = 256, 128, 256
SIZES = jnp.array([128, 0, 128], jnp.int32)  # multiples of 128: every recipe's wgrad takes them
BF16 = jnp.bfloat16


def values():
    """lhs [M, K], weights [G, K, N] and an output gradient [M, N] in bf16, with magnitudes
    spread over 2^±6 so that the three recipes' blocks get different scales."""
    keys = jax.random.split(jax.random.key(0), 4)
    spread = jnp.exp2(jax.random.randint(keys[3], (M, 1), -6, 7).astype(jnp.float32))
    lhs = (jax.random.normal(keys[0], (M, K)) * spread).astype(BF16)
    weights = jax.random.normal(keys[1], (3, K, N)).astype(BF16)
    grad = (jax.random.normal(keys[2], (M, N)) * spread).astype(BF16)
    return lhs, weights, grad


def forward_operands():
    """(name, lhs, rhs, gmm keywords, the direct call) for each operand type's fprop."""
    lhs, weights, _ = values()
    mx_lhs, mx_rhs = quantize(lhs, axis=1), quantize(jnp.swapaxes(weights, 1, 2), axis=2)
    fb_lhs, fb_rhs = fb.quantize_1x128(lhs), fb.quantize_128x128(weights)
    return [
        ("arrays", lhs, weights, {}, lambda **kw: _gmm_arrays(lhs, weights, SIZES, **kw)),
        (
            "MXTensor",
            mx_lhs,
            mx_rhs,
            {"transpose_rhs": True},
            lambda **kw: _gmm_mxtensor(mx_lhs, mx_rhs, SIZES, **kw),
        ),
        (
            "BlockwiseTensor",
            fb_lhs,
            fb_rhs,
            {},
            lambda **kw: _gmm_blockwise(fb_lhs, fb_rhs, SIZES, **kw),
        ),
    ]


def wgrad_operands():
    """(name, lhs, rhs, tgmm keywords, the direct call) for each operand type's wgrad."""
    lhs, _, grad = values()
    mx = quantize(lhs, axis=0), quantize(grad, axis=0)
    tokens_first = fb.quantize_1x128(lhs, 0), fb.quantize_1x128(grad, 0)
    tokens_last = fb.quantize_1x128(lhs.T, 1), fb.quantize_1x128(grad.T, 1)
    return [
        ("arrays", lhs, grad, {}, lambda **kw: _tgmm_arrays(lhs, grad, SIZES, **kw)),
        ("MXTensor", *mx, {}, lambda **kw: _tgmm_mxtensor(*mx, SIZES, **kw)),
        (
            "BlockwiseTensor",
            *tokens_first,
            {},
            lambda **kw: _tgmm_blockwise(*tokens_first, SIZES, **kw),
        ),
        (
            "BlockwiseTensor, tokens last",
            *tokens_last,
            {"tokens_last": True},
            lambda **kw: _tgmm_blockwise(*tokens_last, SIZES, tokens_last=True, **kw),
        ),
    ]


def test_gmm_takes_each_operand_pair_to_its_implementation():
    direct = {}
    for name, lhs, rhs, options, call in forward_operands():
        direct[name] = np.asarray(call(impl="xla", preferred_element_type=BF16))
        out = gmm(lhs, rhs, SIZES, impl="xla", preferred_element_type=BF16, **options)
        assert_bitwise(np.asarray(out), direct[name])
    # Control: the recipes' bits differ pairwise, so each equality above names one of them.
    names = list(direct)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert differs(direct[a], direct[b]), (a, b)


def test_tgmm_takes_each_operand_pair_to_its_implementation():
    direct = {}
    for name, lhs, rhs, options, call in wgrad_operands():
        direct[name] = np.asarray(call(impl="xla", preferred_element_type=jnp.float32))
        out = tgmm(lhs, rhs, SIZES, impl="xla", **options)
        assert_bitwise(np.asarray(out), direct[name])
    # Control: the recipes differ (the two blockwise layouts are one recipe: the same bits).
    assert_bitwise(direct["BlockwiseTensor"], direct["BlockwiseTensor, tokens last"])
    for a, b in [("arrays", "MXTensor"), ("arrays", "BlockwiseTensor")]:
        assert differs(direct[a], direct[b]), (a, b)
    assert differs(direct["MXTensor"], direct["BlockwiseTensor"])


def test_gmm_differentiates_array_operands_on_the_array_product():
    lhs, weights, grad = values()
    options = {"impl": "xla", "preferred_element_type": BF16}
    want = jax.vjp(lambda a, b: _gmm_arrays(a, b, SIZES, **options), lhs, weights)[1](grad)
    got = jax.vjp(lambda a, b: gmm(a, b, SIZES, **options), lhs, weights)[1](grad)
    for a, b in zip(got, want, strict=True):
        assert_bitwise(np.asarray(a), np.asarray(b))


def test_mixed_or_unsupported_pairs_are_a_type_error_naming_both_types():
    (_, x, w, _, _), (_, mx_lhs, mx_rhs, _, _), (_, fb_lhs, fb_rhs, _, _) = forward_operands()
    for lhs, rhs, names in [
        (x, mx_rhs, r"array \(bfloat16\) and MXTensor"),
        (mx_lhs, fb_rhs, "MXTensor and BlockwiseTensor"),
        (fb_lhs, w, r"BlockwiseTensor and array \(bfloat16\)"),
        (x.tolist(), w, r"list and array \(bfloat16\)"),
    ]:
        with pytest.raises(TypeError, match=names):
            gmm(lhs, rhs, SIZES)
        with pytest.raises(TypeError, match=names):
            tgmm(lhs, rhs, SIZES)


def test_impl_is_one_selector_and_a_bad_one_is_refused():
    assert typing.get_args(Impl) == ("auto", "xla", "pallas")
    for op in ("gmm", "tgmm", "gmm[MXTensor]", "tgmm[MXTensor]"):
        assert registry.implementations(op) == typing.get_args(Impl)
    for op in ("gmm[BlockwiseTensor]", "tgmm[BlockwiseTensor]"):
        assert registry.implementations(op) == typing.get_args(Impl)
    for _, lhs, rhs, options, _ in forward_operands():
        with pytest.raises(ValueError, match=r"impl must be one of .* got 'triton'"):
            gmm(lhs, rhs, SIZES, impl="triton", **options)
    for _, lhs, rhs, options, _ in wgrad_operands():
        with pytest.raises(ValueError, match=r"impl must be one of .* got 'cuda'"):
            tgmm(lhs, rhs, SIZES, impl="cuda", **options)


def test_the_mxfp8_kernel_is_an_enum_for_mxtensor_operands_only():
    assert [k.name for k in Mxfp8Kernel] == [
        "AUTO",
        "DEQUANTIZE",
        "FUSED_DEQUANTIZE",
        "DECODE",
        "FP8_WGMMA",
    ]
    assert inspect.signature(gmm).parameters["kernel"].default is Mxfp8Kernel.AUTO
    (_, x, w, _, _), (_, mx_lhs, mx_rhs, _, _), (_, fb_lhs, fb_rhs, _, _) = forward_operands()
    with pytest.raises(TypeError, match="kernel must be an Mxfp8Kernel .* got 'decode'"):
        gmm(mx_lhs, mx_rhs, SIZES, transpose_rhs=True, kernel="decode")
    for lhs, rhs, kind in [(x, w, "Array"), (fb_lhs, fb_rhs, "BlockwiseTensor")]:
        with pytest.raises(ValueError, match=f"kernel= does not apply to {kind} operands"):
            gmm(lhs, rhs, SIZES, kernel=Mxfp8Kernel.DECODE)
        with pytest.raises(ValueError, match=f"small_scales= does not apply to {kind}"):
            gmm(lhs, rhs, SIZES, small_scales=True)
    # A config tiles one kernel, so AUTO takes none; the rhs's blocks fix its orientation.
    with pytest.raises(ValueError, match="name the kernel"):
        gmm(mx_lhs, mx_rhs, SIZES, transpose_rhs=True, config=GmmConfig())
    with pytest.raises(ValueError, match="pass transpose_rhs=True"):
        gmm(mx_lhs, mx_rhs, SIZES)


def test_configs_and_options_of_other_operand_types_are_refused():
    (_, x, w, _, _), (_, mx_lhs, mx_rhs, _, _), _ = forward_operands()
    with pytest.raises(TypeError, match="Array operands take a GmmConfig config, got DecodeConfig"):
        gmm(x, w, SIZES, config=DecodeConfig())
    with pytest.raises(TypeError, match="MXTensor operands take a GmmConfig or DecodeConfig"):
        gmm(mx_lhs, mx_rhs, SIZES, transpose_rhs=True, config=TgmmConfig())
    grad = values()[2]
    with pytest.raises(TypeError, match="Array operands take a TgmmConfig config, got GmmConfig"):
        tgmm(x, grad, SIZES, config=GmmConfig())
    with pytest.raises(ValueError, match="tokens_last= does not apply to Array operands"):
        tgmm(x, grad, SIZES, tokens_last=True)


OLD_NAMES = [
    "gmm_mxtensor",
    "tgmm_mxtensor",
    "gmm_fp8_blockwise",
    "tgmm_fp8_blockwise",
    "QuantizedWeights",
    "quantize_weights",
]


def test_every_exported_name_is_documented_and_the_old_names_are_gone():
    for name in jaxmoe.ops.__all__:
        if name != "Impl":  # a Literal alias: its docstring follows it in jaxmoe/ops/registry.py
            assert inspect.getdoc(getattr(jaxmoe.ops, name)), name
    assert '"""What `impl=` of an op accepts' in inspect.getsource(registry)
    for name in OLD_NAMES:
        assert not hasattr(jaxmoe.ops, name) and name not in jaxmoe.ops.__all__, name
    assert {"gmm", "tgmm", "Impl", "Mxfp8Kernel", "Mxfp8Weights"} <= set(jaxmoe.ops.__all__)
