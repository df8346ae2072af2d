"""quant_gpu's shared runner: the budget, the children (each in a fresh process, under a cap that the budget
leaves, its output in OUT/<name>.log), the JSON record saved after every step, and the steps both parts
share: the random safetensors checkpoint and the `lmjax convert` conversions made from it (reused when a
finished one is there, deleted after use). Never imports jax: the children do."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SCRIPT = os.path.join(HERE, "quant_gpu.py")  # the CLI, which runs a child's --side
sys.path.insert(0, HERE)
from gpu_suite import environment  # noqa: E402
from hf_baseline import run_bounded  # noqa: E402 (kills a child's whole process group at its cap)
from latency import tempfile_path  # noqa: E402
from page_cache import bytes_on_disk  # noqa: E402

RESERVE_S = 10  # kept back from the budget for the report
RTN_NOTE = ("w4 codes by round to nearest (--w4-method rtn), not GPTQ: the decode step reads the same bytes "
            "whatever chose the int4 values, and GPTQ calibration on this shape would only spend device time")


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
        return [sys.executable, SCRIPT, "--side", side, "--shape", a.shape, "--dtype", a.dtype,
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


# ------------------------------------------------------------------ steps both parts share
def checkpoint_child(args) -> dict:
    """--side checkpoint: the random safetensors checkpoint (torch on the GPU, in its own process so its
    CUDA context is gone before JAX starts)."""
    from random_model import ensure_checkpoint

    path, write_s = ensure_checkpoint(args.shape, args.dtype, args.checkpoint_root, args.seed)
    return {"path": path, "write_s": write_s}


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


def conversion_info(path: str) -> dict | None:
    """The `lmjax` entry of a finished `lmjax convert` output's config.json (dtype, quant...), else None.
    Read by hand, like lmjax.loader.orbax_loader.is_converted: importing that module would import jax here."""
    config = os.path.join(path, "config.json")
    if not (os.path.isdir(os.path.join(path, "lmjax_orbax")) and os.path.exists(config)):
        return None
    with open(config) as f:
        return json.load(f).get("lmjax") or {}


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
        w4_flags = ["--group-size", str(a.group_size), "--w4-method", "rtn"]  # errors for w8 (unused there)
        argv += ["--quant", quant] + (w4_flags if quant == "w4" else [])
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


# ------------------------------------------------------------------ tables
def fmt_num(value, digits: int = 2) -> str:
    """A table cell: `value` with `digits` decimals, "-" where it was not measured."""
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else "-"
