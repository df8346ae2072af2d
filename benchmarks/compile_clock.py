"""JAX's own compile time and count, from jax.monitoring, for the benchmarks that report start-up."""
from __future__ import annotations


class CompileClock:
    """Seconds JAX spent tracing, lowering and compiling (or loading from the persistent cache), and the
    number of XLA compilations (or cache loads): these also catch recompilations without a retrace, which
    the engine's own counter (traces) does not see."""

    def __init__(self):
        from jax import monitoring

        self.seconds, self.count = 0.0, 0
        monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **_) -> None:
        if event.startswith("/jax/core/compile/"):
            self.seconds += duration
            self.count += event.endswith("backend_compile_duration")

    def snapshot(self) -> tuple[float, int]:
        return self.seconds, self.count
