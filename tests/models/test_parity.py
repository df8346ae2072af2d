"""lmjax float32 logits at every position vs transformers' PyTorch forward on the same tiny random
checkpoints, for every architecture and RoPE variant (dynamic NTK beyond max_position_embeddings too)."""
import numpy as np
import pytest
import torch
import transformers

from lmjax.loader.model_loader import load_model
from lmjax.models.forward import prompt_logits

TOL = 1e-4
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)

CASES = {
    "llama": (transformers.LlamaConfig, {}),
    "llama-tied-bias": (transformers.LlamaConfig, dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "llama-head-dim": (transformers.LlamaConfig, dict(head_dim=32, num_key_value_heads=1)),
    "llama-linear": (transformers.LlamaConfig, dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama-dynamic": (transformers.LlamaConfig, dict(max_position_embeddings=24,
                                                     rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "llama3": (transformers.LlamaConfig, dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})),
    "qwen2": (transformers.Qwen2Config, {}),
    "mistral-window": (transformers.MistralConfig, dict(sliding_window=8)),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=16)),
}


def _save(tmp_path, cfg_cls, overrides, seed=0):
    torch.manual_seed(seed)
    config = cfg_cls(**{**BASE, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path, max_shard_size="100KB")  # sharded: exercises the index path
    return model


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def _prompts(rng, lengths, vocab=128):
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path, case):
    cfg_cls, overrides = CASES[case]
    hf_model = _save(tmp_path, cfg_cls, overrides)
    loaded = load_model(str(tmp_path), dtype="float32")
    # Ragged batch: one short, one crossing blocks, one past max_position_embeddings for dynamic NTK.
    prompts = _prompts(np.random.default_rng(1), [5, 21, 40])
    ours = prompt_logits(loaded.model, prompts, block_size=8)
    for ids, got in zip(prompts, ours):
        want = _hf_logits(hf_model, ids)
        assert got.shape == want.shape
        assert np.max(np.abs(got - want)) <= TOL, f"{case}: max diff {np.max(np.abs(got - want))}"


def test_dynamic_ntk_changes_logits_past_max_position(tmp_path):
    """Guard against a dynamic variant that silently acts like the default one."""
    hf_model = _save(tmp_path, transformers.LlamaConfig,
                     dict(max_position_embeddings=16, rope_scaling={"rope_type": "dynamic", "factor": 4.0}))
    loaded = load_model(str(tmp_path), dtype="float32", rope_scaling_factor=0.0)
    ids = _prompts(np.random.default_rng(2), [40])[0]
    got = prompt_logits(loaded.model, [ids])[0]
    assert np.max(np.abs(got - _hf_logits(hf_model, ids))) <= TOL
    hf_model.config.rope_scaling = None
    default = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**BASE, "max_position_embeddings": 16}))
    default.load_state_dict(hf_model.state_dict())
    assert np.max(np.abs(got - _hf_logits(default.eval(), ids))) > 1e-3


def test_turbomind_rope_scaling_factor_means_dynamic_ntk(tmp_path):
    dyn_model = _save(tmp_path / "dyn", transformers.LlamaConfig,
                      dict(max_position_embeddings=16, rope_scaling={"rope_type": "dynamic", "factor": 3.0}))
    plain_dir = tmp_path / "plain"
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**BASE, "max_position_embeddings": 16}))
    plain.load_state_dict(dyn_model.state_dict())
    plain.save_pretrained(plain_dir)
    loaded = load_model(str(plain_dir), dtype="float32", rope_scaling_factor=3.0)
    assert loaded.config.rope.rope_type == "dynamic"
    ids = _prompts(np.random.default_rng(3), [33])[0]
    got = prompt_logits(loaded.model, [ids])[0]
    assert np.max(np.abs(got - _hf_logits(dyn_model, ids))) <= TOL


@pytest.mark.parametrize("case,merges", [("qwen2", True), ("llama-dynamic", True), ("qwen3", False)])
@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_merged_qkv_projection_keeps_the_logits(tmp_path, monkeypatch, case, merges, impl):
    """`merge_qkv` (one [q | k | v] weight, what the engine does for the fused RoPE + KV write on GPU):
    logits still match transformers, through the fused kernel (interpret mode here) or the split path;
    q/k-norm models (Qwen3) keep their separate projections."""
    cfg_cls, overrides = CASES[case]
    hf_model = _save(tmp_path, cfg_cls, overrides)
    model = load_model(str(tmp_path), dtype="float32").model
    assert model.merge_qkv() == (BASE["num_hidden_layers"] if merges else 0)
    assert (model.layers[0].self_attn.q_proj is None) == merges
    monkeypatch.setenv("LMJAX_KV_WRITE_IMPL", impl)
    from pallas_kernels import rope_kv_write as module

    traced, kernel = [], module._rope_kv_write_pallas  # proves which path ran
    monkeypatch.setattr(module, "_rope_kv_write_pallas", lambda *a, **kw: traced.append(1) or kernel(*a, **kw))
    prompts = _prompts(np.random.default_rng(2), [7, 30])
    for ids, got in zip(prompts, prompt_logits(model, prompts, block_size=8)):
        assert np.max(np.abs(got - _hf_logits(hf_model, ids))) <= TOL
    assert bool(traced) == (impl == "kernel")  # merged or not, "kernel" forces the fused launch
