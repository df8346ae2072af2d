"""Review 33 of config parsing against transformers (float32 logits on the same weights): a GGUF of Llama 3.1+
carries its llama3 RoPE only as llama.cpp's rope_freqs tensor (was ignored: the default RoPE ran); a top-level
original_max_position_embeddings wins for llama3 (transformers' standardize_rope_params); pretraining_tp (read no
more by transformers 5) loads; beside model.safetensors another *.safetensors (Mistral's consolidated) is not
read; partial_rotary_factor warns that transformers rotates the whole head."""
import json
import math
import os

import numpy as np
import pytest
import torch
import transformers

from lmjax.loader.model_loader import load_model
from lmjax.models.forward import prompt_logits

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1, tie_word_embeddings=False)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
PROMPT = list(np.random.default_rng(1).integers(0, 128, 60))  # past original_max_position_embeddings


def _save(path, edit=None, **overrides):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**BASE, **overrides})).eval()
    model.save_pretrained(path)
    if edit:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        edit(config)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
    return str(path)


def _max_diff(source: str, hf_dir: str) -> float:
    ours = prompt_logits(load_model(source, dtype="float32").model, [PROMPT])[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0].numpy()
    return float(np.abs(ours - want).max())


def _llama_cpp_freq_factors(head_dim: int, theta: float = 10000.0) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for LLAMA3 (each frequency's divisor)."""
    old, factors = LLAMA3["original_max_position_embeddings"], []
    for freq in 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / LLAMA3["high_freq_factor"]:
            factors.append(1.0)
        elif wavelen > old / LLAMA3["low_freq_factor"]:
            factors.append(LLAMA3["factor"])
        else:
            smooth = (old / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / LLAMA3["factor"] + smooth))
    return np.asarray(factors, np.float32)


def _write_gguf(path, hf_dir: str):
    """hf_dir's weights as llama.cpp writes a Llama 3.1 GGUF: no rope.scaling keys, a rope_freqs tensor."""
    import gguf

    from safetensors.numpy import load_file
    sd = load_file(os.path.join(hf_dir, "model.safetensors"))
    c = transformers.LlamaConfig.from_pretrained(hf_dir)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers), w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size), w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads), w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps), w.add_rope_freq_base(10000.0), w.add_vocab_size(c.vocab_size)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"]), w.add_tensor("output.weight", sd["lm_head.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    for i in range(c.num_hidden_layers):
        for name, hf_name in names.items():
            t = sd[f"model.layers.{i}.{hf_name}.weight"]
            heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}.get(name)
            if heads:  # llama.cpp's q / k row order
                t = t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
            w.add_tensor(f"blk.{i}.{name}.weight", np.ascontiguousarray(t))
    w.add_tensor("rope_freqs.weight", _llama_cpp_freq_factors(c.hidden_size // c.num_attention_heads))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return str(path)


def test_gguf_llama3_rope_freqs(tmp_path):
    hf_dir = _save(tmp_path / "hf", rope_scaling=LLAMA3)
    assert _max_diff(_write_gguf(tmp_path / "llama31.gguf", hf_dir), hf_dir) < 1e-4


def test_top_level_original_max_position_embeddings_wins_for_llama3(tmp_path):
    hf_dir = _save(tmp_path / "hf", rope_scaling=LLAMA3,
                   edit=lambda c: c.update(original_max_position_embeddings=64))
    # (transformers' model takes 64, though its AutoConfig still says 16: the logits are the reference)
    assert _max_diff(hf_dir, hf_dir) < 1e-4


def test_pretraining_tp_loads(tmp_path):
    hf_dir = _save(tmp_path / "hf", pretraining_tp=2)
    assert _max_diff(hf_dir, hf_dir) < 1e-4


def test_other_safetensors_beside_model_safetensors_are_not_read(tmp_path):
    from safetensors.numpy import save_file

    hf_dir = _save(tmp_path / "hf")
    save_file({"layers.0.attention.wq.weight": np.zeros((64, 64), np.float32)},
              os.path.join(hf_dir, "consolidated.safetensors"))
    assert _max_diff(hf_dir, hf_dir) < 1e-4


def test_partial_rotary_factor_warns(tmp_path, caplog):
    hf_dir = _save(tmp_path / "hf", edit=lambda c: c.update(partial_rotary_factor=0.5))
    with caplog.at_level("WARNING", logger="lmjax.models"):
        load_model(hf_dir, dtype="float32")
    assert "partial_rotary_factor=0.5: only the first 8 of 16 head dims rotate" in caplog.text


def test_bad_freq_factors_refused():
    from pallas_kernels.rope import RopeSpec

    with pytest.raises(ValueError, match="freq_factors must be 8 positive floats"):
        RopeSpec(rotary_dim=16, freq_factors=(1.0,) * 7)
