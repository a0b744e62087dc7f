"""One public function per op; each takes `impl=` ("xla" reference, "pallas" kernels, "auto")."""

from jaxmoe.ops.dense import dense
from jaxmoe.ops.gmm import gmm, on_hopper, tgmm
from jaxmoe.ops.mxfp8_gmm import (QuantizedWeights, gmm_mxfp8, mxfp8_gmm, quantize_weights,
                                  tgmm_mxfp8)
from jaxmoe.ops.pallas.gmm_hopper import GmmConfig
from jaxmoe.ops.pallas.tgmm_hopper import TgmmConfig
from jaxmoe.ops.permute import combine_rows, dispatch_rows
from jaxmoe.ops.quantize import dispatch_quantize, quantize

__all__ = ["dense", "gmm", "tgmm", "mxfp8_gmm", "gmm_mxfp8", "tgmm_mxfp8", "quantize", "dispatch_quantize",
           "dispatch_rows", "combine_rows", "QuantizedWeights", "quantize_weights", "GmmConfig",
           "TgmmConfig", "on_hopper"]
