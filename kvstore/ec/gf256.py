"""GF(2^8) arithmetic in numpy, the field ISA-L's erasure codes use (polynomial 0x11D).

The byte-crunching (encode, rebuild) runs in ISA-L. This module only does the tiny matrix work
that decides *which* coefficients ISA-L multiplies by: the Cauchy encode matrix, and the inverse
of the k x k sub-matrix of surviving rows when shards are lost. Keeping that in numpy makes it
readable, testable against ISA-L's own ``gf_mul``/``gf_invert_matrix``, and free of ctypes calls
per field element.
"""

from __future__ import annotations

import numpy as np

from kvstore.errors import ECError

#: x^8 + x^4 + x^3 + x^2 + 1, the reduction polynomial of ISA-L (and of most storage RS codes).
POLYNOMIAL = 0x11D


def _exp_log_tables() -> tuple[np.ndarray, np.ndarray]:
    exp = np.zeros(512, dtype=np.uint8)
    log = np.zeros(256, dtype=np.int32)
    value = 1
    for power in range(255):
        exp[power] = value
        log[value] = power
        value <<= 1
        if value & 0x100:
            value ^= POLYNOMIAL
    # Doubling the exp table lets a product index it with log a + log b without a modulo.
    exp[255:510] = exp[:255]
    return exp, log


_EXP, _LOG = _exp_log_tables()


def _mul_table() -> np.ndarray:
    logs = _LOG[1:]
    table = np.zeros((256, 256), dtype=np.uint8)
    table[1:, 1:] = _EXP[logs[:, None] + logs[None, :]]
    return table


#: MUL[a, b] = a * b in GF(2^8). 64 KiB, built once at import: a constant, not a cache.
MUL = _mul_table()
#: INV[a] = a^-1 (INV[0] is 0 and never used: zero has no inverse).
INV = np.zeros(256, dtype=np.uint8)
INV[1:] = _EXP[255 - _LOG[1:]]


def mul(a: int, b: int) -> int:
    """a * b in GF(2^8)."""
    return int(MUL[a, b])


def matmul(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """Matrix product over GF(2^8): products from the table, sums are XOR."""
    products = MUL[left[:, :, None], right[None, :, :]]
    return np.bitwise_xor.reduce(products, axis=1).astype(np.uint8)


def cauchy_matrix(k: int, m: int) -> np.ndarray:
    """The (k+m) x k systematic encode matrix of ISA-L's ``gf_gen_cauchy1_matrix``.

    Top k rows are the identity (data shards are the payload itself); row i >= k, column j is
    1 / (i XOR j). Every k x k sub-matrix of it is invertible for k + m <= 256, so any k shards
    rebuild the block (the Vandermonde variant lacks that guarantee for larger m).
    """
    matrix = np.zeros((k + m, k), dtype=np.uint8)
    matrix[:k] = np.eye(k, dtype=np.uint8)
    rows = np.arange(k, k + m)[:, None]
    cols = np.arange(k)[None, :]
    matrix[k:] = INV[rows ^ cols]
    return matrix


def invert(matrix: np.ndarray) -> np.ndarray:
    """Inverse of a square matrix over GF(2^8) by Gauss-Jordan elimination."""
    size = matrix.shape[0]
    if matrix.shape != (size, size):
        raise ECError(f"cannot invert a non-square matrix of shape {matrix.shape}")
    work = np.concatenate([matrix.astype(np.uint8), np.eye(size, dtype=np.uint8)], axis=1)
    for col in range(size):
        pivots = np.nonzero(work[col:, col])[0]
        if pivots.size == 0:
            raise ECError("singular matrix: these shards cannot rebuild the block")
        pivot = col + int(pivots[0])
        if pivot != col:
            work[[col, pivot]] = work[[pivot, col]]
        work[col] = MUL[INV[work[col, col]], work[col]]
        factors = work[:, col].copy()
        factors[col] = 0
        # Row r -= factor_r * pivot row, for every row at once.
        work ^= MUL[factors[:, None], work[col][None, :]]
    return work[:, size:].copy()
