"""Loaded parameters are exactly the checkpoint's values (kernels transposed from torch's [out, in]), in
bf16 and float32, from a sharded checkpoint read as memory-mapped views; and they do not live in the file."""
import struct

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.torch import load_file, save_file

from lmjax.loader.model_loader import load_model

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
           num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False)
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _checkpoint(path, file_dtype: str) -> dict[str, torch.Tensor]:
    """A tiny Llama saved in `file_dtype` over several shards (with an index); returns what the files hold."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).to(TORCH_DTYPES[file_dtype])
    model.save_pretrained(path, max_shard_size="20KB")
    shards = sorted(path.glob("*.safetensors"))
    assert len(shards) > 1 and (path / "model.safetensors.index.json").exists()
    return {name: t for shard in shards for name, t in load_file(shard).items()}


def _align_data(shard) -> None:
    """Rewrite `shard` with its data at a 64-byte boundary (padding the header's metadata): there, a CPU
    device_put aliases a numpy view instead of copying it (jax 0.10), the case the loader must defend."""
    tensors = load_file(shard)
    for pad in range(64):
        save_file(tensors, shard, metadata={"format": "pt", "pad": "x" * pad})
        with open(shard, "rb") as f:
            if (8 + struct.unpack("<Q", f.read(8))[0]) % 64 == 0:
                return
    raise AssertionError("no padding aligns the data")


def _expected(tensors: dict[str, torch.Tensor], load_dtype: str) -> dict[tuple, np.ndarray]:
    """NNX path -> value as float32: Linear weights become [in, out] kernels, embeddings `embedding`."""
    out = {}
    for name, t in tensors.items():
        *module, _ = name.removeprefix("model.").split(".")
        path = tuple(int(p) if p.isdigit() else p for p in module)
        value = t.to(TORCH_DTYPES[load_dtype]).float().numpy()
        if module[-1] == "embed_tokens":
            out[path + ("embedding",)] = value
        elif module[-1].endswith("_proj") or module[-1] == "lm_head":
            out[path + ("kernel",)] = value.T
        else:
            out[path + ("weight",)] = value
    return out


def _params(model) -> dict[tuple, np.ndarray]:
    return {p: np.asarray(v[...]).astype(np.float32) for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.mark.parametrize("file_dtype, load_dtype",
                         [("bfloat16", "bfloat16"), ("float32", "float32"), ("float32", "bfloat16")])
def test_parameters_equal_the_checkpoint(tmp_path, file_dtype, load_dtype):
    expected = _expected(_checkpoint(tmp_path, file_dtype), load_dtype)
    loaded = load_model(str(tmp_path), load_dtype)
    params = _params(loaded.model)
    assert params.keys() == expected.keys()
    for path, value in expected.items():
        np.testing.assert_array_equal(params[path], value, err_msg=str(path))
    assert {str(leaf.dtype) for leaf in jax.tree.leaves(nnx.state(loaded.model))} == {load_dtype}
    assert {"build", "read", "place", "transpose", "sync", "total", "cpu"} <= loaded.load_seconds.keys()


@pytest.mark.parametrize("placer", [None, lambda path, array: jax.device_put(array, jax.devices()[0])],
                         ids=["default", "custom"])
def test_parameters_survive_the_file_being_overwritten(tmp_path, placer):
    """The reader hands out views of the mapped files; a CPU device buffer would alias them if given one."""
    expected = _expected(_checkpoint(tmp_path, "bfloat16"), "bfloat16")
    for shard in tmp_path.glob("*.safetensors"):
        _align_data(shard)
    loaded = load_model(str(tmp_path), "bfloat16", **({"placer": placer} if placer else {}))
    for shard in tmp_path.glob("*.safetensors"):  # in place: the same pages a mapping would see
        with open(shard, "r+b") as f:
            size = f.seek(0, 2)
            f.seek(0)
            f.write(b"\0" * size)
    params = _params(loaded.model)
    for path, value in expected.items():
        np.testing.assert_array_equal(params[path], value, err_msg=str(path))
