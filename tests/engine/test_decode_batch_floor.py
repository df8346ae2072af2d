"""ModelRunner's GPU-only choices, checked on CPU: the multi-step decode call's smallest batch bucket
(one row only where it pays: int4 weights on GPU, whose one-token GEMV needs T = 1; four elsewhere, as
XLA's one-row bf16 dots are slower on GPU and on CPU each bucket is a compilation), and the gate/up
merge (GPU by default), through the engine."""
import jax
import pytest
from flax import nnx

from lmjax.engine import model_prep
from lmjax.layers.linear import Linear
from lmjax.layers.quant import QuantLinear, QuantSpec


class _Model(nnx.Module):
    def __init__(self, method: str | None):
        self.proj = Linear(8, 8) if method is None else QuantLinear(8, 8, QuantSpec(method, group_size=8))


@pytest.mark.parametrize("backend,method,floor", [
    ("gpu", "w4", 1), ("gpu", "w8", 4), ("gpu", None, 4), ("cpu", "w4", 4), ("cpu", None, 4)])
def test_floor_follows_backend_and_weights(monkeypatch, backend, method, floor):
    monkeypatch.delenv("LMJAX_DECODE_BATCH_FLOOR", raising=False)
    monkeypatch.setattr(model_prep.jax, "default_backend", lambda: backend)
    assert model_prep.decode_batch_floor(_Model(method)) == floor


def test_env_overrides_and_bad_values_are_named(monkeypatch):
    monkeypatch.setenv("LMJAX_DECODE_BATCH_FLOOR", "2")
    assert model_prep.decode_batch_floor(_Model(None)) == 2
    for bad in ("0", "6"):
        monkeypatch.setenv("LMJAX_DECODE_BATCH_FLOOR", bad)
        with pytest.raises(ValueError, match=f"LMJAX_DECODE_BATCH_FLOOR={bad} "):
            model_prep.decode_batch_floor(_Model(None))
    assert jax.default_backend() == "cpu"  # the monkeypatch above did not leak


def test_gate_up_merge_is_on_for_gpu_by_default_and_bad_values_are_named(monkeypatch):
    monkeypatch.delenv("LMJAX_MERGE_GATE_UP", raising=False)
    assert not model_prep.merge_gate_up_enabled()  # CPU
    monkeypatch.setattr(model_prep.jax, "default_backend", lambda: "gpu")
    assert model_prep.merge_gate_up_enabled()
    monkeypatch.setenv("LMJAX_MERGE_GATE_UP", "0")
    assert not model_prep.merge_gate_up_enabled()
    monkeypatch.setenv("LMJAX_MERGE_GATE_UP", "1")
    assert model_prep.merge_gate_up_enabled()
    monkeypatch.setenv("LMJAX_MERGE_GATE_UP", "yes")
    with pytest.raises(ValueError, match="LMJAX_MERGE_GATE_UP='yes'"):
        model_prep.merge_gate_up_enabled()


def test_engine_with_merged_gate_up_gives_the_same_tokens(monkeypatch):
    """LMJAX_MERGE_GATE_UP=1 (with the fused q/k/v path forced too): the engine merges both on one
    device and generates the tokens of the unmerged engine."""
    import os
    import sys
    import tempfile

    import numpy as np
    from flax import nnx

    from lmjax import LLM, SamplingParams

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    from random_model import write_random_checkpoint

    path = write_random_checkpoint("tiny", tempfile.mkdtemp())
    prompts = [{"prompt_token_ids": np.random.default_rng(0).integers(4, 200, n).tolist()} for n in (5, 23)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run():
        llm = LLM(path, dtype="float32", max_model_len=128, block_size=8)
        model = nnx.merge(llm.llm_engine.runner.graphdef, llm.llm_engine.runner.state)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)], model.layers[0]

    want, plain = run()
    monkeypatch.setenv("LMJAX_MERGE_GATE_UP", "1")
    monkeypatch.setenv("LMJAX_KV_WRITE_IMPL", "kernel")
    got, merged = run()
    assert got == want
    assert plain.mlp.gate_up_proj is None and plain.self_attn.qkv_proj is None
    assert merged.mlp.gate_up_proj is not None and merged.self_attn.qkv_proj is not None
