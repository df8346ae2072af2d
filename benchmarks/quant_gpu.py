"""Issue 7's GPU figures in one budgeted command: cold and warm load of the Orbax conversion against the
safetensors it came from, and batch-1 decode step time with w4 and w8 weights against bf16.

    python benchmarks/quant_gpu.py OUT --shape llama-3-8b                   # both parts, as much as fits
    python benchmarks/quant_gpu.py OUT --shape llama-3-8b --parts load      # one part per command
    python benchmarks/quant_gpu.py OUT --shape llama-3-8b --parts decode
    python benchmarks/quant_gpu.py /tmp/qb --shape tiny --smoke             # CPU check of the whole flow

Data flow (this process never imports jax or torch: every measurement runs in a fresh child process
with the whole device to itself, under a cap that the time budget leaves):
  checkpoint  random bf16 weights of --shape (random_model.ensure_checkpoint: torch draws them on the
              GPU) as HF safetensors under --checkpoint-root, written once and reused.
  load        `lmjax convert SRC OUT --dtype bfloat16` (no quantization: the same bytes as the source), then
              load_model(...) in a child per sample, timed until every parameter is on the device
              (block_until_ready), imports and backend start timed apart. Cold = the checkpoint's files
              dropped from the page cache first (sync, then posix_fadvise DONTNEED on each file; the
              resident fraction is read back with mincore); warm = every file read once just before.
              Order: safetensors, orbax, safetensors, orbax... for each mode.
  decode      latency.run_lmjax in a child per weight format: the engine's batch-1 step time (prompt 128,
              128 new tokens, greedy, ignore_eos, the engine's default num_scheduler_steps). bf16 from
              the safetensors; w4 (int4, groups of --group-size) and w8 (int8 per channel) from their
              conversions, made with `--w4-method rtn`: a step reads the same bytes whatever chose the int4
              codes, and GPTQ's calibration on 8B would only spend device time. Roofline = the model's
              parameter bytes (from lmjax's own abstract model) / --bandwidth.
Conversions run as `python -m lmjax.cli convert` children on the CPU backend (conversion works on the
host anyway; this keeps the GPU free) and are timed; each is deleted once its part is done (unless
--keep-checkpoints); one left by an interrupted run is reused. OUT gets logs (<step>.log), the JSON
record (rewritten after every step, so a timeout still leaves results) and the markdown tables.

Modules: this one is the command line, the `--side` dispatch of the children and the report;
quant_runner.py the budget, children, record and conversions both parts share; quant_load.py and
quant_decode.py one part each (child, steps, table); page_cache.py the files and the page cache.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from latency import H200_COPY_BANDWIDTH  # noqa: E402
from quant_decode import QUANTS, decode_child, decode_part, decode_table  # noqa: E402
from quant_load import load_child, load_part, load_table  # noqa: E402
from quant_runner import Run, checkpoint, checkpoint_child  # noqa: E402
from random_model import SHAPES  # noqa: E402

SIDES = {"load": load_child, "decode": decode_child, "checkpoint": checkpoint_child}


# ------------------------------------------------------------------ report
def report(record: dict) -> str:
    """Markdown tables of whatever was measured, with the settings and the targets."""
    lines = [f"quant_gpu {record['shape']}: device {_device(record)}, commit {record['environment'].get('commit')}"]
    load = record["load"]
    if load.get("summary"):
        lines += [*load_table(load), ""]
    if any("step_ms" in r for r in record["decode"].values()):
        lines += [*decode_table(record), ""]
    conv = record["conversions"]
    if conv:
        lines.append("conversions: " + "; ".join(
            f"{k} {v.get('status')}" + (f" in {v['seconds']:.0f} s" if "seconds" in v else "")
            + (f", {v['bytes_on_disk'] / 1e9:.2f} GB" if "bytes_on_disk" in v else "")
            + (" (deleted after use)" if v.get("deleted") else "") for k, v in conv.items()))
    if "H100" in _device(record) and record["settings"]["bandwidth"] == H200_COPY_BANDWIDTH:
        lines.append("note: the roofline assumed an H200's copy bandwidth on an H100 (pass --bandwidth; "
                     "roofline ms scales as 4.26e12 / the bandwidth)")
    lines += [f"note: {n}" for n in record["notes"]]
    lines += [f"{s['name']}: {s['status']}" for s in record["steps"] if s["status"] != "ok"]
    return "\n".join(lines)


def _device(record: dict) -> str:
    for row in list(record["decode"].values()) + record["load"]["samples"]:
        if "device" in row:
            return f"{row['device']} (jax {row.get('jax')})"
    return "?"


# ------------------------------------------------------------------ main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?", help="directory for logs, the JSON record and the tables (keep it small: "
                   "checkpoints go under --checkpoint-root)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3-8b")
    p.add_argument("--parts", nargs="+", choices=("load", "decode"), default=["load", "decode"])
    p.add_argument("--decode", nargs="+", choices=tuple(QUANTS), default=["bf16", "w4", "w8"],
                   help="decode rows, in priority order (w8 last: the issue's target is w4 vs bf16)")
    p.add_argument("--budget", type=float, default=540, help="seconds for the whole command")
    p.add_argument("--child-timeout", type=float, default=420, help="cap of any one child, seconds")
    p.add_argument("--checkpoint-root", default="/tmp/lmjax-quantbench")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep the conversions after use")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--group-size", type=int, default=128, help="int4 group size (w4)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--decode-repeats", type=int, default=5, help="timed requests per decode row")
    p.add_argument("--load-repeats", type=int, default=2, help="samples per format, cold and warm each")
    p.add_argument("--bandwidth", type=float, default=H200_COPY_BANDWIDTH,
                   help="copy bandwidth for the roofline, B/s (default: an H200's; pass the H100's there)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="small decode workload (CPU check of the whole flow)")
    p.add_argument("--side", choices=tuple(SIDES), help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.side is None and args.out is None:
        p.error("OUT is required")
    if args.smoke and args.side is None:
        args.prompt_len, args.new_tokens, args.decode_repeats = 16, 16, 2
    return args


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.side:
        result = SIDES[args.side](args)
        with open(args.result, "w") as f:
            json.dump(result, f)
        print(json.dumps({k: v for k, v in result.items() if k != "runs"}))  # for the log
        return None
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.checkpoint_root, exist_ok=True)
    run = Run(args)
    print(f"quant_gpu: {args.shape}, parts {' '.join(args.parts)}, budget {args.budget:.0f} s, "
          f"{run.record['environment']}", flush=True)
    path = checkpoint(run)
    if path is not None:
        for part in args.parts:
            (load_part if part == "load" else decode_part)(run, path)
    text = report(run.record)
    run.save()
    with open(os.path.join(args.out, f"quant_gpu-{args.shape}-{'+'.join(args.parts)}.md"), "w") as f:
        f.write(text + "\n")
    print("\n" + text)
    return run.record


if __name__ == "__main__":
    main()
