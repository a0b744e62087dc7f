"""Hardware facts of NVIDIA Hopper (sm_90: H100 / H200 SXM) that the Pallas kernels are sized by.
Every other size limit in the kernels derives from these."""

NUM_SMS = 132  # SMs of an H100 / H200 SXM
SMEM_PER_SM = 228 * 1024  # bytes of shared memory per SM
SMEM_RESERVED_PER_CTA = 1024  # bytes of each CTA's shared memory reserved by the system
MAX_SMEM_PER_CTA = SMEM_PER_SM - SMEM_RESERVED_PER_CTA  # the most one CTA can allocate
L2_BYTES = 50 * 1024 * 1024  # the H100's L2 (the H200 has 60 MB): the smaller of the two
REGISTERS_PER_SM = 64 * 1024  # 32-bit registers in an SM's register file
WARPGROUP_THREADS = 128  # four warps: the unit of wgmma and of a Pallas Mosaic GPU thread
TMA_SMEM_ALIGN = 128  # bytes: alignment of an SMEM address used by a TMA copy
SWIZZLE_ROWS = 8  # TMA into a swizzled SMEM tile needs row offsets in multiples of 8
MAX_TMA_BOX = 256  # elements along one dimension of a TMA box
