"""w4 layers take the norm before them (`QuantLinear.project_normed`): at one token the w4 gemv kernel
(interpret mode here, forced with LMJAX_W4_IMPL=kernel) normalizes x in its prologue, so a decode step
has no norm launches of XLA's; its hidden states match the separate norm + kernel (LMJAX_W4_NORM=separate)
to bf16 rounding, and at several tokens (no gemv) the layers run the plain ops bit for bit."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lmjax.layers import quant as quant_module
from lmjax.layers.quant import QuantSpec, quantize_model
from tiny_models import random_llama, step_inputs


def _w4_merged_llama():
    model = random_llama(jnp.bfloat16)
    quantize_model(model, QuantSpec("w4", group_size=32))
    assert model.merge_qkv() == 2 and model.merge_gate_up() == 2
    assert all(layer.norms_in_projections for layer in model.layers)
    return model


def _hidden(model, args, monkeypatch, norm_mode):
    monkeypatch.setenv("LMJAX_W4_NORM", norm_mode)
    calls = []
    real = quant_module.w4_matmul_kernel
    monkeypatch.setattr(quant_module, "w4_matmul_kernel",
                        lambda *a, **k: calls.append(k.get("norm") is not None) or real(*a, **k))
    out = nnx.jit(lambda m, *a: m(*a)[0])(model, *args)
    return np.asarray(out.astype(jnp.float32)), calls


def test_one_token_norm_rides_in_the_w4_gemv(monkeypatch):
    monkeypatch.setenv("LMJAX_W4_IMPL", "kernel")
    model = _w4_merged_llama()
    args = step_inputs(model, [1], jnp.bfloat16)
    got, calls = _hidden(model, args, monkeypatch, "fused")
    want, calls_separate = _hidden(model, args, monkeypatch, "separate")
    # per layer: q/k/v and gate/up take their norm, o and down do not (the trace may run more than once)
    assert calls[:8] == [True, False, True, False] * 2 and len(calls) % 8 == 0, calls
    assert calls_separate and not any(calls_separate)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())


def test_several_tokens_run_the_plain_ops(monkeypatch):
    monkeypatch.setenv("LMJAX_W4_IMPL", "kernel")
    model = _w4_merged_llama()
    args = step_inputs(model, [2, 3], jnp.bfloat16)
    got, calls = _hidden(model, args, monkeypatch, "fused")
    want, _ = _hidden(model, args, monkeypatch, "separate")
    assert calls and not any(calls)  # the dot path: norms in XLA
    np.testing.assert_array_equal(got, want)


def test_bad_mode_is_named(monkeypatch):
    monkeypatch.setenv("LMJAX_W4_IMPL", "kernel")
    monkeypatch.setenv("LMJAX_W4_NORM", "inline")
    model = _w4_merged_llama()
    with pytest.raises(ValueError, match="inline"):
        nnx.jit(lambda m, *a: m(*a)[0])(model, *step_inputs(model, [1], jnp.bfloat16))
