"""Where a model load spends its time: seconds per phase, for the engine log and LoadedModel.load_seconds."""
from __future__ import annotations

import contextlib
import threading
import time


class PhaseTimes:
    """Seconds per named phase, summed over every entry. Thread-safe: placement runs on worker threads,
    so phases that overlap each other can add up to more than the load's wall time."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._lock = threading.Lock()
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def summary(self) -> dict[str, float]:
        """Every phase plus `total` (wall seconds since creation) and `cpu` (process CPU seconds, all
        threads: near `total` x cores means the host, not the disk or the device, sets the pace)."""
        return {**{k: round(v, 3) for k, v in self.seconds.items()},
                "total": round(time.perf_counter() - self._wall, 3), "cpu": round(time.process_time() - self._cpu, 3)}

    def describe(self) -> str:
        s = self.summary()
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in s.items() if k not in ("total", "cpu"))
        return f"{s['total']:.1f} s ({s['cpu']:.1f} s CPU): {phases}"
