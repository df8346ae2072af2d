"""Batch-1 decode step time under each of the engine's opt-in step changes, one fresh process per variant
(the switches are environment variables read when the step is traced), in one run so the figures compare.

    python benchmarks/decode_levers.py --shape llama-3-8b                 # every variant below
    python benchmarks/decode_levers.py --shape llama-3.2-1b --variants xla fused-qkv default
    python benchmarks/decode_levers.py --variants default --extra 'no-graphs:XLA_FLAGS=--xla_gpu_enable_command_buffer='

    python benchmarks/decode_levers.py --shape tiny --iters 3             # CPU smoke

Each variant runs benchmarks/tp_decode.py (tp 1, random weights made on the device, the engine's own
multi-step decode call; `--steps` steps per call, per-step time = call time / steps) and the table gives
the multi-step ms per step, its ratio to the roofline (parameter bytes / `--bandwidth`), to the first
variant, and whether the first 8 greedy tokens equal the first variant's (random bf16 weights make
near-ties: a flip late in the 8 is rounding, see BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = {  # name -> environment for the step
    "xla": {"LMJAX_KV_WRITE_IMPL": "reference", "LMJAX_MERGE_GATE_UP": "0"},  # RoPE + two scatters by XLA
    "fused-qkv": {"LMJAX_MERGE_GATE_UP": "0"},  # merged q/k/v weight into the fused RoPE + KV-write kernel
    "default": {},  # the GPU default: fused-qkv + one gate/up weight
    "add-norm": {"LMJAX_NORM_IMPL": "kernel"},  # + residual add and RMSNorm in one Pallas launch
}


def parse_extra(spec: str) -> tuple[str, dict]:
    """'NAME:VAR=VALUE,VAR=VALUE' -> (NAME, environment); a value may itself hold '=' (XLA flags)."""
    name, sep, assignments = spec.partition(":")
    pairs = [a.partition("=") for a in assignments.split(",") if a]
    if not (name and sep and pairs and all(p[1] for p in pairs)):
        raise ValueError(f"--extra {spec!r} must look like NAME:VAR=VALUE[,VAR=VALUE]")
    return name, {var: value for var, _, value in pairs}


def run_variant(name: str, args) -> dict:
    cmd = [sys.executable, os.path.join(HERE, "tp_decode.py"), "--shape", args.shape, "--tp", "1",
           "--steps", str(args.steps), "--block-size", str(args.block_size), "--context", str(args.context),
           "--iters", str(args.iters), "--warmup", "2"]
    env = {**os.environ, **args.variant_env[name]}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"tp"')]
    if proc.returncode or not rows:
        return {"variant": name, "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return {"variant": name, **rows[0]}


def table(results: list[dict], bandwidth: float) -> str:
    base = next((r for r in results if "error" not in r), None)
    lines = ["| variant | ms / step | x roofline | vs first | first 8 tokens equal |", "|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {' '.join(r['error'])} | | | |")
            continue
        roofline_ms = r["param_gib_per_device"] * 2**30 / bandwidth * 1e3
        ms = r["multi_step_ms_per_step"]
        x_roof = f"{ms / roofline_ms:.2f}" if roofline_ms else "-"  # tiny shapes round to 0 GiB
        lines.append(f"| {r['variant']} | {ms:.3f} | {x_roof} | "
                     f"{ms / base['multi_step_ms_per_step']:.3f} | {r['greedy_tokens'][:8] == base['greedy_tokens'][:8]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3-8b")
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--bandwidth", type=float, default=4.26e12, help="copy bandwidth, bytes/s (H200: 4.26e12)")
    parser.add_argument("--timeout", type=float, default=180, help="seconds per variant")
    parser.add_argument("--extra", nargs="*", default=[], help="more variants, NAME:VAR=VALUE[,VAR=VALUE], run last")
    args = parser.parse_args()
    extras = dict(parse_extra(spec) for spec in args.extra)
    args.variant_env = {**VARIANTS, **extras}
    results = []
    for name in [*args.variants, *extras]:
        results.append(run_variant(name, args))
        print(json.dumps(results[-1]), flush=True)
    print(table(results, args.bandwidth), flush=True)


if __name__ == "__main__":
    main()
