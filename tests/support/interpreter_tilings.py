"""Kernel tilings small enough for the Mosaic GPU interpreter (a few CTAs, two-slot rings), shared
by the tests of the bf16 and fp8 grouped-matmul kernels and of the ops built on them."""

from jaxmoe.ops import GmmConfig, TgmmConfig

# bf16 forward/dgrad: fp32 output tiles of 32 columns are 128-byte rows (the TMA rule).
GMM_SMALL = GmmConfig(
    tile_m=64,
    tile_n=64,
    tile_k=64,
    max_concurrent_steps=2,
    grid_tile_width=2,
    epilogue_tile_n=32,
    wg_split="m",
    overlap_wgmma=True,
    epilogue_slots=2,
    num_sms=3,
)
# bf16 wgrad: a CTA tile of 128 x 64.
TGMM_SMALL = TgmmConfig(
    tile_k=64,
    tile_n=64,
    wg_split="k",
    tile_rows=64,
    max_concurrent_steps=2,
    grid_tile_width=1,
    num_sms=3,
)
# The block-scaled fp8 kernel (MXFP8, FP8 blockwise): K steps of 128.
FP8_GMM_SMALL = GmmConfig(
    tile_m=64,
    tile_n=64,
    tile_k=128,
    max_concurrent_steps=2,
    grid_tile_width=2,
    epilogue_tile_n=32,
    wg_split="m",
    num_sms=3,
)
