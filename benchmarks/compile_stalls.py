"""What compiling in the middle of serving costs a warmed-up engine, with and without running new one-step
shapes at a larger compiled shape while theirs compile on a worker (LMJAX_PAD_TO_COMPILED,
lmjax/engine/step_shapes.py):

    python benchmarks/compile_stalls.py --shape llama-3.2-1b     # GPU: random bf16 weights of the shape
    python benchmarks/compile_stalls.py --shape tiny --scale 0.1  # CPU smoke run

`LLM(enforce_eager=False)` (warm-up: the decode call's buckets for greedy; with padding also the largest step
shapes) with an empty persistent compilation cache, then rounds of requests as a server meets them: batches of
other sizes and prompt lengths (new token / sequence / block-table buckets of the one-step call) and other
sampling variants, each round timed; then, the worker's compilations waited for, the same rounds three times
more (the steady state: each round's median). Each setting runs in a child process of its own, one after the
other, and the table compares them.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from random_model import SHAPES, ensure_checkpoint  # noqa: E402

# (prompts, prompt tokens, sampling): what a server's clients send after start-up, in order
ROUNDS = [(1, 40, dict(temperature=0)), (4, 300, dict(temperature=0)), (16, 128, dict(temperature=0.8, seed=1)),
          (2, 1500, dict(temperature=0)), (48, 60, dict(temperature=0.7, top_p=0.9, seed=2)),
          (8, 700, dict(temperature=0)), (100, 20, dict(temperature=0)), (3, 120, dict(temperature=0, logprobs=1)),
          (24, 400, dict(temperature=0.8, seed=3)), (1, 2000, dict(temperature=0))]
NEW_TOKENS = 32


def child(args) -> None:
    os.environ["LMJAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="lmjax-stalls-cache-")
    os.environ["LMJAX_PAD_TO_COMPILED"] = args.pad
    os.environ.setdefault("LMJAX_BACKGROUND_COMPILE", "1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(threadName)s %(message)s")  # (stderr)
    from lmjax import LLM, SamplingParams

    dtype = "float32" if args.shape == "tiny" else "bfloat16"
    path = ensure_checkpoint(args.shape, dtype)[0]
    rng = random.Random(0)
    vocab = SHAPES[args.shape]["vocab_size"]
    rounds = [(max(1, round(n * args.scale)), max(4, round(length * args.scale)), sampling)
              for n, length, sampling in ROUNDS]
    prompts = [[[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)] for n, length, _ in rounds]
    start = time.perf_counter()
    llm = LLM(path, dtype=dtype, max_model_len=2048 + NEW_TOKENS + 64, enforce_eager=False,
              enable_prefix_caching=False)
    runner = llm.llm_engine.runner
    print(json.dumps({"pad": args.pad, "event": "ready", "s": round(time.perf_counter() - start, 1),
                      "compilations": runner.num_compilations}), flush=True)

    def run(i) -> dict:
        n, length, sampling = rounds[i]
        params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, **sampling)
        before, padded, t0 = runner.num_compilations, runner.num_padded_steps, time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts[i]], params, use_tqdm=False)
        return {"round": i, "n": n, "len": length, "sampling": sampling, "s": round(time.perf_counter() - t0, 3),
                "compilations": runner.num_compilations - before, "padded_steps": runner.num_padded_steps - padded}

    for i in range(len(rounds)):
        print(json.dumps({"pad": args.pad, "pass": 1, **run(i)}), flush=True)
    runner.wait_for_compiles()
    again = [[run(i) for i in range(len(rounds))] for _ in range(3)]  # a program's first run loads its kernels
    for i in range(len(rounds)):
        runs = sorted((a[i] for a in again), key=lambda r: r["s"])
        print(json.dumps({"pad": args.pad, "pass": 2, **runs[1], "s_first": again[0][i]["s"]}), flush=True)


def parent(args) -> int:
    rows = []
    for pad in args.settings:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--pad", pad, "--shape", args.shape,
               "--scale", str(args.scale)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if args.log_dir:  # the engine's log: what compiled where and when
            with open(os.path.join(args.log_dir, f"compile_stalls_pad{pad}.log"), "w") as f:
                f.write(proc.stderr)
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                print(line, flush=True)
                rows.append(json.loads(line))
        if proc.returncode:
            print(proc.stderr[-4000:], file=sys.stderr)
            return proc.returncode
    print("\n| round | prompts x tokens | sampling | " + " | ".join(
        f"pad={p}: first / again (s), compilations" for p in args.settings) + " |")
    print("|---|---|---|" + "---|" * len(args.settings))
    for i in range(len(ROUNDS)):
        cells = []
        for pad in args.settings:
            first = next(r for r in rows if r.get("pass") == 1 and r["pad"] == pad and r["round"] == i)
            again = next(r for r in rows if r.get("pass") == 2 and r["pad"] == pad and r["round"] == i)
            cells.append(f"{first['s']:.2f} / {again['s']:.2f}, {first['compilations']}")
        print(f"| {i} | {first['n']} x {first['len']} | {first['sampling']} | " + " | ".join(cells) + " |")
    for pad in args.settings:
        ready = next(r for r in rows if r.get("event") == "ready" and r["pad"] == pad)
        total = [sum(r["s"] for r in rows if r.get("pass") == k and r["pad"] == pad) for k in (1, 2)]
        print(f"pad={pad}: LLM() with warm-up {ready['s']} s ({ready['compilations']} compilations); rounds first "
              f"{total[0]:.2f} s, again {total[1]:.2f} s")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--scale", type=float, default=1.0, help="prompts and prompt lengths scaled by this")
    p.add_argument("--settings", nargs="+", default=["0", "1"], help="LMJAX_PAD_TO_COMPILED values, in order")
    p.add_argument("--log-dir", help="write each setting's engine log (stderr) there")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--pad", default="1", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
