"""Weight-only quantization (`lmjax.layers.quant`): exact packing, bounded rounding error, the model
transform, and SmolLM2 perplexity on a fixed public-domain text against the unquantized model.

The baseline is float32 (bf16 matmuls are slow on CPU). SmolLM2 here is a Q4_1 GGUF (asymmetric int4,
groups of 32) dequantized, so w4 with groups of 32 lands on the very grid it came from.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lmjax.layers.linear import Linear
from lmjax.models.forward import perplexity
from lmjax.layers.quant import (QuantLinear, QuantSpec, dequantize_w4, quantize_model, quantize_w4, quantize_w8,
                                set_slot, unpack_w4)
from test_convert import TINY

TEXT = os.path.join(os.path.dirname(__file__), "data", "perplexity.txt")


def _w(I=200, O=48, seed=0):
    return jax.random.normal(jax.random.key(seed), (I, O), jnp.float32)


def test_w8_error_is_at_most_half_a_step():
    w = _w()
    q, scale = quantize_w8(w)
    assert q.dtype == jnp.int8 and scale.shape == (48,)
    assert jnp.all(jnp.abs(q.astype(jnp.float32) * scale - w) <= scale / 2 + 1e-6)


@pytest.mark.parametrize("group_size", [32, 64, 128])  # 200 rows: 64 and 128 leave a short last group
def test_w4_packing_is_exact_and_error_at_most_half_a_step(group_size):
    w = _w()
    packed, scale, offset = quantize_w4(w, group_size)
    groups = -(-200 // group_size)
    assert packed.shape == (100, 48) and packed.dtype == jnp.uint8 and scale.shape == offset.shape == (groups, 48)
    u = unpack_w4(packed)
    assert int(u.max()) <= 15 and u.shape == (200, 48)
    repacked = u[0::2] | (u[1::2] << 4)
    assert jnp.array_equal(repacked, packed)
    step = jnp.repeat(scale, group_size, axis=0)[:200]
    assert jnp.all(jnp.abs(dequantize_w4(packed, scale, offset, group_size, jnp.float32) - w) <= step / 2 + 1e-5)


@pytest.mark.parametrize("spec", [QuantSpec("w8"), QuantSpec("w4", 64)])
def test_quant_linear_is_dequantize_then_matmul(spec):
    linear = Linear(200, 48, bias=True)
    linear.kernel, linear.bias = nnx.Param(_w()), nnx.Param(jnp.arange(48, dtype=jnp.float32))
    layer = QuantLinear.from_linear(linear, spec)
    x = jax.random.normal(jax.random.key(1), (5, 200))
    if spec.method == "w8":
        w = layer.kernel[...].astype(jnp.float32) * layer.scale[...]
    else:
        w = dequantize_w4(layer.kernel[...], layer.scale[...], layer.offset[...], 64, jnp.float32)
    np.testing.assert_allclose(jax.jit(lambda x: layer(x))(x), x @ w + linear.bias[...], rtol=1e-5, atol=1e-4)


def test_quantize_model_swaps_every_linear_but_lm_head(smollm2_lmjax):
    model = quantize_model(nnx.clone(smollm2_lmjax.model), QuantSpec("w4", 32))
    kinds = {type(m).__name__ for p, m in nnx.iter_modules(model) if isinstance(m, (Linear, QuantLinear))}
    assert kinds == {"QuantLinear"}  # SmolLM2 ties its lm_head to the embedding
    assert isinstance(model.layers[3].mlp.down_proj, QuantLinear)
    w8 = sum(v[...].nbytes for _, v in nnx.to_flat_state(nnx.state(
        quantize_model(nnx.clone(smollm2_lmjax.model), QuantSpec("w8")))))
    full = sum(v[...].nbytes for _, v in nnx.to_flat_state(nnx.state(smollm2_lmjax.model)))
    assert w8 < 0.55 * full  # float32 -> int8 body; the float32 tied embedding stays


# ---------------------------------------------------------------- perplexity
@pytest.fixture(scope="module")
def text_ids(smollm2_tokenizer) -> list[int]:
    ids = smollm2_tokenizer.encode(open(TEXT).read())
    assert len(ids) > 500
    return ids


@pytest.fixture(scope="module")
def base_ppl(smollm2_lmjax, text_ids) -> float:
    ppl = perplexity(smollm2_lmjax.model, text_ids)
    assert 5 < ppl < 20, ppl  # a sane model on plain English (measured 10.64)
    return ppl


@pytest.mark.parametrize("spec, tolerance", [(QuantSpec("w8"), 0.01), (QuantSpec("w4", 32), 0.05)])
def test_smollm2_perplexity_within_tolerance(smollm2_lmjax, text_ids, base_ppl, spec, tolerance):
    ppl = perplexity(quantize_model(nnx.clone(smollm2_lmjax.model), spec), text_ids)
    print(f"SmolLM2 perplexity: float32 {base_ppl:.4f}, {spec.method} g{spec.group_size} {ppl:.4f}")
    assert ppl <= base_ppl * (1 + tolerance)


def test_smollm2_converted_w4_restores_the_quantized_model(smollm2_gguf, smollm2_lmjax, text_ids, tmp_path):
    from convert import convert_checkpoint
    from lmjax.loader.model_loader import load_model

    out = convert_checkpoint(smollm2_gguf, tmp_path / "w4", dtype="float32", quant="w4", group_size=32,
                             w4_method="rtn")
    restored = load_model(out, "float32").model
    assert isinstance(restored.layers[0].self_attn.q_proj, QuantLinear)
    assert restored.layers[0].self_attn.q_proj.kernel[...].dtype == jnp.uint8
    in_memory = quantize_model(nnx.clone(smollm2_lmjax.model), QuantSpec("w4", 32))
    assert perplexity(restored, text_ids) == pytest.approx(perplexity(in_memory, text_ids), rel=1e-5)


# ---------------------------------------------------------------- calibrated w4: AWQ and GPTQ (convert/)
def _correlated_inputs(I=256, T=1024, seed=0):
    """Inputs with a few dominant directions and an outlier channel, like real activations."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, I)) @ (np.eye(I) + 0.3 * rng.standard_normal((I, I)) / np.sqrt(I))
    x[:, 7] *= 20
    return x


def _output_error(x, w, packed, scale, offset, G):
    w_hat = np.asarray(dequantize_w4(jnp.asarray(packed), jnp.asarray(scale), jnp.asarray(offset), G, jnp.float32))
    return float(np.linalg.norm(x @ (w_hat - w)) / np.linalg.norm(x @ w))


def test_gptq_and_least_squares_beat_round_to_nearest_on_the_output_in_the_same_layout():
    from convert.awq import rtn_ls_w4
    from convert.gptq import gptq_w4

    x, w = _correlated_inputs(), np.asarray(_w(256, 64, seed=3))
    rtn = quantize_w4(jnp.asarray(w), 128)
    plain = gptq_w4(w, x.T @ x, 128, refine=False)
    refined = gptq_w4(w, x.T @ x, 128)
    least_squares = rtn_ls_w4(w, x.T @ x, 128, damp=0.01)
    for packed, scale, offset in (plain, refined, least_squares):
        assert packed.shape == rtn[0].shape and packed.dtype == np.uint8 and scale.shape == offset.shape == rtn[1].shape
    assert np.array_equal(least_squares[0], rtn[0])  # the codes stay round to nearest's
    errors = [_output_error(x, w, *q, 128) for q in (rtn, plain, refined, least_squares)]
    assert errors[1] < 0.85 * errors[0] and errors[2] <= errors[1] and errors[3] < 0.9 * errors[0], errors


def test_calibration_text_is_not_the_perplexity_text():
    from lmjax.calibration_text import DEFAULT_CALIBRATION_TEXT

    sentences = [s.strip() for s in open(TEXT).read().replace("\n", " ").split(".") if len(s.strip()) > 20]
    assert sentences and not any(s in DEFAULT_CALIBRATION_TEXT for s in sentences)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random 2-layer Llama in float32 (test_convert.TINY: hidden 64, 8 q heads on 4 kv heads)."""
    import torch
    import transformers

    from lmjax.loader.model_loader import load_model

    path = str(tmp_path_factory.mktemp("tiny-hf"))
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).save_pretrained(path)
    return load_model(path, "float32").model


def _tiny_prompts(rows: int, seed: int) -> list[list[int]]:
    return [list(map(int, p)) for p in np.random.default_rng(seed).integers(3, TINY["vocab_size"], (rows, 64))]


def _awq_fold_model(model, prompts: list[list[int]], group_size: int, grid) -> nnx.Module:
    """Only AWQ's scaling, in place: `calibrate_w4`'s awq path without the quantization, so the float
    model keeps every layer's scales folded in (the same function as before, up to float rounding)."""
    from convert.awq import fold_layer
    from convert.calibrate import tapped_layers, taps_by_name

    for layer, taps in tapped_layers(model, prompts):
        fold_layer(layer, taps_by_name(taps), group_size, grid)
        for parent, key, tap in taps:
            set_slot(parent, key, tap.linear)
    return model


def test_calibrated_w4_quantizes_the_lm_head_when_asked(tiny_model):
    from convert.calibrate import calibrate_w4

    plain = calibrate_w4(nnx.clone(tiny_model), QuantSpec("w4", 32), _tiny_prompts(2, seed=0))
    headed = calibrate_w4(nnx.clone(tiny_model), QuantSpec("w4", 32, lm_head="w8"), _tiny_prompts(2, seed=0))
    assert type(plain.lm_head) is Linear
    assert isinstance(headed.lm_head, QuantLinear) and headed.lm_head.kernel[...].dtype == jnp.int8


def test_awq_scales_fold_into_the_float_model_exactly(tiny_model):
    """The scaled but unquantized model computes the same logits: 1/s went into the input norms, v_proj's
    columns (per kv head, shared by its 2 q heads here) and up_proj's columns."""
    from lmjax.models.forward import prompt_logits

    model = tiny_model
    held_out = _tiny_prompts(2, seed=1)
    want = prompt_logits(model, held_out)
    folded = _awq_fold_model(nnx.clone(model), _tiny_prompts(4, seed=0), group_size=32, grid=(0.5,))  # alpha forced
    for layer, before in zip(folded.layers, model.layers):
        for get in (lambda l: l.input_layernorm.weight, lambda l: l.post_attention_layernorm.weight,
                    lambda l: l.self_attn.v_proj.kernel, lambda l: l.mlp.up_proj.kernel,
                    lambda l: l.self_attn.o_proj.kernel, lambda l: l.mlp.down_proj.kernel):
            assert not np.allclose(get(layer)[...], get(before)[...], rtol=1e-3)  # every fold was made
    for got, ref in zip(prompt_logits(folded, held_out), want):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2e-6 * float(np.abs(ref).max()))


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_calibrated_w4_beats_round_to_nearest_on_a_tiny_model(tiny_model, method):
    from convert.calibrate import calibrate_w4
    from lmjax.models.forward import prompt_logits

    model, spec, held_out = tiny_model, QuantSpec("w4", 32), _tiny_prompts(2, seed=1)
    want = prompt_logits(model, held_out)

    def error(m):
        return float(np.mean([np.mean((g - w) ** 2) for g, w in zip(prompt_logits(m, held_out), want)]))
    calibrated = calibrate_w4(nnx.clone(model), spec, _tiny_prompts(4, seed=0), method=method)
    assert isinstance(calibrated.layers[1].mlp.down_proj, QuantLinear)
    assert error(calibrated) < error(quantize_model(nnx.clone(model), spec))


@pytest.fixture(scope="module")
def awq_g128_converted(smollm2_gguf, tmp_path_factory) -> str:
    """SmolLM2 through `lmjax convert --quant w4`'s default (AWQ over the built-in calibration text), in
    float32: calibrated once (minutes on CPU) and shared by the tests below."""
    from convert import convert_checkpoint

    return convert_checkpoint(smollm2_gguf, tmp_path_factory.mktemp("awq") / "w4", dtype="float32", quant="w4",
                              group_size=128)


@pytest.fixture(scope="module")
def awq_g128_ppl(awq_g128_converted, text_ids) -> float:
    from lmjax.loader.model_loader import load_model

    model = load_model(awq_g128_converted, "float32").model
    assert isinstance(model.layers[0].mlp.down_proj, QuantLinear)
    return perplexity(model, text_ids)


# w4 g128 target of the issue: within 5% of float32 (10.64). Not met: round to nearest measures 36.6 (+244%),
# GPTQ with least-squares scales 21.5 (+102%), AWQ (convert/awq.py, the default) 18.3 (+72%); all calibrated
# on lmjax/calibration_text.py. SmolLM2-135M here is itself a Q4_1 (group 32) model, whose four
# differently-scaled blocks per group of 128 no single scale and offset can follow. The bound guards
# AWQ's gain over GPTQ (variants of the search moved it by about +-1: see convert/awq.py).
def test_smollm2_w4_g128_awq_beats_gptq(awq_g128_ppl, base_ppl):
    print(f"SmolLM2 perplexity: float32 {base_ppl:.4f}, w4 g128 awq {awq_g128_ppl:.4f} (gptq 21.51, rtn 36.65)")
    assert awq_g128_ppl < 20.0


def test_smollm2_converted_w4_records_its_calibration(smollm2_gguf, awq_g128_converted, tmp_path):
    """The conversion says how it was quantized; a missing --calib-text file is named before any work.
    (That a --calib-text conversion restores exactly the model calibrated in memory is checked on a tiny
    model: tests/convert/test_convert.py.)"""
    import json

    from convert import convert_checkpoint

    quant = json.load(open(os.path.join(awq_g128_converted, "config.json")))["lmjax"]["quant"]
    assert quant == {"method": "w4", "group_size": 128, "algorithm": "awq", "calibration": "builtin"}
    with pytest.raises(ValueError, match="calib_text='/nonexistent.txt' is not a file"):
        convert_checkpoint(smollm2_gguf, tmp_path / "x", quant="w4", calib_text="/nonexistent.txt")
