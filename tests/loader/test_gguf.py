"""GGUF loader and tokenizer: parity with transformers' own GGUF loader on SmolLM2-135M (Q4_1),
plus tiny GGUF files written here for the Q/K permutation and the error paths."""
import os

import numpy as np
import pytest

from lmjax.loader.gguf import GGUFError, gguf_config, hf_tensor_name, load_gguf, unpermute_qk
from lmjax.loader.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def ours(smollm2_gguf):
    return load_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    """transformers' model loaded from the same GGUF: (config, state dict as numpy)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf), dtype=torch.float32)
    return model.config, {k: v.numpy() for k, v in model.state_dict().items()}


def test_weights_match_transformers(ours, reference):
    config, weights = ours
    ref_config, ref = reference
    assert config["tie_word_embeddings"] and "lm_head.weight" not in weights
    assert set(weights) == set(ref) - {"lm_head.weight"}
    assert all(type(w) is np.ndarray for w in weights.values())  # no views of the mmapped file
    for name, ref_value in ref.items():
        if name == "lm_head.weight":
            continue
        assert weights[name].dtype == np.float32
        assert weights[name].shape == ref_value.shape, name
        assert np.max(np.abs(weights[name] - ref_value)) <= 1e-6, name


def test_config_matches_transformers(ours, reference):
    config, _ = ours
    ref, _ = reference
    assert config["architectures"] == ["LlamaForCausalLM"]
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "num_hidden_layers", "head_dim", "rms_norm_eps", "vocab_size", "tie_word_embeddings",
                "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert config[key] == getattr(ref, key), key
    assert config["rope_theta"] == ref.rope_parameters["rope_theta"] == 100000.0
    assert config["rope_scaling"] is None


def test_gguf_config_alone(smollm2_gguf, ours):
    assert gguf_config(smollm2_gguf) == ours[0]


def test_tokenizer_from_gguf(smollm2_gguf):
    tok = load_tokenizer(smollm2_gguf)
    assert load_tokenizer(os.path.dirname(smollm2_gguf) + "/x", smollm2_gguf) is tok  # cached
    text = "Hello, world! JAX runs on TPUs and GPUs."
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.chat_template
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert "<|im_start|>user\nHi<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n")


def test_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_tokenizer(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        load_tokenizer(str(tmp_path / "empty"))


# ---------------------------------------------------------------- tiny GGUF files written by the test


def _llama_cpp_permute(w, n_head):
    """The row permutation llama.cpp's convert_hf_to_gguf applies to q_proj / k_proj."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_qk(_llama_cpp_permute(w, 3), 3), w)
    np.testing.assert_array_equal(unpermute_qk(_llama_cpp_permute(w[:, 0], 3), 3), w[:, 0])


def _write_tiny(path, arch="llama", extra=None):
    """A 1-layer model: hidden 8, 2 heads of 4, 1 kv head, ffn 12, vocab 10, untied. Returns HF weights."""
    import gguf

    rng = np.random.default_rng(1)
    hf = {"model.embed_tokens.weight": (10, 8), "lm_head.weight": (10, 8), "model.norm.weight": (8,),
          "model.layers.0.self_attn.q_proj.weight": (8, 8), "model.layers.0.self_attn.k_proj.weight": (4, 8),
          "model.layers.0.self_attn.v_proj.weight": (4, 8), "model.layers.0.self_attn.o_proj.weight": (8, 8),
          "model.layers.0.mlp.gate_proj.weight": (12, 8), "model.layers.0.mlp.up_proj.weight": (12, 8),
          "model.layers.0.mlp.down_proj.weight": (8, 12), "model.layers.0.input_layernorm.weight": (8,),
          "model.layers.0.post_attention_layernorm.weight": (8,)}
    hf = {k: rng.standard_normal(s).astype(np.float32) for k, s in hf.items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1), w.add_context_length(32), w.add_embedding_length(8), w.add_feed_forward_length(12)
    w.add_head_count(2), w.add_head_count_kv(1), w.add_layer_norm_rms_eps(1e-5), w.add_rope_freq_base(1e4)
    w.add_vocab_size(10)
    w.add_string(f"{arch}.rope.scaling.type", "linear"), w.add_float32(f"{arch}.rope.scaling.factor", 2.0)
    gguf_names = {"token_embd.weight", "output.weight", "output_norm.weight"} | {
        f"blk.0.{m}.weight" for m in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                      "ffn_down", "attn_norm", "ffn_norm")}
    for name in sorted(gguf_names):
        value = hf[hf_tensor_name(name)]
        if arch == "llama" and ".attn_q." in name:
            value = _llama_cpp_permute(value, 2)
        if arch == "llama" and ".attn_k." in name:
            value = _llama_cpp_permute(value, 1)
        is_mlp = name.endswith(("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"))
        w.add_tensor(name, value.astype(np.float16) if is_mlp else value)  # F16 path too
    for name, value in (extra or {}).items():
        w.add_tensor(name, value)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return hf


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_roundtrip(tmp_path, arch):
    hf = _write_tiny(tmp_path / "tiny.gguf", arch)
    config, weights = load_gguf(str(tmp_path / "tiny.gguf"))
    assert set(weights) == set(hf) and not config["tie_word_embeddings"]
    for name, value in hf.items():
        atol = 1e-3 if ".mlp." in name else 0  # the test stored the MLP as F16
        np.testing.assert_allclose(weights[name], value, atol=atol, rtol=atol, err_msg=name)
    assert config["num_key_value_heads"] == 1 and config["head_dim"] == 4
    assert config["rope_scaling"] == {"rope_type": "linear", "type": "linear", "factor": 2.0}
    assert config["rope_parameters"]["factor"] == 2.0


def test_reader_is_shared_until_the_file_changes(tmp_path):
    """The parsed reader serves the tokenizer, config and weights of one load; a file rewritten at the
    same path is read again, never served stale."""
    import os

    from lmjax.loader.gguf import open_gguf

    path = tmp_path / "tiny.gguf"
    _write_tiny(path, "llama")
    first = open_gguf(str(path))
    assert open_gguf(str(path)) is first and type(first.data) is np.ndarray  # a plain view, not np.memmap
    hf = _write_tiny(path, "qwen2")
    os.utime(path, ns=(0, os.stat(path).st_mtime_ns + 1))  # a new mtime even on a coarse clock
    second = open_gguf(str(path))
    assert second is not first and second.fields["general.architecture"].contents() == "qwen2"
    config, weights = load_gguf(str(path))
    assert config["model_type"] == "qwen2" and set(weights) == set(hf)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        load_gguf(str(tmp_path / "missing.gguf"))


def test_bad_magic(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(GGUFError, match="junk.gguf.*magic"):
        load_gguf(str(path))


def test_truncated_copy(tmp_path, smollm2_gguf):
    path = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as src:
        path.write_bytes(src.read(4_000_000))
    with pytest.raises(GGUFError, match="cut.gguf"):
        load_gguf(str(path))


def test_unsupported_architecture(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(GGUFError, match="gpt2.gguf.*'gpt2'"):
        load_gguf(str(path))


def test_unsupported_tensor_type(tmp_path):
    path = tmp_path / "ints.gguf"
    _write_tiny(path, extra={"blk.0.attn_v.bias": np.arange(4, dtype=np.int32)})
    with pytest.raises(GGUFError, match=r"ints.gguf.*blk\.0\.attn_v\.bias.*I32"):
        load_gguf(str(path))


def test_unknown_tensor_name(tmp_path):
    path = tmp_path / "odd.gguf"
    _write_tiny(path, extra={"blk.0.mystery.weight": np.zeros(4, np.float32)})
    with pytest.raises(GGUFError, match=r"odd.gguf.*blk\.0\.mystery\.weight"):
        load_gguf(str(path))


def test_llm_checks_max_model_len_from_the_gguf_metadata(smollm2_gguf, monkeypatch):
    """vLLM's max_model_len bound, checked from the GGUF's metadata before any weight is read."""
    from lmjax import LLM

    monkeypatch.setattr("lmjax.engine.engine.load_model", lambda *a, **k: pytest.fail("loaded the weights"))
    with pytest.raises(ValueError, match="max_model_len=8193 is longer than the model's context of 8192 tokens"):
        LLM(smollm2_gguf, max_model_len=8193)
