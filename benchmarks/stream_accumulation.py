"""Host cost of accumulating a streamed reply, as the server does per choice: ToolStream.feed (a reply read by a
tool-call parser, fed a few characters at a time) and merge_outputs (every piece folded into the whole output).
A cost that grows with the reply's square shows as a time that quadruples when the length doubles.

    python benchmarks/stream_accumulation.py [--sizes 100000 200000 400000] [--piece 4]

No model runs. Run it from two checkouts to compare trees (each prints its git commit).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.getcwd())  # the checkout it is run from

from lmjax.api.engine_thread import GenOut, merge_outputs  # noqa: E402
from lmjax.serve.tool_parsers import HermesParser, Llama3Parser  # noqa: E402
from lmjax.serve.tool_stream import ToolStream  # noqa: E402


def feed_seconds(parser, text: str, piece: int) -> float:
    stream, start = ToolStream(parser), time.perf_counter()
    for i in range(0, len(text), piece):
        stream.feed(text[i:i + piece])
    return time.perf_counter() - start


def merge_seconds(chars: int, piece: int) -> float:
    acc, start = None, time.perf_counter()
    for i in range(chars // piece):
        acc = merge_outputs(acc, GenOut(response="x" * piece, history_token_len=0, input_token_len=1,
                                        generate_token_len=i + 1, finish_reason=None, token_ids=[i]))
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 200_000, 400_000])
    ap.add_argument("--piece", type=int, default=4)
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"commit {commit or '?'}, pieces of {args.piece} characters, seconds")
    print(f"{'characters':>10} | {'hermes prose':>12} | {'llama3 JSON answer':>18} | {'merge_outputs':>13}")
    for n in args.sizes:
        prose = feed_seconds(HermesParser(), "word " * (n // 5), args.piece)
        answer = feed_seconds(Llama3Parser(), '{"name": "Alice", "bio": "' + "y" * n + '"}', args.piece)
        print(f"{n:>10} | {prose:>12.2f} | {answer:>18.2f} | {merge_seconds(n, args.piece):>13.2f}", flush=True)


if __name__ == "__main__":
    main()
