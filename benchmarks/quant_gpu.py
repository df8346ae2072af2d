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
"""
from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from gpu_suite import environment  # noqa: E402
from hf_baseline import run_bounded  # noqa: E402 (kills a child's whole process group at its cap)
from latency import H200_COPY_BANDWIDTH, tempfile_path  # noqa: E402
from random_model import SHAPES  # noqa: E402

RESERVE_S = 10  # kept back from the budget for the report
QUANTS = {"bf16": None, "w8": "w8", "w4": "w4"}  # decode rows -> `lmjax convert --quant`
RTN_NOTE = ("w4 codes by round to nearest (--w4-method rtn), not GPTQ: the decode step reads the same bytes "
            "whatever chose the int4 values, and GPTQ calibration on this shape would only spend device time")


# ------------------------------------------------------------------ files and the page cache
def files_under(directory: str) -> list[str]:
    return sorted(os.path.join(root, name) for root, _, names in os.walk(directory) for name in names)


def bytes_on_disk(directory: str) -> int:
    return sum(os.path.getsize(p) for p in files_under(directory))


def evict(directory: str) -> None:
    """Drop the directory's files from the page cache: DONTNEED drops clean pages only, hence sync first."""
    os.sync()
    for path in files_under(directory):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def prewarm(directory: str, chunk: int = 64 << 20) -> None:
    """Read every file once, so that a warm load finds all of it in the page cache."""
    for path in files_under(directory):
        with open(path, "rb", buffering=0) as f:
            while f.read(chunk):
                pass


def resident_fraction(directory: str) -> float | None:
    """Fraction of the directory's pages in the page cache (mincore over a read-only mapping, which reads
    nothing); None where libc will not tell. It is the evidence that "cold" was cold in this VM (a
    hypervisor's own cache below the guest can still make cold reads fast: that one we can not see)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        page, resident, total = mmap.PAGESIZE, 0, 0
        for path in files_under(directory):
            size = os.path.getsize(path)
            if size:
                resident += _resident_pages(libc, path, size, page)
                total += -(-size // page)
        return resident / total if total else None
    except (OSError, AttributeError):
        return None


def _resident_pages(libc, path: str, size: int, page: int) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            vec = (ctypes.c_ubyte * -(-size // page))()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            return len(vec) - bytes(vec).count(0)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def filesystem_of(path: str) -> str | None:
    """Type of the filesystem holding `path` (/proc/mounts, longest mount point): on tmpfs the files are
    the page cache, so no load from there can be cold."""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return None
    path = os.path.realpath(path)
    inside = [(m, t) for m, t in mounts if path == m or path.startswith(m.rstrip("/") + "/")]
    return max(inside, key=lambda mt: len(mt[0]))[1] if inside else None


def conversion_info(path: str) -> dict | None:
    """The `lmjax` entry of a finished `lmjax convert` output's config.json (dtype, quant...), else None.
    Read by hand, like lmjax.loader.orbax_loader.is_converted: importing that module would import jax here."""
    config = os.path.join(path, "config.json")
    if not (os.path.isdir(os.path.join(path, "lmjax_orbax")) and os.path.exists(config)):
        return None
    with open(config) as f:
        return json.load(f).get("lmjax") or {}


# ------------------------------------------------------------------ children (run with --side)
def load_child(args) -> dict:
    """--side load: imports, backend start and load_model timed apart; load ends when every parameter
    is on the device. The persistent compilation cache is on, as in the engine (which turns it on before
    it loads): the safetensors path jits a transpose per weight shape."""
    t0 = time.perf_counter()
    import jax
    from flax import nnx

    from lmjax.engine.compile_cache import enable_compilation_cache
    from lmjax.loader.model_loader import load_model
    t1 = time.perf_counter()
    importlib.import_module("orbax.checkpoint")  # the Orbax reader imports it on first use: an import
    t2 = time.perf_counter()
    device = jax.devices()[0]
    enable_compilation_cache()
    t3 = time.perf_counter()
    loaded = load_model(args.model, args.dtype)
    jax.block_until_ready(jax.tree.leaves(nnx.state(loaded.model)))
    t4 = time.perf_counter()
    params = jax.tree.leaves(nnx.state(loaded.model))
    return {"import_s": t1 - t0, "orbax_import_s": t2 - t1, "backend_init_s": t3 - t2, "load_s": t4 - t3,
            "param_bytes": sum(p.nbytes for p in params), "device": device.device_kind, "jax": jax.__version__}


def weight_bytes(path: str, dtype: str) -> dict:
    """Parameter bytes of the model `path` holds as lmjax builds it (abstractly: nothing is allocated),
    quantized or not; the input embedding apart, since a step gathers one row of it, not the table."""
    import jax.numpy as jnp
    from flax import nnx

    from lmjax.loader.orbax_loader import build_abstract
    from lmjax.loader.safetensors_loader import read_config

    _, _, state = build_abstract(read_config(path), jnp.dtype(dtype))
    sizes = {".".join(map(str, p)): v.size * jnp.dtype(v.dtype).itemsize for p, v in nnx.to_flat_state(state)}
    embed = sum(n for k, n in sizes.items() if "embed_tokens" in k)
    return {"param_bytes": sum(sizes.values()), "embedding_bytes": embed}


def decode_child(args) -> dict:
    """--side decode: latency.py's engine measurement (start, one warm-up request, --decode-repeats)."""
    from latency import fixed_prompt, run_lmjax

    settings = argparse.Namespace(dtype=args.dtype, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                                  repeats=args.decode_repeats, warmup=1, start_only=False)
    result = run_lmjax(args.model, fixed_prompt(args.model, args.prompt_len, args.seed), settings)
    return {**result, **weight_bytes(args.model, args.dtype)}


def checkpoint_child(args) -> dict:
    """--side checkpoint: the random safetensors checkpoint (torch on the GPU, in its own process so its
    CUDA context is gone before JAX starts)."""
    from random_model import ensure_checkpoint

    path, write_s = ensure_checkpoint(args.shape, args.dtype, args.checkpoint_root, args.seed)
    return {"path": path, "write_s": write_s}


SIDES = {"load": load_child, "decode": decode_child, "checkpoint": checkpoint_child}


# ------------------------------------------------------------------ the budgeted run
class Run:
    """Budget, logs and the JSON record: every child runs through `child`, every step is saved."""

    def __init__(self, args):
        self.args, self.t0 = args, time.perf_counter()
        parts = "+".join(args.parts)
        self.json_path = os.path.join(args.out, f"quant_gpu-{args.shape}-{parts}.json")
        self.record = {"shape": args.shape, "parts": args.parts, "budget_s": args.budget,
                       "environment": environment(), "settings": _settings(args), "notes": [RTN_NOTE],
                       "steps": [], "conversions": {}, "load": {"samples": []}, "decode": {}}
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false",
                    "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
        self.gb = 0.0  # checkpoint size, scales the time estimates

    def left(self) -> float:
        return self.args.budget - (time.perf_counter() - self.t0) - RESERVE_S

    def estimate(self, kind: str) -> float:
        """Least seconds a step needs to be worth starting (guesses for the GPU machine's slow host)."""
        base, per_gb = {"checkpoint": (20, 5), "convert": (15, 9), "load": (8, 2.5), "decode": (25, 3.5)}[kind]
        return base + per_gb * self.gb

    def skip_unless_fits(self, name: str, *kinds: str) -> bool:
        """Whether steps of these kinds, one after the other, fit what is left; records a skip if not (so no
        conversion is made for a measurement that could not follow it)."""
        need, left = sum(map(self.estimate, kinds)), self.left()
        if left < need:
            self._finish(name, f"skipped: {left:.0f} s of the budget left, it needs at least {need:.0f} s", 0, None)
        return left >= need

    def save(self) -> None:
        self.record["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        tmp = self.json_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.record, f, indent=1)
        os.replace(tmp, self.json_path)

    def child(self, name: str, argv: list[str], kind: str, env: dict | None = None) -> tuple[str, dict | None]:
        """Run argv under min(cap, budget left); its output goes to OUT/<name>.log. A `--side` child
        writes its result to a file we hand it. Returns (status, result or None)."""
        if not self.skip_unless_fits(name, kind):
            return "skipped", None
        side = "--side" in argv
        result = tempfile_path("lmjax-quantbench-", ".json") if side else None
        argv = argv + (["--result", result] if side else [])
        cap = min(self.left(), self.args.child_timeout)
        log_path = os.path.join(self.args.out, f"{name}.log")
        print(f"[{name}] started (cap {cap:.0f} s)", flush=True)
        t0 = time.perf_counter()
        with open(log_path, "w") as log:
            log.write(" ".join(argv) + "\n")
            log.flush()
            code, _ = run_bounded(argv, cap, stdout=log, stderr=subprocess.STDOUT, env={**self.env, **(env or {})},
                                  cwd=REPO)
        seconds = time.perf_counter() - t0
        status = ("ok" if code == 0 else f"killed at its cap of {cap:.0f} s" if code is None
                  else f"failed (exit {code})")
        out = _read_result(result, code == 0) if side else None
        if status != "ok":
            with open(log_path) as f:
                print(f"[{name}] {status}; last lines of {log_path}:\n{f.read()[-1500:]}", flush=True)
        return self._finish(name, status, seconds, out)

    def _finish(self, name: str, status: str, seconds: float, out: dict | None) -> tuple[str, dict | None]:
        self.record["steps"].append({"name": name, "status": status, "seconds": round(seconds, 2)})
        print(f"[{name}] {status} ({seconds:.1f} s)", flush=True)
        self.save()
        return status, out

    def side(self, side: str, *extra: str) -> list[str]:
        a = self.args
        return [sys.executable, os.path.abspath(__file__), "--side", side, "--shape", a.shape, "--dtype", a.dtype,
                "--seed", str(a.seed), *extra]


def _read_result(path: str, ok: bool) -> dict | None:
    """The JSON a `--side` child wrote (None unless it exited cleanly); the file goes either way."""
    try:
        with open(path) as f:
            text = f.read()
        return json.loads(text) if ok and text.strip() else None
    finally:
        os.unlink(path)


def _settings(args) -> dict:
    keys = ("dtype", "group_size", "prompt_len", "new_tokens", "decode_repeats", "load_repeats", "bandwidth",
            "checkpoint_root", "decode", "smoke")
    return {k: getattr(args, k) for k in keys}


# ------------------------------------------------------------------ steps
def checkpoint(run: Run) -> str | None:
    a = run.args
    status, out = run.child("checkpoint", run.side("checkpoint", "--checkpoint-root", a.checkpoint_root),
                            "checkpoint")
    if out is None:
        return None
    run.gb = bytes_on_disk(out["path"]) / 1e9
    run.record["checkpoint"] = {**out, "bytes_on_disk": bytes_on_disk(out["path"])}
    run.save()
    return out["path"]


def convert(run: Run, src: str, quant: str | None) -> str | None:
    """The conversion of `src` for `quant` (None: plain bf16 Orbax) under --checkpoint-root, reused when a
    finished one is there; None when it was skipped or failed."""
    a = run.args
    name = f"orbax-{quant or a.dtype}"
    out = os.path.join(a.checkpoint_root, f"lmjax-conv-{a.shape}-{a.dtype}-{quant or 'float'}")
    entry = run.record["conversions"].setdefault(name, {"path": out})
    want = {"method": quant, "group_size": a.group_size} if quant else None
    info = conversion_info(out)
    if info is not None and info.get("dtype") == a.dtype and _layout(info.get("quant")) == want:
        entry.update(status="reused (converted by an earlier run)", bytes_on_disk=bytes_on_disk(out))
        run.save()
        return out
    _remove_partial(out)
    argv = [sys.executable, "-m", "lmjax.cli", "convert", src, out, "--dtype", a.dtype, "--overwrite"]
    if quant:
        argv += ["--quant", quant, "--group-size", str(a.group_size), "--w4-method", "rtn"]
    t0 = time.perf_counter()
    status, _ = run.child(f"convert-{name}", argv, "convert", env={"JAX_PLATFORMS": "cpu"})
    entry.update(status=status, seconds=round(time.perf_counter() - t0, 1))
    ok = status == "ok" and conversion_info(out) is not None
    if ok:
        entry["bytes_on_disk"] = bytes_on_disk(out)
    run.save()
    return out if ok else None


def _layout(quant: dict | None) -> dict | None:
    return {"method": quant["method"], "group_size": quant.get("group_size")} if quant else None


def _remove_partial(out: str) -> None:
    """What a conversion killed at its cap leaves: `.NAME.tmp-*` beside OUT (convert's own naming)."""
    parent, base = os.path.split(out)
    for name in os.listdir(parent) if os.path.isdir(parent) else []:
        if name.startswith(f".{base}.tmp-") or name.startswith(f".{base}.old-"):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def drop(run: Run, name: str) -> None:
    entry = run.record["conversions"].get(name, {})
    if run.args.keep_checkpoints or not os.path.isdir(entry.get("path", "")):
        return
    shutil.rmtree(entry["path"])
    entry["deleted"] = True
    run.save()


def load_part(run: Run, safetensors: str) -> None:
    if not run.skip_unless_fits("load", "convert", "load", "load"):
        return
    orbax = convert(run, safetensors, None)
    if orbax is None:
        run.record["load"]["status"] = "skipped: no Orbax conversion"
        return
    formats = {"safetensors": safetensors, "orbax": orbax}
    run.record["load"]["bytes_on_disk"] = {f: bytes_on_disk(p) for f, p in formats.items()}
    fs = run.record["load"]["filesystem"] = filesystem_of(run.args.checkpoint_root)
    if fs == "tmpfs":
        run.record["notes"].append(f"--checkpoint-root {run.args.checkpoint_root} is on tmpfs: the files live in "
                                   "memory, no cold load is possible (point it at a disk)")
    for mode in ("cold", "warm"):
        for i in range(run.args.load_repeats):
            for fmt, path in formats.items():
                load_sample(run, fmt, path, mode, i + 1)
    samples = run.record["load"]["samples"]
    run.record["load"]["summary"] = load_summary(samples)
    run.save()
    if all(s["status"] == "ok" for s in samples):  # else kept for the next run
        drop(run, f"orbax-{run.args.dtype}")


def load_sample(run: Run, fmt: str, path: str, mode: str, repeat: int) -> None:
    (evict if mode == "cold" else prewarm)(path)
    resident = resident_fraction(path)
    t0 = time.perf_counter()
    status, out = run.child(f"load-{mode}-{fmt}-{repeat}", run.side("load", "--model", path), "load")
    sample = {"format": fmt, "mode": mode, "repeat": repeat, "status": status, "page_cache_resident": resident,
              "process_s": round(time.perf_counter() - t0, 2), **(out or {})}
    run.record["load"]["samples"].append(sample)
    run.save()


def load_summary(samples: list[dict]) -> dict:
    """Per (format, mode): median and every sample of the load time, median import and backend start."""
    summary = {}
    for s in samples:
        if "load_s" in s:
            summary.setdefault(f"{s['format']}-{s['mode']}", []).append(s)
    out = {k: {"load_s_median": statistics.median(x["load_s"] for x in v),
               "load_s_samples": [round(x["load_s"], 3) for x in v],
               "import_s_median": statistics.median(x["import_s"] + x["orbax_import_s"] for x in v),
               "backend_init_s_median": statistics.median(x["backend_init_s"] for x in v),
               "process_s_median": statistics.median(x["process_s"] for x in v),
               "resident_before": [x["page_cache_resident"] for x in v]} for k, v in summary.items()}
    for mode in ("cold", "warm"):
        st, ob = out.get(f"safetensors-{mode}"), out.get(f"orbax-{mode}")
        if st and ob:
            out[f"speedup_{mode}"] = st["load_s_median"] / ob["load_s_median"]
    return out


def decode_part(run: Run, safetensors: str) -> None:
    a = run.args
    for weights in a.decode:
        quant = QUANTS[weights]
        if quant and not run.skip_unless_fits(f"decode-{weights}", "convert", "decode"):
            run.record["decode"][weights] = {"status": "skipped (budget)"}
            continue
        path = safetensors if quant is None else convert(run, safetensors, quant)
        if path is None:
            run.record["decode"][weights] = {"status": "skipped: no conversion"}
            run.save()
            continue
        extra = ["--model", path, "--prompt-len", str(a.prompt_len), "--new-tokens", str(a.new_tokens),
                 "--decode-repeats", str(a.decode_repeats)]
        status, out = run.child(f"decode-{weights}", run.side("decode", *extra), "decode")
        row = {"status": status, "path": path, **(out or {})}
        if "param_bytes" in row:
            row["roofline_ms"] = 1e3 * row["param_bytes"] / a.bandwidth
        run.record["decode"][weights] = row
        run.save()
        if quant and status == "ok":  # a failed row keeps its conversion for the next run
            drop(run, f"orbax-{quant}")
    ratios(run.record["decode"])
    run.save()


def ratios(decode: dict) -> None:
    """bf16 step time / each row's, next to the ideal one (the ratio of the parameter bytes)."""
    base = decode.get("bf16", {})
    for row in decode.values():
        if "step_ms" in row and "step_ms" in base:
            row["speedup_vs_bf16"] = base["step_ms"] / row["step_ms"]
            row["bytes_ratio_vs_bf16"] = base["param_bytes"] / row["param_bytes"]


# ------------------------------------------------------------------ report
def _f(value, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else "-"


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


def load_table(load: dict) -> list[str]:
    s, disk = load["summary"], load.get("bytes_on_disk", {})
    lines = ["| format | GB on disk | cold load s (median) | cold samples | warm load s (median) | warm samples "
             "| import s | backend start s | page cache before cold / warm |", "|---|---|---|---|---|---|---|---|---|"]
    for fmt in ("safetensors", "orbax"):
        cold, warm = s.get(f"{fmt}-cold", {}), s.get(f"{fmt}-warm", {})
        resident = f"{_f(_most(cold.get('resident_before')))} / {_f(_most(warm.get('resident_before')))}"
        lines.append(f"| {fmt} | {_f(disk.get(fmt, 0) / 1e9, 3)} | {_f(cold.get('load_s_median'))} | "
                     f"{', '.join(map(_f, cold.get('load_s_samples', [])))} | {_f(warm.get('load_s_median'))} | "
                     f"{', '.join(map(_f, warm.get('load_s_samples', [])))} | {_f(cold.get('import_s_median'))} | "
                     f"{_f(cold.get('backend_init_s_median'))} | {resident} |")
    cold_resident = [_most(s.get(f"{f}-cold", {}).get("resident_before")) for f in ("safetensors", "orbax")]
    if any(x is not None and x > 0.05 for x in cold_resident):
        lines.append("\n**warning**: up to " + f"{max(x for x in cold_resident if x is not None):.0%} of a "
                     "checkpoint was still in the page cache before a cold sample: not fully cold")
    lines.append(f"\ncold load safetensors / orbax: **{_f(s.get('speedup_cold'))}x** (target >= 2x); "
                 f"warm: {_f(s.get('speedup_warm'))}x. Load = load_model() until every parameter is on the "
                 "device; imports (jax, lmjax, orbax) and backend start are apart; page cache column: the "
                 "largest resident fraction of the checkpoint's pages before a sample.")
    return lines


def _most(fractions: list | None) -> float | None:
    known = [x for x in fractions or [] if x is not None]
    return max(known) if known else None


def decode_table(record: dict) -> list[str]:
    st, rows = record["settings"], record["decode"]
    lines = [f"batch 1, prompt {st['prompt_len']}, {st['new_tokens']} new tokens, greedy, roofline = parameter "
             f"bytes / {st['bandwidth']:.3g} B/s", "",
             "| weights | param GB | roofline ms | step ms | p10 | p90 | x roofline | bf16 / this | ideal (bytes) "
             "| engine start s |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [decode_row(name, r) for name, r in rows.items()]
    w4 = rows.get("w4", {}).get("speedup_vs_bf16")
    lines.append(f"\nw4 vs bf16: **{_f(w4)}x** (target >= 2.5x). K = num_scheduler_steps "
                 f"{_first(rows, 'num_scheduler_steps')} (engine default). Parameter bytes include the input "
                 "embedding table, of which a step reads one row (latency.py's convention); without it: "
                 + ", ".join(f"{k} {_f((r['param_bytes'] - r['embedding_bytes']) / 1e9, 3)} GB"
                             for k, r in rows.items() if "embedding_bytes" in r) + ".")
    return lines


def decode_row(name: str, r: dict) -> str:
    if "step_ms" not in r:
        return f"| {name} | {r.get('status')} |||||||||"
    p, start = r.get("step_ms_pct", {}), r.get("start", {})
    cells = [name, _f(r["param_bytes"] / 1e9, 3), _f(r["roofline_ms"], 3), _f(r["step_ms"], 3),
             _f(p.get("p10"), 3), _f(p.get("p90"), 3), _f(r["step_ms"] / r["roofline_ms"]),
             _f(r.get("speedup_vs_bf16")), _f(r.get("bytes_ratio_vs_bf16")),
             _f(start.get("load_s", 0) + start.get("first_request_s", 0), 1)]
    return "| " + " | ".join(cells) + " |"


def _first(rows: dict, key: str):
    return next((r[key] for r in rows.values() if key in r), "?")


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
