"""AWQ checkpoints (AutoAWQ's GEMM format; TurboMind's model_format="awq") -> lmjax's w4 QuantLinear.

An HF directory whose config.json has `quantization_config.quant_method == "awq"` stores every decoder
Linear as three tensors instead of `weight` (I input dim, O output dim, G group size):
  qweight int32 [I, O/8]      eight uint4 codes per int32, along the output dim
  qzeros  int32 [I/G, O/8]    integer zero points, packed the same way
  scales  float16 [I/G, O]    W[i, o] = (code[i, o] - zero[i // G, o]) * scale[i // G, o]
Within an int32, nibble k (bits 4k..4k+3) holds output column 8c + AWQ_ORDER[k] (AutoAWQ packs in
that interleaved order so its CUDA kernel can unpack pairs at once).

lmjax's w4 layout (lmjax.layers.quant) holds the same numbers differently: codes packed two per uint8
along the input dim, and a float offset instead of the integer zero (offset = -zero * scale). So the
import is exact: unpack, repack, and one multiply per group. The lm_head stays float, as AutoAWQ
leaves it, and so does every Linear that `quantization_config.modules_to_not_convert` names (a list of
module-name substrings, e.g. ["down_proj"] or ["visual"]; its tensors are a plain float `weight`). vLLM's
rule decides which: a module stays float when any entry is a substring of its checkpoint name. Members of
a group lmjax merges at run time (q/k/v, gate/up: lmjax.layers.merge) may differ; such a group simply
stays unmerged, each member exactly as stored (merge_linears declines a float + int4 mix).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator

import numpy as np

from lmjax.layers.quant import QuantSpec, llama_module_name
from lmjax.loader.converted_config import converted_quant
from lmjax.loader.safetensors_loader import CheckpointError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of a packed int32 -> output column 8c + AWQ_ORDER[k]
_NIBBLE_OF_COLUMN = np.argsort(AWQ_ORDER)  # output column 8c + j sits in nibble _NIBBLE_OF_COLUMN[j]
_PARTS = ("qweight", "qzeros", "scales")
# InternLM2's checkpoint names of the Llama modules its tensor map (lmjax.models.internlm2) loads them into,
# the names modules_to_not_convert refers to; q/k/v all come from the one packed `wqkv`.
_INTERNLM2_MODULES = {"self_attn.q_proj": "attention.wqkv", "self_attn.k_proj": "attention.wqkv",
                      "self_attn.v_proj": "attention.wqkv", "self_attn.o_proj": "attention.wo",
                      "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3",
                      "mlp.down_proj": "feed_forward.w2"}


def require_awq(model_path: str, declared: str) -> None:
    """`declared` (e.g. "LLM(quantization='awq')") says `model_path` is an AWQ checkpoint: a ValueError
    naming both unless its config.json says so too (vLLM's check; lmjax itself reads the format from
    config.json, so the declaration only guards against loading a checkpoint one did not mean to). An
    `lmjax convert --quant w4` directory counts: its int4 groups are AWQ's layout (as `lmdeploy lite auto_awq`'s
    output is loaded with model_format='awq')."""
    config = os.path.join(model_path, "config.json")
    hf_config = {}
    if os.path.isfile(config):
        with open(config) as f:
            hf_config = json.load(f)
    method = (hf_config.get("quantization_config") or {}).get("quant_method")
    converted = (converted_quant(hf_config) or {}).get("method")
    if str(method).lower() != "awq" and converted != "w4":
        raise ValueError(f"{declared}, but {model_path!r} is not an AWQ checkpoint (its config.json's "
                         f"quantization_config.quant_method is {method!r}"
                         + (f", and lmjax convert's quant is {converted!r}, not 'w4')" if converted else ")"))


def awq_spec(hf_config: dict) -> QuantSpec | None:
    """The w4 spec of an AWQ checkpoint's config.json (None when it is not AWQ); raises for AWQ
    variants the layout cannot hold, naming the value."""
    q = hf_config.get("quantization_config") or {}
    if str(q.get("quant_method", "")).lower() != "awq":
        return None
    bits = int(q.get("bits", q.get("w_bit", 4)))
    version = str(q.get("version", "gemm")).lower()
    if bits != 4:
        raise NotImplementedError(f"AWQ bits={bits} is not supported (4 only)")
    if version != "gemm":
        raise NotImplementedError(f"AWQ version={version!r} is not supported ('gemm', AutoAWQ's default, only)")
    if not q.get("zero_point", True):
        raise NotImplementedError("AWQ zero_point=False is not supported (asymmetric, zero_point=True only)")
    return QuantSpec("w4", int(q.get("group_size", q.get("q_group_size", 128))), skip=_skip_list(q))


def _skip_list(q: dict) -> tuple[str, ...]:
    """`modules_to_not_convert` (null or absent: none) as a tuple; a CheckpointError for anything but
    non-empty strings (an empty one would be a substring of every name: nothing quantized at all)."""
    skip = q.get("modules_to_not_convert") or ()
    if not isinstance(skip, (list, tuple)) or not all(isinstance(s, str) and s for s in skip):
        raise CheckpointError(f"AWQ modules_to_not_convert={skip!r} must be a list of non-empty module names")
    return tuple(skip)


def checkpoint_module_name(architecture: str):
    """NNX path -> the module's name in a checkpoint of `architecture`: what `QuantSpec.keeps_float`
    matches, as vLLM (which keeps each model's own module names) does."""
    if architecture != "InternLM2ForCausalLM":
        return llama_module_name

    def internlm2_name(path: tuple) -> str:
        if path[0] == "lm_head":
            return "output"
        parts = llama_module_name(path).split(".")
        renamed = _INTERNLM2_MODULES.get(".".join(parts[-2:]))
        return ".".join(parts[:-2] + [renamed]) if renamed else ".".join(parts)
    return internlm2_name


def unpack_awq(packed_XC: np.ndarray) -> np.ndarray:
    """int32 [X, O/8] in AutoAWQ's order -> uint8 codes [X, O] in column order."""
    X, C = packed_XC.shape
    nibbles_XCK = (packed_XC.astype(np.uint32)[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
    return nibbles_XCK[..., _NIBBLE_OF_COLUMN].reshape(X, 8 * C).astype(np.uint8)


def pack_awq(codes_XO: np.ndarray) -> np.ndarray:
    """uint codes [X, O] -> int32 [X, O/8] in AutoAWQ's order (the inverse of `unpack_awq`; for tests
    and for writing AWQ checkpoints)."""
    X, O = codes_XO.shape
    cols = codes_XO.astype(np.uint32).reshape(X, O // 8, 8)
    packed = np.zeros((X, O // 8), np.uint32)
    for k, column in enumerate(AWQ_ORDER):
        packed |= cols[..., column] << (4 * k)
    return packed.view(np.int32)


def awq_to_w4(qweight, qzeros, scales, group_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One AWQ Linear -> (kernel uint8 [I/2, O], scale [I/G, O], offset [I/G, O]) of lmjax's w4."""
    codes_IO, zeros_gO = unpack_awq(np.asarray(qweight)), unpack_awq(np.asarray(qzeros))
    scale_gO = np.asarray(scales, np.float32)
    I, O = codes_IO.shape
    if scale_gO.shape != zeros_gO.shape or scale_gO.shape[0] != -(-I // group_size):
        raise CheckpointError(f"AWQ shapes disagree: qweight {np.shape(qweight)}, qzeros {np.shape(qzeros)}, "
                              f"scales {np.shape(scales)} at group_size={group_size}")
    kernel = codes_IO[0::2] | (codes_IO[1::2] << 4)
    return kernel, scale_gO, -zeros_gO.astype(np.float32) * scale_gO


def awq_tensors(tensors: Iterable[tuple[str, np.ndarray]], spec: QuantSpec) -> Iterator[tuple[str, np.ndarray]]:
    """The checkpoint's tensors with each Linear's (qweight, qzeros, scales) replaced by its lmjax
    `kernel`, `scale` and `offset` (in whatever order the files hold them); others (the float weights
    of the modules `spec.skip` keeps float among them) pass through."""
    pending: dict[str, dict[str, np.ndarray]] = {}
    for name, array in tensors:
        prefix, _, leaf = name.rpartition(".")
        if leaf not in _PARTS:
            yield name, array
            continue
        if spec.keeps_float(prefix):  # the model has a float Linear there: say why it cannot load
            raise CheckpointError(f"AWQ tensor {name!r} is quantized, but quantization_config."
                                  f"modules_to_not_convert {list(spec.skip)} keeps {prefix!r} float")
        parts = pending.setdefault(prefix, {})
        parts[leaf] = array
        if len(parts) == len(_PARTS):
            del pending[prefix]
            w4 = awq_to_w4(parts["qweight"], parts["qzeros"], parts["scales"], spec.group_size)
            yield from zip((f"{prefix}.kernel", f"{prefix}.scale", f"{prefix}.offset"), w4)
    if pending:
        raise CheckpointError(f"AWQ linears {sorted(pending)[:4]} lack some of {_PARTS}")
