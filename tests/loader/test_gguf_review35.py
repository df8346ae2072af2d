"""GGUF review (session 35), against transformers on the same weights written as llama.cpp writes them: Qwen3
files load (q/k norms; lmjax ran Qwen3 only from HF directories); a llama file whose attention has q/k/v biases
and no output bias (a "llamafied" Qwen2, which llama.cpp loads) loads (it asked for o_proj biases); a shard of a
split GGUF, a rope.dimension_count other than the head dimension and Q/K rows that do not fit the head count are
refused naming the file (and the tensor)."""
import numpy as np
import pytest
import torch

from lmjax.loader.gguf import GGUFError, load_gguf

PROMPT = [3, 17, 42, 5, 99, 7]
# llama.cpp's tensor names of a layer's HF parameters
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def _gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:  # llama.cpp's converter, for arch llama
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write(model, path, arch: str, extra: dict | None = None, kv_heads: int | None = None, **writer_kwargs) -> str:
    """The HF model's weights and config as a GGUF file of `arch` (Q/K rows permuted for llama); `kv_heads`:
    the KV head count the file says, if not the model's."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), arch, **writer_kwargs)
    w.add_block_count(c.num_hidden_layers), w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size), w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads), w.add_head_count_kv(kv_heads or c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim), w.add_value_length(head_dim), w.add_vocab_size(c.vocab_size)
    w.add_layer_norm_rms_eps(c.rms_norm_eps), w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    for key, value in (extra or {}).items():
        w.add_uint32(key, value)
    for name, t in model.state_dict().items():
        value = t.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            value = _permute(value, c.num_attention_heads)
        if arch == "llama" and ".k_proj." in name:
            value = _permute(value, c.num_key_value_heads)
        w.add_tensor(_gguf_name(name), np.ascontiguousarray(value))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return str(path)


def _hf(kind: str):
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    if kind == "qwen3":
        config = transformers.Qwen3Config(head_dim=32, **common)  # head_dim != hidden / heads, as Qwen3's
        return transformers.Qwen3ForCausalLM(config).eval()
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()
    with torch.no_grad():  # biases worth seeing (transformers initializes them to zero)
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def _logits_match(model, path):
    from lmjax.loader.model_loader import load_model
    from lmjax.models.forward import prompt_logits

    ours = np.asarray(prompt_logits(load_model(path, dtype="float32").model, [PROMPT])[0])
    with torch.no_grad():
        want = model(torch.tensor([PROMPT])).logits[0].numpy()
    np.testing.assert_allclose(ours, want, atol=2e-4, rtol=2e-4)


def test_a_qwen3_gguf_matches_transformers(tmp_path):
    model = _hf("qwen3")
    path = _write(model, tmp_path / "qwen3.gguf", "qwen3")
    _logits_match(model, path)


def test_a_llama_gguf_with_qkv_biases_and_no_output_bias(tmp_path):
    """A Qwen2 written as arch llama (llama.cpp's "llamafied" Qwen): q/k/v biases, no attn_output bias."""
    model = _hf("qwen2")
    path = _write(model, tmp_path / "llamafied.gguf", "llama")
    config, weights = load_gguf(path)
    assert "model.layers.0.self_attn.q_proj.bias" in weights and "model.layers.0.self_attn.o_proj.bias" not in weights
    _logits_match(model, path)


def test_a_shard_of_a_split_gguf_is_refused(tmp_path):
    _write(_hf("qwen3"), tmp_path / "m.gguf", "qwen3", split_max_tensors=13)  # 25 tensors: 2 files
    for shard in (1, 2):
        with pytest.raises(GGUFError, match=rf"m-0000{shard}-of-00002.gguf: shard {shard} of a GGUF split in 2 "
                                            r"files.*llama-gguf-split --merge"):
            load_gguf(str(tmp_path / f"m-0000{shard}-of-00002.gguf"))


def test_a_partial_rope_dimension_is_refused(tmp_path):
    path = _write(_hf("qwen3"), tmp_path / "partial.gguf", "qwen3", extra={"qwen3.rope.dimension_count": 16})
    with pytest.raises(GGUFError, match=r"partial.gguf: qwen3.rope.dimension_count=16 differs from the head "
                                        r"dimension 32"):
        load_gguf(path)


def test_qk_rows_that_do_not_fit_the_heads_name_the_tensor(tmp_path):
    path = _write(_hf("qwen2"), tmp_path / "heads.gguf", "llama", kv_heads=3)  # attn_k holds 2 heads' rows
    with pytest.raises(GGUFError, match=r"heads.gguf: tensor 'blk.0.attn_k.weight' does not fit the head count"):
        load_gguf(path)
