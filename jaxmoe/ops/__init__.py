"""One public function per op; each takes `impl=` (`Impl`: "xla" reference, "auto", or a kernel
registered for it in `jaxmoe.ops.registry`: "pallas"). The grouped matmuls `gmm` and `tgmm`
take float arrays, `MXTensor`s or `BlockwiseTensor`s and pick the recipe by the operands'
types (`jaxmoe.ops.gmm`); `mxfp8_gmm` and `fp8_blockwise_gmm` are the differentiable recipes
that quantize high-precision operands inside, with their weights' copies `Mxfp8Weights`
(`quantize_mxfp8_weights`) and `BlockwiseWeights` (`quantize_blockwise_weights`)."""

from jaxmoe.ops.activation import (
    weighted_activation_backward,
    weighted_activation_backward_quantize_1x128_with_transpose,
    weighted_activation_forward,
    weighted_activation_quantize_1x128_with_transpose,
)
from jaxmoe.ops.dense import dense
from jaxmoe.ops.device import on_hopper
from jaxmoe.ops.fp8_blockwise_gmm import (
    BlockwiseWeights,
    fp8_blockwise_gmm,
    quantize_blockwise_weights,
)
from jaxmoe.ops.gmm import gmm, tgmm
from jaxmoe.ops.mxfp8_gmm import Mxfp8Weights, mxfp8_gmm, quantize_mxfp8_weights
from jaxmoe.ops.mxtensor_gmm import Mxfp8Kernel
from jaxmoe.ops.pallas.gmm_common import GmmConfig
from jaxmoe.ops.pallas.gmm_decode_hopper import DecodeConfig
from jaxmoe.ops.pallas.tgmm_hopper import TgmmConfig
from jaxmoe.ops.permute import combine_rows, dispatch_rows
from jaxmoe.ops.quantize import (
    dispatch_fake_quantize,
    dispatch_quantize,
    quantize,
    quantize_1x128,
    quantize_1x128_transposed,
    quantize_1x128_with_transpose,
    quantize_128x128_with_transpose,
    requantize_1x128_transposed,
)
from jaxmoe.ops.registry import Impl

__all__ = [
    "dense",
    "weighted_activation_forward",
    "weighted_activation_backward",
    "weighted_activation_quantize_1x128_with_transpose",
    "weighted_activation_backward_quantize_1x128_with_transpose",
    "gmm",
    "tgmm",
    "Impl",
    "Mxfp8Kernel",
    "mxfp8_gmm",
    "Mxfp8Weights",
    "quantize_mxfp8_weights",
    "fp8_blockwise_gmm",
    "BlockwiseWeights",
    "quantize_blockwise_weights",
    "quantize",
    "quantize_1x128",
    "quantize_1x128_with_transpose",
    "quantize_1x128_transposed",
    "requantize_1x128_transposed",
    "quantize_128x128_with_transpose",
    "dispatch_fake_quantize",
    "dispatch_quantize",
    "dispatch_rows",
    "combine_rows",
    "GmmConfig",
    "TgmmConfig",
    "DecodeConfig",
    "on_hopper",
]
