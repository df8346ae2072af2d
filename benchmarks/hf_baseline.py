"""transformers' side of the benchmarks (throughput.py, latency.py): loading a checkpoint, one batched
`generate` (eager or static cache + torch.compile), and running a child process under a hard time cap.
"""
from __future__ import annotations

import os
import signal
import subprocess


def load_hf(path: str, dtype: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    if path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    return model.to(device).eval()


def _hf_batch(model, prompts: list[list[int]], new_tokens: int, pad_id: int, static: bool = False):
    """One left-padded greedy batch; returns the generated ids (batch, new_tokens) and the pad count.

    static: transformers' StaticCache (`cache_implementation="static"`); on CUDA, `generate` then
    torch.compiles the decode step by itself (mode "reduce-overhead": CUDA graphs), on the first call
    of each shape (batch, prompt + new tokens). `hf_compiled(model)` tells whether it did."""
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    cache = {"cache_implementation": "static"} if static else {}
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id,
                             temperature=None, top_p=None, top_k=None, **cache)
    return out[:, width:].tolist(), sum(width - len(p) for p in prompts)


def hf_compiled(model) -> bool:
    """Whether transformers' generate torch.compiled the forward (it keeps it as `_compiled_call`)."""
    return getattr(model, "_compiled_call", None) is not None


def hf_pad_id(model) -> int:
    pad_id = model.generation_config.pad_token_id or model.generation_config.eos_token_id or 0
    return pad_id[0] if isinstance(pad_id, list) else pad_id


def run_bounded(cmd: list[str], timeout: float, **popen) -> tuple[int | None, str | None]:
    """Run cmd in its own process group; past `timeout` seconds kill the whole group (the child's own
    children too, e.g. torch.compile workers holding the GPU). Returns (exit code or None if killed, stdout)."""
    proc = subprocess.Popen(cmd, start_new_session=True, **popen)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this call created, nothing else
        out, _ = proc.communicate()
        return None, out
