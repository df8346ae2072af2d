"""AWQ import (TurboMind's model_format="awq"): a tiny random Llama quantized and packed here the way
AutoAWQ's GEMM format stores it (qweight / qzeros int32 in the order [0, 2, 4, 6, 1, 3, 5, 7], scales
float16), loaded into w4 QuantLinears, and compared in float32 with transformers running the same
dequantized weights."""
import json
import os

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import save_file

from lmjax.layers.quant import QuantLinear
from lmjax.loader.awq import AWQ_ORDER, awq_spec, pack_awq, unpack_awq
from lmjax.loader.model_loader import load_model
from lmjax.models.forward import prompt_logits
from test_convert import TINY, _write_tokenizer

GROUP = 32  # hidden 64 and intermediate 128: 2 and 4 groups
PROMPTS = [[1, 5, 9, 13, 17, 21], [1, 40, 41]]


def test_unpack_follows_autoawq_packing_order():
    codes = np.arange(16, dtype=np.uint8).reshape(1, 16) % 16
    packed = pack_awq(codes)
    assert packed.dtype == np.int32 and packed.shape == (1, 2)
    # AutoAWQ: nibble k of packed column c holds output column 8c + AWQ_ORDER[k]
    word = int(packed[0, 0]) & 0xFFFFFFFF
    assert [(word >> (4 * k)) & 0xF for k in range(8)] == [codes[0, AWQ_ORDER[k]] for k in range(8)]
    assert np.array_equal(unpack_awq(packed), codes)
    rng = np.random.default_rng(0)
    big = rng.integers(0, 16, (5, 64)).astype(np.uint8)
    assert np.array_equal(unpack_awq(pack_awq(big)), big)


def _awq_quantize(w_OI: np.ndarray):
    """AutoAWQ-style asymmetric int4 of a torch [out, in] weight in groups along `in`: (qweight, qzeros,
    scales) and the dequantized weight the checkpoint then means."""
    O, I = w_OI.shape
    w = w_OI.reshape(O, I // GROUP, GROUP)
    lo, hi = w.min(-1, keepdims=True), w.max(-1, keepdims=True)
    scales = ((hi - lo) / 15).astype(np.float16).astype(np.float32)
    zeros = np.clip(np.round(-lo / scales), 0, 15)
    codes = np.clip(np.round(w / scales) + zeros, 0, 15)
    dequant = ((codes - zeros) * scales).reshape(O, I)
    qweight = pack_awq(codes.reshape(O, I).T.astype(np.uint8))  # AutoAWQ packs intweight [in, out]
    qzeros = pack_awq(zeros[..., 0].T.astype(np.uint8))
    return qweight, qzeros, scales[..., 0].T.astype(np.float16), dequant


@pytest.fixture(scope="module")
def awq_pair(tmp_path_factory):
    """(AWQ checkpoint dir, float checkpoint dir with the dequantized weights)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    float_dir, awq_dir = (str(tmp_path_factory.mktemp(n)) for n in ("awq-dequant", "awq"))
    tensors = {}
    state = model.state_dict()
    for name, w in list(state.items()):
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            qweight, qzeros, scales, dequant = _awq_quantize(w.numpy())
            prefix = name.removesuffix(".weight")
            tensors.update({f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros, f"{prefix}.scales": scales})
            state[name] = torch.from_numpy(dequant)
        else:
            tensors[name] = w.numpy()
    model.load_state_dict(state)
    model.save_pretrained(float_dir)
    model.config.save_pretrained(awq_dir)
    config = json.load(open(os.path.join(awq_dir, "config.json")))
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                     "version": "gemm"}
    json.dump(config, open(os.path.join(awq_dir, "config.json"), "w"))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(awq_dir, "model.safetensors"))
    for d in (float_dir, awq_dir):
        _write_tokenizer(TINY["vocab_size"], d)
    return awq_dir, float_dir


def test_awq_checkpoint_loads_into_w4_and_matches_its_dequantized_weights(awq_pair):
    awq_dir, float_dir = awq_pair
    loaded = load_model(awq_dir, "float32")
    q_proj = loaded.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, QuantLinear) and q_proj.kernel[...].dtype == np.uint8
    assert q_proj.kernel[...].shape == (TINY["hidden_size"] // 2, 64) and q_proj.spec.group_size == GROUP
    reference = transformers.LlamaForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    got = prompt_logits(loaded.model, PROMPTS)
    for ids, logits in zip(PROMPTS, got):
        with torch.no_grad():
            want = reference(torch.tensor([ids])).logits[0].numpy()
        np.testing.assert_allclose(logits, want, atol=2e-4, rtol=1e-4)


def test_turbomind_model_format_awq_runs_the_checkpoint(awq_pair):
    import lmjax
    from lmjax.config import GenerationConfig
    from lmjax.lmdeploy_config import TurbomindEngineConfig

    awq_dir, float_dir = awq_pair
    gen = GenerationConfig(max_new_tokens=6, top_k=1, ignore_eos=True)
    pipe = lmjax.pipeline(awq_dir, backend_config=TurbomindEngineConfig(model_format="awq", dtype="float32",
                                                                        session_len=64, cache_max_entry_count=0.01))
    ref = lmjax.pipeline(float_dir, backend_config=TurbomindEngineConfig(dtype="float32", session_len=64,
                                                                         cache_max_entry_count=0.01))
    prompt = "t1 t5 t9 t13"
    assert pipe([prompt], gen_config=gen)[0].token_ids == ref([prompt], gen_config=gen)[0].token_ids
    # vLLM's spelling; a declaration that does not match the checkpoint is named, not loaded
    llm = lmjax.LLM(awq_dir, quantization="awq", dtype="float32", max_model_len=64, gpu_memory_utilization=0.01)
    greedy = lmjax.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == \
        ref([prompt], gen_config=gen)[0].token_ids
    with pytest.raises(ValueError, match="is not an AWQ checkpoint"):
        lmjax.LLM(float_dir, quantization="awq")
    with pytest.raises(ValueError, match=r"model_format='awq'\), but .* is not an AWQ checkpoint"):
        lmjax.pipeline(float_dir, backend_config=TurbomindEngineConfig(model_format="awq"))
    with pytest.raises(NotImplementedError, match="quantization='gptq'"):
        lmjax.LLM(awq_dir, quantization="gptq")


def test_awq_checkpoint_converts_only_to_its_own_w4_layout(awq_pair, tmp_path):
    """Converting it to float or w8 wrote a directory that did not load (its loader builds w4 layers
    that quantize_model skips), and exited 0; in its own layout it is stored as it is."""
    from convert import convert_checkpoint

    awq_dir, _ = awq_pair
    for kwargs in ({}, {"quant": "w8"}, {"quant": "w4", "group_size": 128}):
        with pytest.raises(ValueError, match=rf"is already quantized \(w4, group_size {GROUP}\)"):
            convert_checkpoint(awq_dir, tmp_path / "out", dtype="float32", **kwargs)
    assert os.listdir(tmp_path) == []
    out = convert_checkpoint(awq_dir, tmp_path / "out", dtype="float32", quant="w4", group_size=GROUP)
    assert json.load(open(os.path.join(out, "config.json")))["lmjax"]["quant"] == {
        "method": "w4", "group_size": GROUP, "algorithm": "awq", "calibration": "AWQ checkpoint"}
    got = prompt_logits(load_model(out, "float32").model, PROMPTS)
    for g, w in zip(got, prompt_logits(load_model(awq_dir, "float32").model, PROMPTS)):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("field, value, message", [
    ("bits", 8, "AWQ bits=8 is not supported"),
    ("version", "gemv", "AWQ version='gemv' is not supported"),
    ("zero_point", False, "zero_point=False is not supported"),
])
def test_unsupported_awq_variants_name_the_value(field, value, message):
    config = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    with pytest.raises(NotImplementedError, match=message):
        awq_spec({"quantization_config": {**config, field: value}})
    assert awq_spec({"quantization_config": config}).group_size == 128
    assert awq_spec({}) is None
