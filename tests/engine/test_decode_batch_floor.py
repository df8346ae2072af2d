"""The multi-step decode call's smallest batch bucket: one row only where it pays (int4 weights on GPU,
whose one-token GEMV needs T = 1), four elsewhere (XLA's one-row bf16 dots are slower on GPU; on CPU
each bucket is a compilation)."""
import jax
import pytest
from flax import nnx

from lmjax.engine import model_runner
from lmjax.layers.linear import Linear
from lmjax.layers.quant import QuantLinear, QuantSpec


class _Model(nnx.Module):
    def __init__(self, method: str | None):
        self.proj = Linear(8, 8) if method is None else QuantLinear(8, 8, QuantSpec(method, group_size=8))


@pytest.mark.parametrize("backend,method,floor", [
    ("gpu", "w4", 1), ("gpu", "w8", 4), ("gpu", None, 4), ("cpu", "w4", 4), ("cpu", None, 4)])
def test_floor_follows_backend_and_weights(monkeypatch, backend, method, floor):
    monkeypatch.delenv("LMJAX_DECODE_BATCH_FLOOR", raising=False)
    monkeypatch.setattr(model_runner.jax, "default_backend", lambda: backend)
    assert model_runner.decode_batch_floor(_Model(method)) == floor


def test_env_overrides_and_bad_values_are_named(monkeypatch):
    monkeypatch.setenv("LMJAX_DECODE_BATCH_FLOOR", "2")
    assert model_runner.decode_batch_floor(_Model(None)) == 2
    for bad in ("0", "6"):
        monkeypatch.setenv("LMJAX_DECODE_BATCH_FLOOR", bad)
        with pytest.raises(ValueError, match=f"LMJAX_DECODE_BATCH_FLOOR={bad} "):
            model_runner.decode_batch_floor(_Model(None))
    assert jax.default_backend() == "cpu"  # the monkeypatch above did not leak
