"""LMDeploy's engine configs, `TurbomindEngineConfig` and `PytorchEngineConfig`, with their names and
defaults; `to_engine_config()` lowers either onto lmjax's `EngineConfig`. A field lmjax cannot honour
yet raises `NotImplementedError` when set to anything but its default: never silently ignored. The
exception, each class's `TUNING_ONLY`: knobs of TurboMind's / the PyTorch engine's own scheduler or
allocator, which change how fast, never what, LMDeploy generates; lmjax has no such part, so they are
accepted and a non-default value is logged once as having no effect.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, fields
from typing import ClassVar

from lmjax.config import EngineConfig, dtype_name, _check, _strict_fields, warn_no_effect

logger = logging.getLogger("lmjax")


def _lower(cfg, renames: dict[str, str], frontend: tuple[str, ...]) -> EngineConfig:
    """Map `cfg`'s fields onto EngineConfig: `renames` maps differing names, same-named fields
    pass through, `frontend` fields are read by the pipeline (not the engine), `TUNING_ONLY` fields
    are accepted with a warning, and any other field must keep its default or NotImplementedError
    names it."""
    engine_names = {f.name for f in fields(EngineConfig)}
    kwargs = {}
    for f in fields(cfg):
        value, target = getattr(cfg, f.name), renames.get(f.name, f.name)
        if f.name in frontend:
            continue
        if f.name in cfg.TUNING_ONLY:
            if value != f.default:
                warn_no_effect(type(cfg).__name__, f.name, value, cfg.TUNING_ONLY[f.name])
        elif target in engine_names:
            if value is not None:
                kwargs[target] = value
        elif value != f.default:
            raise NotImplementedError(
                f"{type(cfg).__name__}.{f.name}={value!r} is not supported by lmjax yet "
                f"(leave it at {f.default!r})")
    # LMDeploy draws a random seed for each unseeded request: unseeded sampling differs from run to run
    return EngineConfig(**kwargs, seed=None)


@_strict_fields
@dataclass
class TurbomindEngineConfig:
    """LMDeploy's TurboMind config (names and seed-doc defaults). model_name picks the chat
    template (read by the pipeline). max_context_token_num is the old name for
    max_prefill_token_num (used when set above its default 1). model_format: None, 'hf' or 'awq' (an
    AutoAWQ GEMM checkpoint; lmjax reads the format from its config.json either way)."""
    model_name: str | None = None
    model_format: str | None = None
    dtype: str = "auto"
    tp: int = 1
    session_len: int | None = None
    max_batch_size: int | None = 128
    cache_max_entry_count: float = 0.5
    cache_block_seq_len: int = 128
    enable_prefix_caching: bool = False
    quant_policy: int = 0
    rope_scaling_factor: float = 0.0
    use_dynamic_ntk: bool = False
    use_logn_attn: bool = False
    max_prefill_token_num: int = 8192
    max_context_token_num: int = 1
    group_size: int = 128
    cache_chunk_size: int = -1
    num_tokens_per_iter: int = 0
    max_prefill_iters: int = 1
    use_context_fmha: int = 1
    kv_bits: int = 8
    download_dir: str | None = None
    revision: str | None = None
    communicator: str = "nccl"

    # kv_bits: the KV cache's bits, which quant_policy says (4 or 8; a kv_bits that contradicts it is refused).
    # Kept refusing (they change results or need what lmjax lacks): group_size (AWQ's group size is read from the checkpoint), model_format 'llama' / 'gptq'
    # (TurboMind's converted layout, GPTQ weights: lmjax cannot load them).
    TUNING_ONLY: ClassVar[dict[str, str]] = {
        "cache_chunk_size": "lmjax allocates the whole KV cache at start-up, not in chunks",
        "num_tokens_per_iter": "prefill chunking follows max_prefill_token_num",
        "max_prefill_iters": "prefill chunking follows max_prefill_token_num",
        "use_context_fmha": "TurboMind's fused prefill-attention kernel switch; lmjax has its own kernels",
        "communicator": "XLA's collectives do the all-reduce (NCCL on GPUs)",
    }

    def __post_init__(self):
        self.dtype = dtype_name(self.dtype)
        _check(self.num_tokens_per_iter >= 0,  # LMDeploy's own check
               f"num_tokens_per_iter must be >= 0, got {self.num_tokens_per_iter!r}")
        formats = (None, "hf", "llama", "awq", "gptq")
        _check(self.model_format in formats,
               f"model_format must be one of {formats}, got {self.model_format!r}")

    def to_engine_config(self) -> EngineConfig:
        if self.model_format not in (None, "hf", "awq"):
            raise NotImplementedError(f"model_format={self.model_format!r} is not supported by lmjax "
                                      "yet (use None, 'hf' or 'awq'; GGUF files load directly)")
        cfg = self
        if self.max_context_token_num > 1:  # legacy alias
            _check(self.max_prefill_token_num in (8192, self.max_context_token_num),
                   f"max_context_token_num={self.max_context_token_num} (the old name) and max_prefill_token_num="
                   f"{self.max_prefill_token_num} differ: give one")
            cfg = dataclasses.replace(self, max_prefill_token_num=self.max_context_token_num,
                                      max_context_token_num=1)
        _check(self.kv_bits in (4, 8) and (self.kv_bits == 8 or self.quant_policy == self.kv_bits),
               f"kv_bits={self.kv_bits!r} does not fit quant_policy={self.quant_policy} (8: int8, 4: int4 KV cache)")
        if self.quant_policy == 4 and self.kv_bits == 8:
            logger.warning("quant_policy=4 is an int4 KV cache (LMDeploy >= 0.4; older docs' 'set 4 for 8-bit k/v' "
                           "is quant_policy=8 now); kv_bits=4 says so and silences this")
        return _lower(cfg, {"cache_block_seq_len": "block_size"},
                      frontend=("model_name", "model_format", "max_context_token_num", "kv_bits"))


@_strict_fields
@dataclass
class PytorchEngineConfig:
    """LMDeploy's PyTorch-engine config (names and defaults of the seed docs and current
    LMDeploy). device_type 'cuda' means "JAX's default device"."""
    model_name: str = ""
    dtype: str = "auto"
    tp: int = 1
    session_len: int | None = None
    max_batch_size: int | None = 128
    cache_max_entry_count: float = 0.5
    eviction_type: str = "recompute"
    prefill_interval: int = 16
    block_size: int = 64
    num_cpu_blocks: int = 0
    num_gpu_blocks: int = 0
    adapters: dict[str, str] | None = None
    max_prefill_token_num: int = 4096
    thread_safe: bool = False
    enable_prefix_caching: bool = False
    device_type: str = "cuda"
    eager_mode: bool = False
    custom_module_map: dict[str, str] | None = None
    download_dir: str | None = None
    revision: str | None = None
    quant_policy: int = 0
    dp: int = 1
    ep: int = 1
    dp_rank: int = 0
    distributed_executor_backend: str | None = None

    # Kept refusing: adapters (LoRA, which lmjax does not serve).
    TUNING_ONLY: ClassVar[dict[str, str]] = {
        "eviction_type": "a preempted request keeps its tokens and its KV cache is recomputed, never "
                         "copied to the CPU",
        "num_cpu_blocks": "there is no CPU swap space: preemption recomputes",
        "prefill_interval": "lmjax's scheduler admits waiting requests whenever batch slots, token budget and "
                            "KV blocks allow",
        "distributed_executor_backend": "one JAX process drives every local device (tp across hosts: "
                                        "jax.distributed)",
        "eager_mode": "no CUDA graphs to turn off (each batch bucket compiles its own step when first met)",
    }

    def __post_init__(self):
        self.dtype = dtype_name(self.dtype)
        _check(self.eviction_type in ("recompute", "copy"),
               f"eviction_type must be 'recompute' or 'copy', got {self.eviction_type!r}")
        _check(self.num_cpu_blocks >= 0, f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks!r}")

    def to_engine_config(self) -> EngineConfig:
        if self.device_type != "cuda":
            raise NotImplementedError(f"device_type={self.device_type!r} is not supported by lmjax yet")
        return _lower(self, {}, frontend=("model_name", "device_type"))
