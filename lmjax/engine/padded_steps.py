"""ModelRunner's one-step calls through the compile worker: a call whose program is not compiled yet runs at the
smallest larger compiled shape while its own compiles (lmjax.engine.step_shapes says why and when). The same
holds for the small sampler program of a variant sampled apart from the step (top-p, logprobs, ...): its rows R
are one more bucket, so a step whose sampler at R is not compiled runs at a shape whose sampler is."""
from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec

from lmjax import parallel
from lmjax.engine.background_compile import BackgroundCompiler, variant_key
from lmjax.engine.host_outputs import NO_EXTRAS
from lmjax.engine.step_shapes import (
    CompiledShapes,
    StepDims,
    pad_step_inputs,
    pad_to_compiled_enabled,
    shape_family,
    step_dims,
)
from lmjax.layers.sampler import SamplingFlags, SamplingRow, build_sampling_metadata


def step_static(flags: SamplingFlags, fused: bool, num_prompt_logprobs: int = -1, extras=NO_EXTRAS) -> dict:
    """The jitted step's static arguments: sampling fused into it (basic variants) or not (sampled apart from its
    logits, or on the host when extras.sample is off)."""
    return dict(flags=flags if fused else None, num_prompt_logprobs=num_prompt_logprobs,
                extras=extras if fused or not extras.sample else extras._replace(sample=False))


def step_variant(inputs, smeta, flags: SamplingFlags, fused: bool) -> tuple[tuple, dict, tuple]:
    """A one-step call's varying arguments, static arguments and their compiled variant's key (warm-up and
    padded steps select programs by it alike)."""
    varying, static = (inputs, smeta if fused else None), step_static(flags, fused)
    return varying, static, variant_key(varying, static)


class PaddedStepsMixin:
    """Mixed into ModelRunner (its params, caches, mesh, _step and _sample)."""

    def _init_padded_steps(self) -> None:
        # Off: steps go straight to the jitted step, as before. Off where several processes make the same calls
        # without a leader: each one's worker finishes at its own time, so they would run different programs for
        # one step and their collectives would not match (a leader never pads: it passes no rows).
        self.pad_to_compiled = pad_to_compiled_enabled() and jax.process_count() == 1
        context = lambda: parallel.use_mesh(self.mesh)  # noqa: E731
        self._steps = BackgroundCompiler(self._step, enabled=True, context=context, name="step", lower_here=True)
        self._samplers = BackgroundCompiler(self._sample, enabled=True, context=context, name="sampler",
                                            lower_here=True)
        self._shapes = CompiledShapes()
        self._logits_aval: tuple | None = None  # (V, dtype) of the logits sampled apart, once one step has run
        self.num_padded_steps = 0  # steps run by a larger shape's program while theirs compiled
        # Set by warm-up once large one-step shapes are compiled: then a decode call's new basic variant (plain
        # temperature sampling after a greedy warm-up) compiles on the worker too, its batch stepping once a call.
        self.pad_warmed = False

    def lower_deferred(self) -> None:
        """Trace the one-step programs that padded steps handed over since the last call, for the workers (the
        engine calls this at the start of a step: the step that met a new shape returned its tokens first)."""
        self._steps.lower_deferred()
        self._samplers.lower_deferred()

    def compilers(self) -> tuple[BackgroundCompiler, ...]:
        return self._decode, self._steps, self._samplers

    def wait_for_compiles(self) -> None:
        """Block until the variants compiling in the background are ready (a benchmark's warm-up)."""
        for compiler in self.compilers():
            compiler.wait()

    def decode_compiles_apart(self) -> bool:
        """Whether a decode call's new variant compiles on the worker (off across processes with no leader)."""
        return self._decode.enabled

    def compilers_busy(self) -> bool:
        """Whether any worker has a program queued or compiling (a prefetch waits until none has)."""
        return any(compiler.busy() for compiler in self.compilers())

    def prefetch_sampler(self, smeta, flags: SamplingFlags, R: int) -> None:
        """Hand the worker the sampler a step sampled apart at R rows runs for this sampling, traced here (the
        engine thread is idle). Nothing before any step was sampled apart (the logits' shape is unknown)."""
        args = self._sampler_args(smeta, R)
        if args is not None:
            static = {"flags": flags}
            self._samplers.compile_later(variant_key(args, static), args, static)
            self._samplers.lower_deferred()

    def prefetch_decode(self, inputs, smeta, flags: SamplingFlags, num_steps: int) -> None:
        """Hand the worker the multi-step decode call of these (padding) inputs, traced on the worker."""
        fixed, varying, static = self._decode_args(inputs, smeta, flags, num_steps)
        self._decode.compile_later(variant_key(varying, static), (*fixed, *varying), static)

    def _run_step(self, varying: tuple, static: dict):
        """The step by its compiled program (the worker's, or the jitted function's, compiling now if new)."""
        self._shapes.add(shape_family(*varying, static), step_dims(varying[0]))
        return self._steps.run(variant_key(varying, static), (self.params, self.caches, *varying), static)

    def _run_sampler(self, logits_BV, smeta, flags: SamplingFlags):
        self._logits_aval = (logits_BV.shape[1], logits_BV.dtype)
        static = {"flags": flags}
        return self._samplers.run(variant_key((logits_BV, smeta), static), (logits_BV, smeta), static)

    def _sampler_args(self, smeta, R: int) -> tuple | None:
        """Abstract (logits, smeta) of the sampler at R rows; None before any step was sampled apart."""
        if self._logits_aval is None:
            return None
        V, dtype = self._logits_aval
        sharding = NamedSharding(self.mesh, PartitionSpec()) if self.mesh is not None else None
        logits = jax.ShapeDtypeStruct((R, V), dtype, sharding=sharding)
        meta = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct((R, *x.shape[1:]), x.dtype, sharding=sharding), smeta)
        return logits, meta

    def _sampler_ready(self, smeta, flags: SamplingFlags, R: int) -> bool:
        args = self._sampler_args(smeta, R)
        return args is not None and self._samplers.ready(variant_key(args, {"flags": flags}))

    def _padded(self, inputs, smeta, flags: SamplingFlags, fused: bool, rows: list[SamplingRow]):
        """(inputs, smeta, fused) to run the step with: as given when its programs are compiled (or none larger
        is); else padded to the smallest compiled shape that holds it, fused or sampled apart (a fused variant
        without a larger shape of its own runs as the shared step + its sampler), while its own programs
        compile on the workers."""
        dims = step_dims(inputs)
        own, own_static, own_key = step_variant(inputs, smeta, flags, fused)
        step_ready = self._steps.ready(own_key)
        ready = step_ready and (fused or self._sampler_ready(smeta, flags, dims.R))
        if ready or self._compile_failed(own_key, smeta, flags, fused, dims.R):
            return inputs, smeta, fused  # (a program the worker failed to compile is compiled when met)
        larger = None
        for as_fused in [True, False] if fused else [False]:
            family = shape_family(inputs, smeta if as_fused else None, step_static(flags, as_fused))
            if as_fused:
                larger = self._shapes.smallest_holding(family, dims)
            else:  # preferably a shape whose sampler is compiled; else any (its sampler is a small compilation)
                larger = self._shapes.smallest_holding(family, dims, lambda d: self._sampler_ready(smeta, flags, d.R))
                if larger is None and not step_ready:
                    larger = self._shapes.smallest_holding(family, dims)
            if larger is not None:
                break
        if larger is None:
            return inputs, smeta, fused  # compiled now, as without padding
        self._compile_own(own_key, own, own_static, smeta, flags, fused, dims)
        if larger == dims:
            return inputs, smeta, as_fused
        self.num_padded_steps += 1
        meta = build_sampling_metadata(rows, pad_to=larger.R)[0]
        return pad_step_inputs(inputs, larger), meta, as_fused

    def _compile_failed(self, key: tuple, smeta, flags: SamplingFlags, fused: bool, R: int) -> bool:
        sampler = None if fused else self._sampler_args(smeta, R)
        return self._steps.failed(key) or (
            sampler is not None and self._samplers.failed(variant_key(sampler, {"flags": flags})))

    def _compile_own(self, key: tuple, own: tuple, static: dict, smeta, flags: SamplingFlags, fused: bool,
                     dims: StepDims) -> None:
        """Hand the step's own programs to the workers: its step, and its sampler when sampled apart."""
        replicated = parallel.replicate(own, self.mesh) if self.mesh is not None else own
        self._steps.compile_later(key, (self.params, self.caches, *replicated), static)
        sampler = None if fused else self._sampler_args(smeta, dims.R)
        if sampler is not None:
            self._samplers.compile_later(variant_key(sampler, {"flags": flags}), sampler, {"flags": flags})
