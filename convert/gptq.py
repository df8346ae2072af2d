"""GPTQ (Frantar et al., 2022) for lmjax's w4 layout: int4 in groups of G input rows, asymmetric, a
float scale and offset per (group, output column) -- exactly what `lmjax.layers.quant.quantize_w4`
produces, so the result loads into the same `QuantLinear` and dequantizes the same way.

Round-to-nearest rounds every weight independently. GPTQ quantizes the input rows one at a time and
pushes each row's rounding error onto the rows not yet quantized, weighted by the inverse Hessian
H = X^T X of the layer's calibration inputs X [tokens, I], so the layer's *output* error ||X W - X Q||
is what gets minimized, not the weight error. Group parameters are chosen when the loop enters a group,
from the already error-updated weights, with a small clipping search (GPTQ's `mse` option: shrink the
min/max range while that lowers the group's rounding error).

Plain numpy in float64 (a conversion-time cost, a few seconds per 100M parameters). Shape letters:
I input dim (rows of the kernel), O output dim, G group size.
"""
from __future__ import annotations

import numpy as np

LEVELS = 15  # uint4: 0..15
# Range shrink factors tried per group and output column (1.0 = plain min/max).
CLIP_GRID = tuple(1.0 - 0.02 * k for k in range(0, 11))


def round_to(x: np.ndarray, dtype) -> np.ndarray:
    """x as it will be stored (float32 / bfloat16 / float16) and read back, so the rows still to be
    quantized compensate the error of the stored scale and offset too."""
    return np.asarray(x).astype(dtype).astype(np.float64)


def group_params(w_OG: np.ndarray, param_dtype=np.float32, clip_grid=CLIP_GRID) -> tuple[np.ndarray, np.ndarray]:
    """(scale [O], offset [O]) for one group, per output column: the shrink of the [min, max] range
    that minimizes that column's squared rounding error."""
    lo_O, hi_O = w_OG.min(axis=1), w_OG.max(axis=1)
    best_scale = best_offset = best_err = None
    for shrink in clip_grid:
        lo, hi = lo_O * shrink, hi_O * shrink
        scale = round_to(np.where(hi > lo, (hi - lo) / LEVELS, 1.0), param_dtype)
        offset = round_to(lo, param_dtype)
        err = ((_fake_quant(w_OG, scale[:, None], offset[:, None]) - w_OG) ** 2).sum(axis=1)
        if best_err is None:
            best_scale, best_offset, best_err = scale, offset, err
            continue
        better = err < best_err
        best_scale, best_offset = np.where(better, scale, best_scale), np.where(better, offset, best_offset)
        best_err = np.minimum(err, best_err)
    return best_scale, best_offset


def _codes(w, scale, offset):
    return np.clip(np.round((w - offset) / scale), 0, LEVELS)


def _fake_quant(w, scale, offset):
    return _codes(w, scale, offset) * scale + offset


def inverse_hessian_factor(h_II: np.ndarray, damp: float) -> np.ndarray:
    """Upper Cholesky factor U of H^-1 (H^-1 = U^T U) after dampening H by `damp` x its mean diagonal:
    row i of U gives how row i's error spreads over the later rows (GPTQ's formulation)."""
    H = np.asarray(h_II, np.float64).copy()
    H[np.diag_indices_from(H)] += damp * np.mean(np.diag(H))
    return np.linalg.cholesky(np.linalg.inv(H)).T


def gptq_w4(w_IO, h_II, group_size: int, *, damp: float = 0.01, param_dtype=np.float32,
            clip_grid=CLIP_GRID, refine: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GPTQ-quantize a kernel [I, O] given its inputs' Hessian X^T X [I, I].

    Returns what `quantize_w4` returns: codes packed two per byte (uint8 [I/2, O], row 2i in the low
    nibble), scale and offset [ceil(I/G), O] (float32 holding `param_dtype`-exact values)."""
    W = np.asarray(w_IO, np.float64).T.copy()  # [O, I]: GPTQ's orientation, columns are input rows
    O, I = W.shape
    if I % 2:
        raise ValueError(f"int4 packing needs an even input dim, got {I=}")
    H = np.asarray(h_II, np.float64).copy()
    dead = np.diag(H) == 0  # inputs never seen: any value works, zero keeps the range tight
    H[dead, dead], W[:, dead] = 1.0, 0.0
    U = inverse_hessian_factor(H, damp)
    codes = np.zeros((O, I), np.uint8)
    scales, offsets = [], []
    for g0 in range(0, I, group_size):  # one GPTQ block per group: its parameters see updated weights
        g1 = min(g0 + group_size, I)
        scale, offset = group_params(W[:, g0:g1], param_dtype, clip_grid)
        err = _quantize_block(W, U, g0, g1, scale, offset, codes)
        W[:, g1:] -= err @ U[g0:g1, g1:]  # the block's error onto every later row at once
        scales.append(scale)
        offsets.append(offset)
    scale_gO, offset_gO = np.stack(scales), np.stack(offsets)
    u_IO = codes.T
    if refine:
        H[np.diag_indices_from(H)] += damp * np.mean(np.diag(H))
        scale_gO, offset_gO = refine_group_params(np.asarray(w_IO, np.float64), H, u_IO, group_size,
                                                  scale_gO, offset_gO)
        scale_gO, offset_gO = round_to(scale_gO, param_dtype), round_to(offset_gO, param_dtype)
    packed = u_IO[0::2] | (u_IO[1::2] << 4)
    return packed, scale_gO.astype(np.float32), offset_gO.astype(np.float32)


def _quantize_block(W, U, g0, g1, scale, offset, codes) -> np.ndarray:
    """Quantize columns g0..g1 of W in order, each error spread over the block's later columns;
    writes `codes`, returns the scaled errors [O, g1 - g0] for the update of the later blocks."""
    W1, U1 = W[:, g0:g1].copy(), U[g0:g1, g0:g1]
    err = np.zeros_like(W1)
    for i in range(g1 - g0):
        q = _codes(W1[:, i], scale, offset)
        codes[:, g0 + i] = q
        err[:, i] = (W1[:, i] - (q * scale + offset)) / U1[i, i]
        W1[:, i + 1:] -= np.outer(err[:, i], U1[i, i + 1:])
    return err


def refine_group_params(w_IO, h_II, codes_IO, group_size: int, scale_gO, offset_gO,
                        ridge: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """With the codes fixed, the dequantized kernel q * scale + offset is linear in (scale, offset), so
    the output error (W - W_hat)^T H (W - W_hat) has a closed-form minimum per output column: solve
    its normal equations [2g, 2g] (g groups). A small ridge toward the current parameters keeps a
    group whose codes are all equal (scale and offset collinear) where it was."""
    W = np.asarray(w_IO, np.float64)
    H = np.asarray(h_II, np.float64)
    Q = np.asarray(codes_IO, np.float64)
    I, O = W.shape
    n = -(-I // group_size)
    rows = [slice(g * group_size, min((g + 1) * group_size, I)) for g in range(n)]
    HQ = [H[:, r] @ Q[r] for r in rows]  # [I, O] per group: H times that group's codes
    He = [H[:, r].sum(axis=1) for r in rows]  # [I] per group: H times that group's indicator
    HW = H @ W
    M = np.zeros((O, 2 * n, 2 * n))
    b = np.zeros((O, 2 * n))
    for g, r in enumerate(rows):
        for h in range(n):
            M[:, g, h] = np.einsum("ro,ro->o", Q[r], HQ[h][r])
            M[:, g, n + h] = Q[r].T @ He[h][r]
            M[:, n + g, n + h] = He[h][r].sum()
        b[:, g] = np.einsum("ro,ro->o", Q[r], HW[r])
        b[:, n + g] = HW[r].sum(axis=0)
    M = np.triu(M) + np.swapaxes(np.triu(M, 1), 1, 2)  # the lower blocks mirror the upper ones
    theta0 = np.concatenate([np.asarray(scale_gO, np.float64).T, np.asarray(offset_gO, np.float64).T], axis=1)
    lam = ridge * np.trace(M, axis1=1, axis2=2)[:, None] / (2 * n)
    theta = np.linalg.solve(M + lam[:, :, None] * np.eye(2 * n), (b + lam * theta0)[..., None])[..., 0]
    return theta[:, :n].T, theta[:, n:].T
