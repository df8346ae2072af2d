"""A Llama checkpoint that also stores `rotary_emb.cos_cached` / `rotary_emb.sin_cached` buffers (ColossalAI
writes them; vLLM's Llama `load_weights` skips them with the comment "Models trained using ColossalAI may
include these tensors in the checkpoint. Skip them.", and transformers ignores them as unexpected keys).
lmjax skipped only `rotary_emb.inv_freq` (lmjax/loader/weights.py `_IGNORED_SUFFIXES`), so load_model raised
CheckpointError "checkpoint tensor '...rotary_emb.cos_cached' has no place in the model" (probe 25)."""
import glob

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

from lmjax.loader.model_loader import load_model
from lmjax.models.forward import prompt_logits

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)


def test_rotary_cos_sin_cache_buffers_are_skipped(tmp_path):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE)).eval()
    hf.save_pretrained(tmp_path)
    (file,) = glob.glob(str(tmp_path / "*.safetensors"))
    tensors = load_file(file)
    for i in range(BASE["num_hidden_layers"]):
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        tensors[f"model.layers.{i}.self_attn.rotary_emb.cos_cached"] = torch.ones(1, 1, 64, 16)
        tensors[f"model.layers.{i}.self_attn.rotary_emb.sin_cached"] = torch.zeros(1, 1, 64, 16)
    save_file(tensors, file, metadata={"format": "pt"})
    ids = np.random.default_rng(0).integers(0, 128, 20).tolist()
    want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = want(torch.tensor([ids])).logits[0].numpy()
    got = prompt_logits(load_model(str(tmp_path), dtype="float32").model, [ids], block_size=8)[0]
    assert np.max(np.abs(got - want)) <= 1e-4
