"""What a regex guide costs outlines-core to compile on SmolLM2-135M-Instruct's vocabulary (49,152 ids), one
fresh process a regex: seconds and the growth of peak memory, beside the size lmjax's bound gives it
(lmjax.engine.guided_regex.expanded_size; a guide past MAX_GUIDE_SIZE is refused before compiling). The
weights of broad classes in that bound (BROAD_WEIGHT, UNICODE_WEIGHT) come from these figures.

    python benchmarks/guide_compile_cost.py [REGEX ...]
"""
from __future__ import annotations

import os
import resource
import subprocess
import sys
import time

DEFAULT = ["a{0,2000}", "[0-9]{0,500}", "[a-z]{0,200}", r"\s{0,100}", ".{0,30}", ".{0,100}", '[^"]{0,100}',
           r"\w{0,100}", r"\p{L}{0,50}"]


def compile_one(regex: str) -> None:
    """In this process: build the vocabulary, then time one Index (the engine's, END sentinel included)."""
    sys.path.insert(0, os.getcwd())
    from lmjax.engine.guided import GuidedDecoding, _outlines
    from lmjax.loader.resolve import smollm2_gguf
    from lmjax.loader.tokenizer import load_tokenizer

    guided = GuidedDecoding(load_tokenizer(smollm2_gguf()), 49152, [2])
    vocabulary = guided.vocabulary()
    before, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
    _outlines().Index(f"(?:{regex})\\x00", vocabulary)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    print(f"{time.perf_counter() - start:.2f} {grown:.0f}")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        return compile_one(sys.argv[2])
    sys.path.insert(0, os.getcwd())
    from lmjax.engine.guided_regex import MAX_GUIDE_SIZE, ascii_digits, expanded_size

    print(f"{'regex':<16} | {'bound size':>10} | {'compile s':>9} | {'peak +MB':>8}")
    for regex in sys.argv[1:] or DEFAULT:
        size = expanded_size(ascii_digits(regex))
        out = subprocess.run([sys.executable, __file__, "--one", regex], capture_output=True, text=True, timeout=600)
        seconds, grown = (out.stdout.split() + ["?", "?"])[:2]
        refused = " (refused)" if size > MAX_GUIDE_SIZE else ""
        print(f"{regex:<16} | {size:>10,} | {seconds:>9} | {grown:>8}{refused}", flush=True)


if __name__ == "__main__":
    main()
