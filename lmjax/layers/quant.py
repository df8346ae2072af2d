"""Weight-only quantization: int8 per output channel and int4 in groups along the input dim.

A `QuantLinear` stands where a `Linear` stood, with the same call signature and the same parameter
path for its weights (`...q_proj.kernel`), so `lmjax.parallel`'s sharding rules apply unchanged:

  w8  kernel int8  [I, O]          scale [O]          y = (x @ kernel) * scale
  w4  kernel uint8 [I/2, O]        scale, offset [ceil(I/G), O]
      (two uint4 per byte: row 2i in the low nibble, row 2i+1 in the high one)
      y = x @ (unpack(kernel) * repeat(scale, G)[:I] + repeat(offset, G)[:I])

w8 is symmetric; w4 is asymmetric per group, the layout of AWQ / TurboMind's `model_format="awq"`
(their zero point z is `offset = -z * scale`). Three producers fill it: round to nearest here (min/max
onto 0..15), AWQ or GPTQ at conversion (convert/awq.py, convert/gptq.py, convert/calibrate.py),
and AWQ checkpoints (lmjax/loader/awq.py). Dequantization is plain jnp inside the jitted step, except
w4 at decode on one GPU: there XLA materialized the dequantized bf16 weight every step (Llama-3-8B
decode 24.5 ms vs 6.17 ms bf16 on an H100), so the Pallas kernel of pallas_kernels/w4_matmul.py reads
the packed bytes directly.
A last group shorter than G is allowed (SmolLM2's hidden size 576 is 4.5 groups of 128).

The model code knows nothing of this: `quantize_model` swaps every `Linear` of a built model (the
lm_head excepted, and those an AWQ checkpoint keeps float: `QuantSpec.skip`) for a `QuantLinear`, from
real weights (conversion) or abstractly inside `nnx.eval_shape` (restore of a converted checkpoint), like
gpt-fast's quant handlers.
KV-cache quantization (LMDeploy's quant_policy 8 / 4) is lmjax.layers.kv_quant.
Shape letters: T tokens, I input dim, O output dim, G group size.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lmjax.env import env_choice
from lmjax.layers.linear import Linear
from pallas_kernels.w4_matmul import kernel_supports, w4_matmul_kernel

METHODS = ("w8", "w4")
SKIPPED = ("lm_head",)  # float unless QuantSpec.lm_head says: the logits are the most sensitive


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    method: str  # "w8" (int8 per output channel) or "w4" (uint4 + offset in groups along the input dim)
    group_size: int = 128  # w4 only
    # The lm_head's own method (None: float, as vLLM's and LMDeploy's AWQ/GPTQ leave it). A tied lm_head
    # becomes a separate quantized weight (the embedding stays float for the lookup).
    lm_head: str | None = None
    # Module-name substrings whose Linears stay float: AutoAWQ's `modules_to_not_convert`, matched as vLLM
    # matches it (any of them inside the module's checkpoint name, `quantize_model`'s `module_name`).
    skip: tuple[str, ...] = ()

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"quant method {self.method!r} is not supported; choose one of {METHODS}")
        if self.lm_head not in (None, *METHODS):
            raise ValueError(f"lm_head quant method {self.lm_head!r} is not supported; choose None or one of {METHODS}")
        if "w4" in (self.method, self.lm_head) and self.group_size <= 0:
            raise ValueError(f"group_size={self.group_size} must be positive")
        if isinstance(self.skip, str) or not all(isinstance(s, str) and s for s in self.skip):
            raise ValueError(f"skip={self.skip!r} must be a sequence of non-empty module-name substrings")

    def to_dict(self) -> dict:
        head = {"lm_head": self.lm_head} if self.lm_head else {}  # absent: older readers see the same dict
        skip = {"modules_to_not_convert": list(self.skip)} if self.skip else {}  # AutoAWQ's key
        return {"method": self.method, "group_size": self.group_size, **head, **skip}

    @classmethod
    def from_dict(cls, d: dict | None) -> "QuantSpec | None":
        if not d:
            return None
        skip = tuple(d.get("modules_to_not_convert") or ())
        return cls(d["method"], int(d.get("group_size", 128)), d.get("lm_head"), skip)

    def keeps_float(self, module_name: str) -> bool:
        """Whether the Linear named `module_name` in the checkpoint stays float (vLLM's is_layer_skipped_awq)."""
        return any(s in module_name for s in self.skip)

    def with_skip(self, skip=()) -> "QuantSpec":
        """This layout with another skip list (`lmjax convert` compares layouts: its options name no skip list)."""
        return dataclasses.replace(self, skip=tuple(skip))

    def for_lm_head(self) -> "QuantSpec | None":
        return QuantSpec(self.lm_head, self.group_size) if self.lm_head else None


# ---------------------------------------------------------------- quantize / dequantize (pure jnp)
def quantize_w8(w_IO: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 per output channel: (kernel int8 [I, O], scale float32 [O])."""
    w = w_IO.astype(jnp.float32)
    scale_O = jnp.max(jnp.abs(w), axis=0) / 127.0
    scale_O = jnp.where(scale_O == 0, 1.0, scale_O)
    q_IO = jnp.clip(jnp.round(w / scale_O), -127, 127).astype(jnp.int8)
    return q_IO, scale_O


def _group_rows(x_IO: jax.Array, group_size: int) -> jax.Array:
    """[I, O] -> [ceil(I/G), G, O], the last group padded with zeros."""
    I, O = x_IO.shape
    groups = -(-I // group_size)
    x = jnp.pad(x_IO, ((0, groups * group_size - I), (0, 0)))
    return x.reshape(groups, group_size, O)


def quantize_w4(w_IO: jax.Array, group_size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Asymmetric uint4 per (group of G input rows, output column):
    (packed uint8 [I/2, O], scale [ceil(I/G), O], offset [ceil(I/G), O]); w ~ q * scale + offset."""
    I, O = w_IO.shape
    if I % 2:
        raise ValueError(f"int4 packing needs an even input dim, got {I=}")
    w_gGO = _group_rows(w_IO.astype(jnp.float32), group_size)
    if I % group_size:  # the zero padding of the last group must not widen its range
        valid = (jnp.arange(w_gGO.shape[0] * group_size) < I).reshape(w_gGO.shape[:2])[..., None]
        lo_gO = jnp.min(jnp.where(valid, w_gGO, jnp.inf), axis=1)
        hi_gO = jnp.max(jnp.where(valid, w_gGO, -jnp.inf), axis=1)
    else:
        lo_gO, hi_gO = jnp.min(w_gGO, axis=1), jnp.max(w_gGO, axis=1)
    scale_gO = (hi_gO - lo_gO) / 15.0
    scale_gO = jnp.where(scale_gO == 0, 1.0, scale_gO)
    q_gGO = jnp.clip(jnp.round((w_gGO - lo_gO[:, None, :]) / scale_gO[:, None, :]), 0, 15)
    u_IO = q_gGO.reshape(-1, O)[:I].astype(jnp.uint8)
    packed = u_IO[0::2] | (u_IO[1::2] << 4)
    return packed, scale_gO, lo_gO


def unpack_w4(packed_JO: jax.Array) -> jax.Array:
    """uint8 [I/2, O] -> uint8 values in [0, 15], [I, O] (row 2i from the low nibble)."""
    J, O = packed_JO.shape
    return jnp.stack([packed_JO & 0xF, packed_JO >> 4], axis=1).reshape(2 * J, O)


def dequantize_w4(packed_JO: jax.Array, scale_gO: jax.Array, offset_gO: jax.Array, group_size: int,
                  dtype) -> jax.Array:
    q_IO = unpack_w4(packed_JO)
    I = q_IO.shape[0]
    scale_IO = jnp.repeat(scale_gO.astype(dtype), group_size, axis=0)[:I]
    offset_IO = jnp.repeat(offset_gO.astype(dtype), group_size, axis=0)[:I]
    return q_IO.astype(dtype) * scale_IO + offset_IO


# ---------------------------------------------------------------- the layer
W4_IMPLS = ("auto", "kernel", "reference")
W4_KERNEL_MAX_TOKENS = 64  # decode and small batches; past that the dequant + matmul is compute bound


def _use_w4_kernel(x_TI: jax.Array, group_size: int) -> bool:
    """Trace-time choice of the w4 path. LMJAX_W4_IMPL=kernel|reference forces one (benchmarks);
    auto takes the Pallas kernel on GPU for at most W4_KERNEL_MAX_TOKENS tokens and no active mesh
    (under tensor parallelism the weights are sharded: the jnp path lets XLA partition it)."""
    impl = env_choice("LMJAX_W4_IMPL", W4_IMPLS, "auto")
    if impl != "auto":
        return impl == "kernel"
    tokens = int(np.prod(x_TI.shape[:-1]))
    return (jax.default_backend() == "gpu" and tokens <= W4_KERNEL_MAX_TOKENS and kernel_supports(group_size)
            and jax.sharding.get_abstract_mesh().empty)


class QuantLinear(nnx.Module):
    """A Linear with int8 or packed-int4 weights; `Linear`'s call signature and kernel path."""

    def __init__(self, in_dim: int, out_dim: int, spec: QuantSpec, *, bias: bool = False, dtype=jnp.float32):
        self.spec, self.dtype = spec, dtype
        if spec.method == "w8":
            self.kernel = nnx.Param(jnp.zeros((in_dim, out_dim), jnp.int8))
            self.scale = nnx.Param(jnp.zeros((out_dim,), dtype))
        else:
            if in_dim % 2:
                raise ValueError(f"int4 packing needs an even input dim, got {in_dim=}")
            groups = -(-in_dim // spec.group_size)
            self.kernel = nnx.Param(jnp.zeros((in_dim // 2, out_dim), jnp.uint8))
            self.scale = nnx.Param(jnp.zeros((groups, out_dim), dtype))
            self.offset = nnx.Param(jnp.zeros((groups, out_dim), dtype))
        self.bias = nnx.Param(jnp.zeros((out_dim,), dtype)) if bias else None

    @classmethod
    def from_linear(cls, linear: Linear, spec: QuantSpec) -> "QuantLinear":
        """Round-to-nearest quantization of a float Linear's weights."""
        w_IO = linear.kernel[...]
        bias = None if linear.bias is None else linear.bias[...]
        if spec.method == "w8":
            return cls.from_arrays(spec, *quantize_w8(w_IO), bias=bias, dtype=w_IO.dtype)
        return cls.from_arrays(spec, *quantize_w4(w_IO, spec.group_size), bias=bias, dtype=w_IO.dtype)

    @classmethod
    def from_arrays(cls, spec: QuantSpec, kernel, scale, offset=None, *, bias=None, dtype=jnp.float32):
        """A QuantLinear holding already-quantized arrays (w8: kernel int8 [I, O], scale [O]; w4: kernel
        uint8 [I/2, O], scale and offset [ceil(I/G), O]), e.g. from GPTQ or an AWQ checkpoint."""
        in_dim = kernel.shape[0] * (2 if spec.method == "w4" else 1)
        layer = nnx.eval_shape(lambda: cls(in_dim, kernel.shape[1], spec, bias=bias is not None, dtype=dtype))
        layer.kernel = nnx.Param(jnp.asarray(kernel))
        layer.scale = nnx.Param(jnp.asarray(scale, dtype))
        if spec.method == "w4":
            layer.offset = nnx.Param(jnp.asarray(offset, dtype))
        if bias is not None:
            layer.bias = nnx.Param(jnp.asarray(bias, dtype))
        return layer

    def __call__(self, x_TI: jax.Array) -> jax.Array:
        dtype = x_TI.dtype
        if self.spec.method == "w8":
            y_TO = (x_TI @ self.kernel[...].astype(dtype)) * self.scale[...].astype(dtype)
        elif _use_w4_kernel(x_TI, self.spec.group_size):
            lead, I = x_TI.shape[:-1], x_TI.shape[-1]
            y_TO = w4_matmul_kernel(x_TI.reshape(-1, I), self.kernel[...], self.scale[...].astype(dtype),
                                    self.offset[...].astype(dtype), self.spec.group_size,
                                    interpret=jax.default_backend() != "gpu")  # forced off GPU: tests
            y_TO = y_TO.reshape(*lead, -1)
        else:
            w_IO = dequantize_w4(self.kernel[...], self.scale[...], self.offset[...], self.spec.group_size, dtype)
            y_TO = x_TI @ w_IO
        if self.bias is not None:
            y_TO = y_TO + self.bias[...]
        return y_TO


# ---------------------------------------------------------------- model transform
def linear_slots(model: nnx.Module):
    """(parent, attribute name or list index, Linear) for every Linear of `model` not in SKIPPED."""
    for _, parent, key, module in _linear_paths(model):
        yield parent, key, module


def _linear_paths(model: nnx.Module):
    """`linear_slots`, each with the Linear's NNX path first."""
    iter_modules = getattr(nnx, "iter_modules", None) or type(model).iter_modules
    for path, module in iter_modules(model):
        if isinstance(module, Linear) and path and not any(str(p) in SKIPPED for p in path):
            parent = model
            for p in path[:-1]:
                parent = parent[p] if isinstance(p, int) else getattr(parent, p)
            yield path, parent, path[-1], module


def llama_module_name(path: tuple) -> str:
    """The HF Llama checkpoint's name of the module at NNX `path` ("model.layers.0.mlp.down_proj")."""
    name = ".".join(map(str, path))
    return name if path[0] == "lm_head" else f"model.{name}"


def quantize_model(model: nnx.Module, spec: QuantSpec | None, abstract: bool = False,
                   module_name=llama_module_name) -> nnx.Module:
    """Swap every Linear (the lm_head only with `spec.lm_head`) for a QuantLinear, in place; returns
    the model. A Linear whose checkpoint name (`module_name(path)`: another architecture's tensor map
    renames modules) `spec.keeps_float` stays a Linear.

    abstract=True builds empty QuantLinears (for `nnx.eval_shape`, before restoring their values);
    else each is quantized from the Linear's current weights."""
    if spec is None:
        return model
    for path, parent, key, linear in list(_linear_paths(model)):
        if not spec.keeps_float(module_name(path)):
            set_slot(parent, key, _quantized(linear, spec, abstract))
    return quantize_lm_head(model, spec, abstract)


def quantize_lm_head(model: nnx.Module, spec: QuantSpec, abstract: bool = False) -> nnx.Module:
    """The lm_head as a QuantLinear of `spec.lm_head` (nothing without it), in place. A model that ties
    its lm_head to the embedding (`lm_head` None) gets its own, made from the embedding."""
    head_spec = spec.for_lm_head()
    if head_spec is None or isinstance(getattr(model, "lm_head", None), QuantLinear):
        return model
    head = model.lm_head
    if head is None:
        embedding_VD = model.embed_tokens.embedding
        V, D = embedding_VD.shape
        head = nnx.eval_shape(lambda: Linear(D, V, dtype=embedding_VD.dtype))
        if not abstract:
            head.kernel = nnx.Param(embedding_VD[...].T)
    model.lm_head = nnx.data(_quantized(head, head_spec, abstract))
    return model


def _quantized(linear: Linear, spec: QuantSpec, abstract: bool) -> QuantLinear:
    if not abstract:
        return QuantLinear.from_linear(linear, spec)
    I, O = linear.kernel.shape
    return QuantLinear(I, O, spec, bias=linear.bias is not None, dtype=linear.kernel.dtype)


def set_slot(parent: nnx.Module, key, module: nnx.Module) -> None:
    """Put `module` where `linear_slots` found a Linear (an attribute or a list index)."""
    if isinstance(key, int):
        parent[key] = module
    else:
        setattr(parent, key, module)
