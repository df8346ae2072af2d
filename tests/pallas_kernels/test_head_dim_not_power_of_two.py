"""A Llama-family checkpoint whose head_dim is not a power of two (real ones: h2o-danube2-1.8b, Mistral
architecture, hidden 2560 / 32 heads = head_dim 80; open_llama_3b, hidden 3200 / 32 = 100) loads and runs on
CPU (the tiled path takes any head_dim, and matches transformers), but on a GPU `paged_attention` asked
ragged_paged_attention for impl="auto", which picked the Triton kernel without checking the head dim; the
kernel's validator then rejected it, so every engine step of such a model raised (H100, probe 25) instead of
falling back to the XLA tiled path (as "auto" does for an int4 cache with head_dim < 32): `kernel_reads`.

Simulated on CPU by making the op believe it is on a GPU (`_on_gpu`): the kernel's own validation runs
before any lowering, so the error is the one a GPU gives (confirmed on an H100, see REPORT.md)."""
import numpy as np
import pytest
import jax.numpy as jnp

import pallas_kernels.ragged_paged_attention as rpa


def _case(head_dim):
    rng = np.random.default_rng(0)
    B, S, K, N = 2, 16, 2, 8
    kv_lens = np.array([20, 7], np.int32)
    q_lens = np.array([1, 7])
    k = rng.standard_normal((6, S, K, head_dim)).astype(np.float32)
    v = rng.standard_normal((6, S, K, head_dim)).astype(np.float32)
    tables = np.array([[1, 2], [3, 0]], np.int32)
    q = rng.standard_normal((int(q_lens.sum()), N, head_dim)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return tuple(map(jnp.asarray, (q, k, v, kv_lens, tables, cu)))


@pytest.mark.parametrize("head_dim", [80, 96, 100])
def test_auto_attention_on_gpu_serves_a_non_power_of_two_head_dim(monkeypatch, head_dim):
    args = _case(head_dim)
    want = rpa.ragged_paged_attention_reference(*args, sm_scale=head_dim ** -0.5)
    monkeypatch.setattr(rpa, "_on_gpu", lambda: True)  # what impl="auto" sees on a GPU
    # "auto" serves the model (the tiled XLA version); it raised "head_dim=80 must be a power of two".
    got = rpa.ragged_paged_attention(*args, sm_scale=head_dim ** -0.5, impl="auto")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
