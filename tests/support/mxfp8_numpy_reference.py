"""Numpy oracle for MXFP8 quantization (TE >= 2.13 generic kernel).

An independent NumPy model of the MX quantizer (the scale and element rules of docs/numerics.md,
"MXFP8"), written apart from `jaxmoe.mxfp8` and sharing no code with it, so that the tests compare
two separate implementations. The block between the markers is the rowwise quantizer; numpy does not
flush fp32 denormals, so it models the GPU arithmetic exactly. The helpers below it add any-axis
blocking and an exact dequantization.
"""

import ml_dtypes
import numpy as np

# ---- the rowwise quantizer (reference model) -----------------------------------------------------
F32 = np.float32
MAXN = {"e4m3": 448.0, "e5m2": 57344.0}
RCP = {k: F32(1.0 / v) for k, v in MAXN.items()}  # 0x3B124925 / 0x37924925


def e8m0_round_up(d):  # d: float32 >= 0 (or NaN/Inf)
    u = d.view(np.uint32)
    E = (u >> 23) & 0xFF
    M = u & 0x7FFFFF
    up = (M > 0) & (E != 0xFE) & ~((E == 0) & (M <= 0x400000))
    e = np.where(d == 0, 0, E + up)
    e = np.where(np.isinf(d), 0xFE, e)
    return np.where(np.isnan(d), 0xFF, e).astype(np.uint8)


def rcp_from_e8m0(e):  # exp2f_rcp, TE >= 2.13
    e = e.astype(np.int64)
    r = ((254 - np.clip(e, 0, 253)) << 23).astype(np.uint32).view(F32)
    r = np.where(e == 254, np.uint32(0x00400000).view(F32), r)
    return np.where(e == 255, F32(np.nan), r).astype(F32)


def quantize_rowwise(x, fmt="e4m3", specialized=False):  # x: [..., K], K % 32 == 0
    xf = x.astype(F32)
    blk = xf.reshape(*xf.shape[:-1], -1, 32)
    amax = np.fmax.reduce(np.abs(blk), axis=-1, initial=F32(0))  # NaN-ignoring, starts at +0
    e = e8m0_round_up((amax * RCP[fmt]).astype(F32))
    y = (blk * rcp_from_e8m0(e)[..., None]).astype(F32)
    if specialized:
        y = y + F32(0)  # sm100 fast kernel: -0 -> +0
    mx = F32(MAXN[fmt])
    dt = ml_dtypes.float8_e4m3fn if fmt == "e4m3" else ml_dtypes.float8_e5m2
    q = np.clip(y, -mx, mx).astype(dt).view(np.uint8).copy()  # satfinite + RNE
    q[np.isnan(y)] = 0x7F  # canonical NaN, sign dropped
    return q.reshape(x.shape), e


# columnwise = the same along axis -2 of the 2-D [M, K] view (np.moveaxis in, moveaxis out).
# ---- end of the rowwise quantizer ----------------------------------------------------------------

FP8_DTYPES = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def quantize(x, axis=-1, fmt="e4m3"):
    """Blocks of 32 along `axis`: returns (data bytes uint8 with x's shape, scale bytes uint8 [.., n/32, ..])."""
    q, e = quantize_rowwise(np.moveaxis(np.asarray(x), axis, -1), fmt)
    return np.moveaxis(q, -1, axis), np.moveaxis(e, -1, axis)


def quantize_columnwise(x, fmt="e4m3"):
    """TE 'columnwise' usage of a 2-D [M, K] tensor: same shape, blocks along dim 0."""
    return quantize(x, axis=-2, fmt=fmt)


def dequantize(data_bytes, scale_bytes, axis=-1, fmt="e4m3", dtype=np.float32):
    """Exact dequantization: fp8 * 2^(e-127) in float64 (exact), then cast to fp32 and to `dtype` (RNE).

    Scale byte 0 decodes to 2^-127 and byte 255 to NaN (TE main after PR #3262).
    """
    with np.errstate(over="ignore", invalid="ignore"):
        v = np.asarray(data_bytes, np.uint8).view(FP8_DTYPES[fmt]).astype(np.float64)
        e = np.repeat(np.asarray(scale_bytes, np.uint8).astype(np.int64), 32, axis=axis)
        mult = np.where(e == 255, np.nan, np.ldexp(1.0, e - 127))
        return (v * mult).astype(np.float32).astype(dtype)
