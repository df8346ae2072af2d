"""AWQ checkpoints whose `quantization_config.modules_to_not_convert` keeps some Linears float (AutoAWQ writes
e.g. ["down_proj"] or ["visual"]; their tensors are a plain `weight`, not qweight / qzeros / scales).

vLLM keeps every Linear whose name contains an entry unquantized (is_layer_skipped_awq); lmjax ignored the list,
built w4 layers there and failed with a shape error, in load_model and in `lmjax convert` alike. Each case is
compared in float32 with transformers running the dequantized weights (the float layers as stored), as
test_awq.py does. A group lmjax merges at run time (q/k/v, gate/up) may be part float, part int4: it stays
unmerged, each member as stored."""
import json
import os

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import save_file

from lmjax.layers.linear import Linear
from lmjax.layers.quant import QuantLinear, QuantSpec
from lmjax.loader.model_loader import load_model
from lmjax.loader.safetensors_loader import CheckpointError
from lmjax.models.forward import greedy_generate, prompt_logits
from test_awq import GROUP, PROMPTS, _awq_quantize
from test_convert import TINY, _write_tokenizer

MIXED = ["layers.0.self_attn.q_proj", "layers.1.self_attn", "gate_proj"]  # q float, k/v int4 in layer 0


def _write_awq(root, skip, quantize=None):
    """(AWQ dir, float dir with the dequantized weights): each decoder projection is AWQ-packed unless an
    entry of `skip` is in its name (`quantize` overrides which), and config.json lists `skip`."""
    quantize = quantize or (lambda name: not any(s in name for s in skip))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    awq_dir, float_dir = str(root / "awq"), str(root / "dequant")
    tensors, state = {}, model.state_dict()
    for name, w in list(state.items()):
        if name.startswith("model.layers.") and name.endswith("_proj.weight") and quantize(name):
            qweight, qzeros, scales, dequant = _awq_quantize(w.numpy())
            prefix = name.removesuffix(".weight")
            tensors.update({f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros, f"{prefix}.scales": scales})
            state[name] = torch.from_numpy(dequant)
        else:
            tensors[name] = w.numpy().astype(np.float16)  # AutoAWQ saves its float layers in float16
            state[name] = torch.from_numpy(tensors[name].astype(np.float32))
    model.load_state_dict(state)
    model.save_pretrained(float_dir)
    model.config.save_pretrained(awq_dir)
    config = _read_json(os.path.join(awq_dir, "config.json"))
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                     "version": "gemm", "modules_to_not_convert": skip}
    with open(os.path.join(awq_dir, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(awq_dir, "model.safetensors"))
    for d in (float_dir, awq_dir):
        _write_tokenizer(TINY["vocab_size"], d)
    return awq_dir, float_dir


def _read_json(path):
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def down_float(tmp_path_factory):
    return _write_awq(tmp_path_factory.mktemp("awq-down"), ["down_proj"])


@pytest.fixture(scope="module")
def mixed_groups(tmp_path_factory):
    return _write_awq(tmp_path_factory.mktemp("awq-mixed"), MIXED)


def _assert_matches_reference(model, float_dir):
    reference = transformers.LlamaForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    for ids, logits in zip(PROMPTS, prompt_logits(model, PROMPTS)):
        with torch.no_grad():
            want = reference(torch.tensor([ids])).logits[0].numpy()
        np.testing.assert_allclose(logits, want, atol=2e-4, rtol=1e-4)


def test_skipped_modules_load_float_and_match_the_reference(down_float):
    awq_dir, float_dir = down_float
    model = load_model(awq_dir, "float32").model
    for layer in model.layers:
        assert type(layer.mlp.down_proj) is Linear and layer.mlp.down_proj.kernel[...].dtype == np.float32
        assert isinstance(layer.mlp.up_proj, QuantLinear) and isinstance(layer.self_attn.q_proj, QuantLinear)
    _assert_matches_reference(model, float_dir)


def test_convert_records_the_skip_list_and_restores_the_same_layout(down_float, tmp_path):
    from convert import convert_checkpoint

    awq_dir, float_dir = down_float
    out = convert_checkpoint(awq_dir, tmp_path / "out", dtype="float32", quant="w4", group_size=GROUP)
    assert _read_json(os.path.join(out, "config.json"))["lmjax"]["quant"] == {
        "method": "w4", "group_size": GROUP, "modules_to_not_convert": ["down_proj"], "algorithm": "awq",
        "calibration": "AWQ checkpoint"}
    restored = load_model(out, "float32").model
    mlp = restored.layers[0].mlp
    assert type(mlp.down_proj) is Linear and isinstance(mlp.up_proj, QuantLinear)
    direct = prompt_logits(load_model(awq_dir, "float32").model, PROMPTS)
    for got, want in zip(prompt_logits(restored, PROMPTS), direct):
        np.testing.assert_array_equal(got, want)
    _assert_matches_reference(restored, float_dir)
    with pytest.raises(ValueError, match=rf"is already quantized \(w4, group_size {GROUP}\)"):
        convert_checkpoint(awq_dir, tmp_path / "w8", dtype="float32", quant="w8")


def test_llm_greedy_tokens_match_the_dequantized_model(down_float):
    import lmjax

    awq_dir, float_dir = down_float
    want = greedy_generate(load_model(float_dir, "float32").model, PROMPTS, 6)
    llm = lmjax.LLM(awq_dir, quantization="awq", dtype="float32", max_model_len=64, gpu_memory_utilization=0.01)
    greedy = lmjax.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], greedy, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == want


def test_part_float_merge_groups_stay_unmerged_and_match(mixed_groups):
    """q_proj float beside int4 k/v (layer 0), gate float beside int4 up: each member as stored, the group
    left unmerged (merge_linears declines a float + int4 mix); layer 1's all-float q/k/v still merges."""
    awq_dir, float_dir = mixed_groups
    model = load_model(awq_dir, "float32").model
    attn0, attn1 = model.layers[0].self_attn, model.layers[1].self_attn
    assert type(attn0.q_proj) is Linear and isinstance(attn0.k_proj, QuantLinear)
    assert all(type(p) is Linear for p in (attn1.q_proj, attn1.k_proj, attn1.v_proj, attn1.o_proj))
    assert all(type(x.mlp.gate_proj) is Linear and isinstance(x.mlp.up_proj, QuantLinear) for x in model.layers)
    before = prompt_logits(model, PROMPTS)
    assert model.merge_qkv() == 1 and attn0.qkv_proj is None and type(attn1.qkv_proj) is Linear
    assert model.merge_gate_up() == 0
    for got, want in zip(prompt_logits(model, PROMPTS), before):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    _assert_matches_reference(model, float_dir)


def test_part_float_merge_groups_through_llm_and_convert(mixed_groups, tmp_path, monkeypatch):
    import lmjax
    from convert import convert_checkpoint

    monkeypatch.setenv("LMJAX_MERGE_GATE_UP", "1")  # the engine tries the gate/up merge on CPU too
    awq_dir, float_dir = mixed_groups
    want = greedy_generate(load_model(float_dir, "float32").model, PROMPTS, 6)
    out = convert_checkpoint(awq_dir, tmp_path / "out", dtype="float32", quant="w4", group_size=GROUP)
    assert _read_json(os.path.join(out, "config.json"))["lmjax"]["quant"]["modules_to_not_convert"] == MIXED
    for path in (awq_dir, out):
        llm = lmjax.LLM(path, dtype="float32", max_model_len=64, gpu_memory_utilization=0.01)
        greedy = lmjax.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], greedy, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == want, path


def test_a_quantized_tensor_of_a_skipped_module_is_named(tmp_path):
    """modules_to_not_convert says float but the checkpoint holds qweight: the error names both (it was a
    shape error about another tensor)."""
    awq_dir, _ = _write_awq(tmp_path, ["down_proj"], quantize=lambda name: True)
    with pytest.raises(CheckpointError, match=r"down_proj\.qweight.*modules_to_not_convert \['down_proj'\] keeps"):
        load_model(awq_dir, "float32")


def test_skip_list_spec_and_checkpoint_names():
    from lmjax.loader.awq import awq_spec, checkpoint_module_name

    config = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    for value in (None, []):  # AutoAWQ writes null when nothing is skipped: the spec (and its record) as before
        spec = awq_spec({"quantization_config": {**config, "modules_to_not_convert": value}})
        assert spec == QuantSpec("w4", 128) and spec.to_dict() == {"method": "w4", "group_size": 128}
    spec = awq_spec({"quantization_config": {**config, "modules_to_not_convert": ["visual", "down_proj"]}})
    assert spec.skip == ("visual", "down_proj") and QuantSpec.from_dict(spec.to_dict()) == spec
    assert spec.keeps_float("model.layers.3.mlp.down_proj") and not spec.keeps_float("model.layers.3.mlp.up_proj")
    for bad in ("down_proj", [""], [3]):
        with pytest.raises(CheckpointError, match="modules_to_not_convert"):
            awq_spec({"quantization_config": {**config, "modules_to_not_convert": bad}})
    # vLLM matches the checkpoint's own names: InternLM2's q/k/v are its one packed wqkv
    internlm2 = checkpoint_module_name("InternLM2ForCausalLM")
    assert internlm2(("layers", 0, "self_attn", "k_proj")) == "model.layers.0.attention.wqkv"
    assert internlm2(("layers", 2, "mlp", "down_proj")) == "model.layers.2.feed_forward.w2"
    assert checkpoint_module_name("LlamaForCausalLM")(("layers", 0, "mlp", "up_proj")) == "model.layers.0.mlp.up_proj"


def _write_internlm2(root, skip):
    """(AWQ dir, float dir) of a tiny InternLM2 (test_awq_internlm2's packing): every Linear AWQ-packed but
    those an entry of `skip` names (InternLM2's own names: wqkv, w2, ...), which stay float in both."""
    import test_awq_internlm2 as i2

    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**i2.CFG))
    sd = {k: v.numpy() for k, v in llama.state_dict().items()}
    common = {"model.tok_embeddings.weight": sd["model.embed_tokens.weight"],
              "model.norm.weight": sd["model.norm.weight"], "output.weight": sd["lm_head.weight"]}
    awq, dequant = dict(common), dict(common)
    for i in range(i2.CFG["num_hidden_layers"]):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        linears = {p + "attention.wqkv": i2._pack_wqkv(*(sd[a + f"{x}_proj.weight"] for x in "qkv")),
                   p + "attention.wo": sd[a + "o_proj.weight"]}
        for new, old in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            linears[p + f"feed_forward.{new}"] = sd[p + f"mlp.{old}.weight"]
        for name, w in linears.items():
            if any(s in name for s in skip):
                awq[f"{name}.weight"] = dequant[f"{name}.weight"] = w
                continue
            (qw, qz, sc), dequant[f"{name}.weight"] = i2._awq(w)
            awq.update({f"{name}.qweight": qw, f"{name}.qzeros": qz, f"{name}.scales": sc})
        for new, old in (("attention_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")):
            awq[p + f"{new}.weight"] = dequant[p + f"{new}.weight"] = sd[p + f"{old}.weight"]
    config = {**i2.CFG, "architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2", "bias": False,
              "rope_theta": 10000.0, "hidden_act": "silu"}
    quant = {"quant_method": "awq", "bits": 4, "group_size": i2.G, "zero_point": True, "version": "gemm",
             "modules_to_not_convert": skip}
    dirs = []
    for name, tensors, extra in (("awq", awq, {"quantization_config": quant}), ("dequant", dequant, {})):
        (root / name).mkdir()
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(root / name / "model.safetensors"))
        (root / name / "config.json").write_text(json.dumps({**config, **extra}))
        dirs.append(str(root / name))
    return dirs


def test_internlm2_skip_list_names_its_own_modules(tmp_path):
    """vLLM matches InternLM2's own names: ["wqkv", "w2"] keeps the q/k/v and down projections lmjax loads
    them into float."""
    awq_dir, float_dir = _write_internlm2(tmp_path, ["wqkv", "w2"])
    model = load_model(awq_dir, "float32").model
    for layer in model.layers:
        assert all(type(p) is Linear for p in (layer.self_attn.q_proj, layer.self_attn.v_proj, layer.mlp.down_proj))
        assert isinstance(layer.mlp.gate_proj, QuantLinear) and isinstance(layer.self_attn.o_proj, QuantLinear)
    reference = load_model(float_dir, "float32").model
    for got, want in zip(prompt_logits(model, PROMPTS), prompt_logits(reference, PROMPTS)):
        np.testing.assert_allclose(got, want, atol=1e-4)
