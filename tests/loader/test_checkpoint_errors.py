"""Broken checkpoints fail with an error that names the file and the tensor or field, never a traceback
from deep inside numpy or a silently wrong model."""
import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from lmjax.loader.model_loader import load_model
from lmjax.loader.resolve import resolve_model_path
from lmjax.loader.safetensors_loader import CheckpointError
from lmjax.models.config import ConfigError

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
           num_key_value_heads=1, max_position_embeddings=32)


@pytest.fixture()
def ckpt(tmp_path):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).save_pretrained(tmp_path, max_shard_size="20KB")
    return tmp_path


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _shards(path):
    return sorted(p for p in path.iterdir() if p.suffix == ".safetensors")


def test_shard_missing_a_tensor_names_file_and_tensor(ckpt):
    shard = _shards(ckpt)[0]
    tensors = load_file(shard)
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{dropped}.*{shard.name}"):
        load_model(str(ckpt), dtype="float32")


def test_missing_shard_file_is_named(ckpt):
    shard = _shards(ckpt)[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_model(str(ckpt), dtype="float32")


def test_corrupt_shard_is_named(ckpt):
    shard = _shards(ckpt)[0]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=shard.name):
        load_model(str(ckpt), dtype="float32")


def test_tensor_absent_from_whole_checkpoint_is_named(tmp_path):
    torch.manual_seed(0)
    sd = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).state_dict()
    sd.pop("model.layers.1.mlp.up_proj.weight")
    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({**CFG, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.up_proj"):
        load_model(str(tmp_path), dtype="float32")


def test_wrong_shape_is_named(ckpt):
    _edit_config(ckpt, intermediate_size=40)
    with pytest.raises(CheckpointError, match=r"mlp\.\w+_proj\.weight.*shape"):
        load_model(str(ckpt), dtype="float32")


@pytest.mark.parametrize("field, value, message", [
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 2.0}, "rope type 'yarn'"),
    ("architectures", ["GPT2LMHeadModel"], "GPT2LMHeadModel.*supported.*LlamaForCausalLM"),
    ("quantization_config", {"quant_method": "gptq"}, "gptq"),
])
def test_unsupported_config_fields(ckpt, field, value, message):
    _edit_config(ckpt, **{field: value})
    with pytest.raises(ConfigError, match=message):
        load_model(str(ckpt), dtype="float32")


def test_bad_dtype_is_named(ckpt):
    with pytest.raises(ValueError, match="float8"):
        load_model(str(ckpt), dtype="float8")


def test_missing_config_is_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))


def test_unknown_model_id_says_not_downloaded(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="never downloads"):
        resolve_model_path("no-such-org/no-such-model")


def test_model_id_resolves_through_hf_cache(monkeypatch, tmp_path):
    snapshot = tmp_path / "models--acme--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "models--acme--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    assert os.path.samefile(resolve_model_path("acme/tiny"), snapshot)


def test_weights_land_on_the_default_backend_device(ckpt):
    """Regression: the safetensors reader's CPU context once leaked into placement, leaving weights on
    the host of a GPU machine (copied to the device at every step)."""
    import jax
    from flax import nnx

    model = load_model(str(ckpt), dtype="float32").model
    devices = {d for leaf in jax.tree.leaves(nnx.state(model)) for d in leaf.devices()}
    assert devices == {jax.devices()[0]}
    assert jax.config.jax_default_device is None
