"""One public function per op; each takes `impl=` ("xla" reference, "pallas" kernels, "auto")."""

from jaxmoe.ops.gmm import gmm, on_hopper, tgmm
from jaxmoe.ops.mxfp8_gmm import gmm_mxfp8, mxfp8_gmm, tgmm_mxfp8
from jaxmoe.ops.pallas.gmm_hopper import GmmConfig
from jaxmoe.ops.pallas.tgmm_hopper import TgmmConfig

__all__ = ["gmm", "tgmm", "mxfp8_gmm", "gmm_mxfp8", "tgmm_mxfp8", "GmmConfig", "TgmmConfig", "on_hopper"]
