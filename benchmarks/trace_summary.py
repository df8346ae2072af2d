"""Where a GPU's time goes, from a JAX profiler trace: kernels grouped by name, busy time vs wall time.

    python benchmarks/trace_summary.py TRACE_DIR [--device 0] [--top 25] [--steps N]

TRACE_DIR is what `jax.profiler.trace(dir, create_perfetto_trace=True)` wrote (its perfetto_trace.json.gz
is read; no TensorBoard needed). Prints, for one GPU: each kernel name's total and per-step time and
count, the busy time (union of kernel intervals) and the span from the first kernel's start to the last
one's end; span - busy is the device's idle time between kernels, and that idle time by gap length:
gaps of a few microseconds are kernel launch latency inside a step, long ones are the device waiting on
the host (a while loop's predicate read back each iteration, a host round trip between calls).
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os


def load_events(trace_dir: str) -> tuple[list[dict], dict[int, str]]:
    paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir!r}")
    with gzip.open(max(paths, key=os.path.getmtime)) as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    return events, names


def gpu_kernels(events: list[dict], names: dict[int, str], device: int) -> list[dict]:
    pids = {pid for pid, name in names.items() if f"GPU:{device}" in name or name.endswith(f"/device:{device}")}
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in pids and e.get("dur") is not None]


def busy_us(kernels: list[dict]) -> float:
    """Length of the union of [ts, ts + dur) over kernels (streams overlap)."""
    total, end = 0.0, float("-inf")
    for e in sorted(kernels, key=lambda e: e["ts"]):
        start, stop = e["ts"], e["ts"] + e["dur"]
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


GAP_BUCKETS_US = (2.0, 5.0, 20.0, 100.0)  # upper edges; the last bucket is everything longer


def idle_gaps_us(kernels: list[dict]) -> list[float]:
    """Lengths of the holes in the union of kernel intervals."""
    gaps, end = [], None
    for e in sorted(kernels, key=lambda e: e["ts"]):
        if end is not None and e["ts"] > end:
            gaps.append(e["ts"] - end)
        end = e["ts"] + e["dur"] if end is None else max(end, e["ts"] + e["dur"])
    return gaps


def gap_histogram(gaps: list[float]) -> list[tuple[str, int, float]]:
    """(bucket label, count, total us) of idle gaps by length."""
    edges = (0.0,) + GAP_BUCKETS_US + (float("inf"),)
    return [(f"{lo:g}-{hi:g} us" if hi != float("inf") else f">={lo:g} us",
             sum(1 for g in gaps if lo <= g < hi), sum(g for g in gaps if lo <= g < hi))
            for lo, hi in zip(edges, edges[1:])]


def summarize(trace_dir: str, device: int = 0, top: int = 25, steps: int = 1) -> dict:
    events, names = load_events(trace_dir)
    kernels = gpu_kernels(events, names, device)
    if not kernels:
        raise ValueError(f"no kernel events for GPU {device}; processes: {sorted(set(names.values()))}")
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for e in kernels:
        by_name[e["name"]][0] += e["dur"]
        by_name[e["name"]][1] += 1
    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    return {"span_us": span, "busy_us": busy_us(kernels), "kernels": len(kernels), "steps": steps,
            "gaps": gap_histogram(idle_gaps_us(kernels)),
            "top": [(name[:90], us, n) for name, (us, n) in rows[:top]]}


def print_summary(s: dict) -> None:
    k = s["steps"]
    print(f"span {s['span_us'] / k:.1f} us/step, busy {s['busy_us'] / k:.1f} us/step "
          f"({100 * s['busy_us'] / s['span_us']:.1f}%), {s['kernels'] / k:.0f} kernels/step")
    print("idle by gap length: " + ", ".join(f"{label}: {n / k:.1f} x, {us / k:.1f} us" for label, n, us in s["gaps"])
          + " (per step)")
    print(f"{'us/step':>9} {'count/step':>10}  kernel")
    for name, us, n in s["top"]:
        print(f"{us / k:9.1f} {n / k:10.1f}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace_dir")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--steps", type=int, default=1, help="divide by this many steps")
    args = parser.parse_args()
    print_summary(summarize(args.trace_dir, args.device, args.top, args.steps))


if __name__ == "__main__":
    main()
