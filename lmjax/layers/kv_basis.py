"""The int4 KV cache's per-head K / q maps from calibration statistics (numpy; lmjax.layers.kv_quant
stores K as k @ k_map and reads it with q @ q_map).

The cache quantizes each stored key per token (one scale over its H channels), so its error is spread
evenly over the channels of what is stored. Storing k B and querying with q B^-T leaves q . k exact; the
score error then goes as tr(C Sk) tr(C^-1 Sq), C = B B^T, Sk and Sq the second-moment matrices of K
and q, which is least at C = Sk^-1 # Sq, the matrix geometric mean (the diagonal case is SmoothQuant's
s = sqrt(rms k / rms q) per channel). The Hadamard rotation R after B spreads what is left over the
channels. Measured (benchmarks/kv_int4_study.py, SmolLM2-135M, 2026-11-23): this "matrix smooth" halves
the KL divergence from float-KV predictions that the rotation alone leaves; the diagonal form and
data-free forms gain a third of that or less.

Shape letters: T tokens, N q heads, K kv heads, G q heads per kv head, H head dim.
"""
from __future__ import annotations

import numpy as np

RIDGE = 1e-3  # of the mean eigenvalue, added to Sk and Sq: channels unseen in calibration stay invertible


def _psd_power(m_HH: np.ndarray, p: float) -> np.ndarray:
    w, u = np.linalg.eigh(m_HH)
    return (u * np.maximum(w, 1e-12) ** p) @ u.T


def _second_moment(x_XH: np.ndarray) -> np.ndarray:
    m = x_XH.T @ x_XH / len(x_XH)
    return m + RIDGE * np.trace(m) / len(m) * np.eye(len(m))


def balance_matrix(k_TH: np.ndarray, q_XH: np.ndarray) -> np.ndarray:
    """B [H, H] (float64, det 1) for one KV head: B B^T = Sk^-1 # Sq, from its RoPE'd keys k_TH and the
    RoPE'd queries of its group q_XH (X = T G rows)."""
    sk, sq = _second_moment(k_TH.astype(np.float64)), _second_moment(q_XH.astype(np.float64))
    sk_half, sk_mhalf = _psd_power(sk, 0.5), _psd_power(sk, -0.5)
    b = _psd_power(sk_mhalf @ _psd_power(sk_half @ sq @ sk_half, 0.5) @ sk_mhalf, 0.5)
    return b / np.exp(np.linalg.slogdet(b)[1] / len(b))  # det 1: the maps keep K's overall scale


def int4_kv_maps(k_TKH: np.ndarray, q_TNH: np.ndarray, rotation_HH: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(k_map, q_map) float32 [K, H, H] = (B R, B^-T R) per KV head from one layer's RoPE'd keys and
    queries (query head n belongs to KV head n // G, as the attention op groups them)."""
    T, K, H = k_TKH.shape
    q_TKGH = q_TNH.reshape(T, K, -1, H)
    k_maps, q_maps = [], []
    for h in range(K):
        b = balance_matrix(k_TKH[:, h], q_TKGH[:, h].reshape(-1, H))
        k_maps.append(b @ rotation_HH)
        q_maps.append(np.linalg.inv(b).T @ rotation_HH)
    return np.stack(k_maps).astype(np.float32), np.stack(q_maps).astype(np.float32)
