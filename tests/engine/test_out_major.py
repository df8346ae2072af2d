"""Out-major weights (lmjax.layers.out_major; on one GPU by default, forced here with LMJAX_DECODE_GEMV=on
so the GEMV kernel runs in interpret mode): the engine gives the greedy tokens and logprobs of the plain
layers, through batches of 3 rows (XLA's dot over the out-major weight), 2 and 1 (the fused GEMV with
the norm prologue and SwiGLU epilogue, and in the q/k/v GEMV RoPE with the KV write when that
kernel path is asked for)."""
import logging

import numpy as np
import pytest

from conftest import write_tiny_llama
from lmjax import LLM, SamplingParams
from pallas_kernels.gemv_om_qkv import gemv_om_qkv


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), tie_word_embeddings=True)


def _run(path, prompts, params):
    llm = LLM(path, max_model_len=128, num_scheduler_steps=4, block_size=16)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [o.outputs[0] for o in outs]


@pytest.mark.parametrize("kv_write", ["reference", "kernel"])
def test_out_major_engine_gives_the_plain_tokens(tiny, kv_write, monkeypatch, caplog):
    """kv_write "kernel": RoPE and the KV write ride in the q/k/v GEMV (pallas_kernels.gemv_om_qkv), as
    on a GPU; "reference": the GEMV, then RoPE and the write in XLA."""
    from lmjax.layers import out_major

    rng = np.random.default_rng(7)
    prompts = [rng.integers(4, 256, n).tolist() for n in (5, 21, 12)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=1) for m in (6, 11, 17)]
    monkeypatch.setenv("LMJAX_DECODE_GEMV", "off")
    _, want = _run(tiny, prompts, params)
    traced = []
    monkeypatch.setattr(out_major, "gemv_om_qkv", lambda *a, **k: traced.append(1) or gemv_om_qkv(*a, **k))
    monkeypatch.setenv("LMJAX_DECODE_GEMV", "on")
    monkeypatch.setenv("LMJAX_KV_WRITE_IMPL", kv_write)
    with caplog.at_level(logging.INFO, logger="lmjax.engine"):
        llm, got = _run(tiny, prompts, params)
    messages = [r.getMessage() for r in caplog.records]
    assert "out-major weights (one-row GEMV with fused norms) in 2 layers" in messages
    assert llm.llm_engine.runner.min_decode_B == 1
    batches = {m.split("B=")[1].split()[0] for m in messages if "step decode" in m}
    assert {"1", "2", "4"} <= batches  # both paths: XLA's dot at 4 rows, the GEMV at 2 and 1
    assert bool(traced) == (kv_write == "kernel")
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want):
        lp_got = [d[t].logprob for d, t in zip(g.logprobs, g.token_ids)]
        lp_want = [d[t].logprob for d, t in zip(w.logprobs, w.token_ids)]
        np.testing.assert_allclose(lp_got, lp_want, rtol=1e-4, atol=1e-4)


def test_bad_mode_is_named(tiny, monkeypatch):
    monkeypatch.setenv("LMJAX_DECODE_GEMV", "yes")
    with pytest.raises(ValueError, match="LMJAX_DECODE_GEMV / decode gemv='yes'"):
        LLM(tiny, max_model_len=64)


def test_to_out_major_converts_plain_layers_only(tiny, tmp_path):
    """Transposed copies of exactly the merged weights; layers with a bias (Llama's attention_bias) stay."""
    from lmjax.layers.out_major import OutMajorLinear
    from lmjax.loader.model_loader import load_model

    model = load_model(tiny, "float32").model
    assert model.to_out_major() == 0  # nothing merged yet
    model.merge_qkv(), model.merge_gate_up()
    qkv_IO = np.asarray(model.layers[0].self_attn.qkv_proj.kernel[...])
    assert model.to_out_major() == len(model.layers)
    layer = model.layers[0]
    assert isinstance(layer.mlp.down_proj, OutMajorLinear) and isinstance(layer.self_attn.o_proj, OutMajorLinear)
    np.testing.assert_array_equal(np.asarray(layer.self_attn.qkv_proj.kernel[...]), qkv_IO.T)

    biased = load_model(write_tiny_llama(tmp_path / "bias", attention_bias=True), "float32").model
    biased.merge_qkv(), biased.merge_gate_up()
    assert biased.to_out_major() == 0 and not any(layer.out_major for layer in biased.layers)


def test_auto_policy_is_small_models_on_gpu(monkeypatch):
    from lmjax.layers import out_major

    monkeypatch.delenv("LMJAX_DECODE_GEMV", raising=False)
    monkeypatch.setattr(out_major.jax, "default_backend", lambda: "cpu")
    assert not out_major.out_major_wanted(2048)
    monkeypatch.setattr(out_major.jax, "default_backend", lambda: "gpu")
    assert out_major.out_major_wanted(2048) and not out_major.out_major_wanted(4096)
    assert out_major.out_major_wanted(4096, "on") and not out_major.out_major_wanted(576, "off")


def test_out_major_layers_decode_one_row(monkeypatch):
    import jax.numpy as jnp
    from flax import nnx

    from lmjax.engine import model_prep
    from lmjax.layers.out_major import OutMajorLinear

    class _Model(nnx.Module):
        def __init__(self):
            self.proj = OutMajorLinear(jnp.zeros((8, 8)))

    monkeypatch.delenv("LMJAX_DECODE_BATCH_FLOOR", raising=False)
    assert model_prep.decode_batch_floor(_Model()) == 1


def test_qkv_rope_fusion_rule_and_switch(monkeypatch):
    """Where the q/k/v GEMV takes RoPE and the KV write: the fused-kernel path, <= 2 rows, full rotary,
    a float cache with one head per KV head; LMJAX_QKV_ROPE_FUSION=off keeps them apart; a bad value is named."""
    import jax.numpy as jnp

    from lmjax.layers.attention import qkv_gemv_takes_rope
    from lmjax.layers.kv_quant import make_quant_kv_caches
    from pallas_kernels.rope import RopeSpec

    cache, spec = (jnp.zeros((2, 4, 2, 16)),) * 2, RopeSpec(rotary_dim=16)
    monkeypatch.delenv("LMJAX_QKV_ROPE_FUSION", raising=False)
    monkeypatch.setenv("LMJAX_KV_WRITE_IMPL", "kernel")
    assert qkv_gemv_takes_rope(cache, spec, 2, 16, 2)
    assert not qkv_gemv_takes_rope(cache, spec, 2, 16, 3)  # rows above the GEMV's
    assert not qkv_gemv_takes_rope(cache, RopeSpec(rotary_dim=8), 2, 16, 1)  # partial rotary
    assert not qkv_gemv_takes_rope(cache, spec, 1, 16, 1)  # the cache repeats kv heads
    assert not qkv_gemv_takes_rope(make_quant_kv_caches(1, 2, 4, 2, 16, 8)[0], spec, 2, 16, 1)
    monkeypatch.setenv("LMJAX_QKV_ROPE_FUSION", "off")
    assert not qkv_gemv_takes_rope(cache, spec, 2, 16, 1)
    monkeypatch.setenv("LMJAX_QKV_ROPE_FUSION", "no")
    with pytest.raises(ValueError, match="LMJAX_QKV_ROPE_FUSION / qkv rope fusion='no'"):
        qkv_gemv_takes_rope(cache, spec, 2, 16, 1)
    monkeypatch.setenv("LMJAX_QKV_ROPE_FUSION", "auto")
    monkeypatch.setenv("LMJAX_KV_WRITE_IMPL", "reference")
    assert not qkv_gemv_takes_rope(cache, spec, 2, 16, 1)
