"""ModelRunner: the only place the engine touches the device. It owns the parameters, the paged KV cache
and the jitted step, and turns a ScheduledBatch into padded step inputs.

One step = model forward over a ragged batch of new tokens (prefill chunks and decode tokens mixed) ->
logits of each scheduled sequence's last token -> on-device sampling. Inputs are padded to power-of-two
buckets of tokens (T), sequences (B) and block-table width (M), so compilations are bounded; each new
compilation is counted and logged. The KV cache is donated to the step and updated in place.

Tensor parallelism comes from the parameters: when they are sharded over a mesh (`load_model(tp=...)`,
`lmjax.parallel`), the cache is created sharded on KV heads, the step inputs are replicated, the step
runs under that mesh (attention in shard_map, XLA's all-reduces elsewhere) and sampling reads
replicated logits, so every device (and every process) draws the same tokens.

Shape letters: T tokens, B sequences, M blocks per sequence, V vocab, K top logprobs.
"""
from __future__ import annotations

import dataclasses
import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from lmjax import parallel
from lmjax.engine.background_compile import (
    BackgroundCompiler,
    background_compile_enabled,
)
from lmjax.engine.block_manager import BlockManager
from lmjax.engine.decode_loop import (
    DecodeInputs,
    PendingDecode,
    decode_steps,
    pending_ids,
)
from lmjax.engine.followers import FollowersMixin, step_kind
from lmjax.engine.host_outputs import NO_EXTRAS, Extras
from lmjax.engine.model_prep import decode_batch_floor, merge_projections
from lmjax.engine.padded_steps import PaddedStepsMixin, step_static
from lmjax.engine.scheduler import ScheduledBatch
from lmjax.engine.step_fns import prompt_logprobs, sample_fused, sample_rows
from lmjax.layers.attention import AttentionMetadata, cost_follows_context
from lmjax.layers.sampler import (
    SamplerOutput,
    SamplingFlags,
    SamplingMetadata,
    SamplingRow,
    build_sampling_metadata,
    is_basic,
    sample,
)
from lmjax.models.forward import make_kv_caches
from lmjax.models.layer_trace import layer_tracer, shared_layer_traces

logger = logging.getLogger("lmjax.engine")


class StepInputError(Exception):
    """The host could not build a step's inputs (a sampling value the int32 / float32 arrays cannot hold,
    say): nothing of that step reached the device, so the engine fails that step's requests alone, not
    every live one as for a device failure."""


def _sampling_inputs(rows: list[SamplingRow], pad_to: int) -> tuple[SamplingMetadata, SamplingFlags]:
    """build_sampling_metadata, its failure a StepInputError."""
    try:
        return build_sampling_metadata(rows, pad_to=pad_to)
    except Exception as e:  # noqa: BLE001  (host-side packing only: the engine decides whom it fails)
        raise StepInputError(f"{type(e).__name__}: {e}") from e


def rows_pack(rows: list[SamplingRow]) -> bool:
    """Whether these rows alone make sampling inputs (the engine looks for the rows to blame for a
    StepInputError)."""
    try:
        _sampling_inputs(rows, pad_to=len(rows))
        return True
    except StepInputError:
        return False


def bucket(n: int, minimum: int) -> int:
    """Next power of two >= max(n, minimum)."""
    return 1 << (max(n, minimum) - 1).bit_length()


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepInputs:
    ids_T: jax.Array
    positions_T: jax.Array
    attn: AttentionMetadata
    last_rows_B: jax.Array  # token row of each sampled position: a sequence's last (0 for padding rows)
    next_ids_T: jax.Array  # the token after each position (-1 unknown), for prompt logprobs


@dataclasses.dataclass
class PendingStep:
    """A one-step call (prefill chunks and decode tokens) on the device, its results not read yet."""

    out: SamplerOutput | None  # device arrays, one row per sampled position (then padding); None until sampled
    prompt: tuple | None  # prompt logprobs' device arrays, when asked for
    num_items: int  # rows: one per item, 1 + draft length for an item verifying a draft
    extra: dict = dataclasses.field(default_factory=dict)  # lmjax.engine.host_outputs' rows, on the device
    smeta: tuple | None = None  # (SamplingMetadata, SamplingFlags) for a step the host samples

    def start_host_copy(self) -> None:
        """Queue the results' copy to the host now, to run as soon as the step ends (before a call
        dispatched after this one): the read then finds them there (H100, 1B: 0.57 -> 0.28 ms)."""
        for x in jax.tree_util.tree_leaves((self.out, self.prompt)):
            x.copy_to_host_async()


@dataclasses.dataclass
class StepOutput:
    """Host copies of one step's results, rows in the order of the batch's items."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    prompt: tuple[np.ndarray, ...] | None  # next-token logprob, top ids, top logprobs, rank per row
    ranks: np.ndarray | None = None  # the sampled token's rank (with logprobs asked for)


def _last_token_ids(items, B: int) -> np.ndarray:
    """Each item's last token id, padded with 0 to B rows."""
    ids_B = np.zeros(B, np.int32)
    ids_B[:len(items)] = [it.seq.last_token_id for it in items]
    return ids_B


class ModelRunner(FollowersMixin, PaddedStepsMixin):
    def __init__(self, model: nnx.Module, num_blocks: int, block_size: int, max_tokens_per_step: int,
                 max_batch_size: int, max_blocks_per_seq: int, kv_dtype, quant_policy: int = 0, kv_maps=None):
        mesh = parallel.mesh_of(nnx.state(model))  # None on one device
        merge_projections(model, quant_policy, parallel.tp_size(mesh))
        self.graphdef, self.state = nnx.split(model)
        # The jitted calls take the parameters as a flat list: an nnx State is flattened in Python on every
        # call (~0.5 ms of a dispatch on a CI core, more on the GPU machines' slower host), a list in C++.
        self.params, self._params_def = jax.tree_util.tree_flatten(self.state)
        self.config = model.config
        self.block_size = block_size
        self.mesh = mesh
        self.caches = make_kv_caches(model.config, num_blocks, block_size, kv_dtype, self.mesh, quant_policy, kv_maps)
        self.caches_device = jax.local_devices()[0]  # (the weights' device: with processes joined, devices()[0] is
        # process 0's)
        if self.mesh is None:  # committed (aliased, no copy), as the step's donated outputs are: else
            self.caches = jax.device_put(self.caches, self.caches_device)  # the second step compiles again
        self.max_T = bucket(max_tokens_per_step, 16)
        self.min_decode_B = decode_batch_floor(model)
        self.max_B = bucket(max_batch_size, 4)
        self.max_M = bucket(max_blocks_per_seq, 1)
        self.fixed_M = cost_follows_context()  # one block-table width: fewer compilations
        self.num_compilations = 0
        self._count_lock = threading.Lock()  # traces run on the engine's thread and the compile worker's
        self.leading = False  # process 0 driving follower processes (see lead / follow)
        self._layers = layer_tracer()  # (one per engine: its traces hold this engine's trace-time settings)
        self._step = jax.jit(self._step_fn, donate_argnums=(1,),
                             static_argnames=("flags", "num_prompt_logprobs", "extras"))
        self._sample = jax.jit(sample_fused, static_argnames=("flags",))
        self._init_padded_steps()
        self._sample_rows = jax.jit(sample_rows, static_argnames=("flags",))
        # Not where several processes make the same calls without a leader (a leader decodes one step a call):
        # each one's worker finishes at its own time, and their collectives must run the same program.
        self._decode = BackgroundCompiler(
            jax.jit(self._decode_fn, donate_argnums=(1,), static_argnames=("flags", "num_steps")),
            enabled=background_compile_enabled() and jax.process_count() == 1,
            context=lambda: parallel.use_mesh(self.mesh))

    def _count_compilation(self) -> int:
        with self._count_lock:
            self.num_compilations += 1
            return self.num_compilations

    def _model(self, params: list) -> nnx.Module:
        return nnx.merge(self.graphdef, jax.tree_util.tree_unflatten(self._params_def, params))

    def _step_fn(self, params, caches, inputs: StepInputs, smeta, *, flags: SamplingFlags, num_prompt_logprobs,
                 extras: Extras = NO_EXTRAS):
        # Runs once per compilation (tracing), never per step: count and log it.
        logger.info("compiling step #%d: T=%d B=%d M=%d %s prompt_logprobs=%d%s", self._count_compilation(),
                    inputs.ids_T.shape[0], inputs.last_rows_B.shape[0], inputs.attn.block_tables_BM.shape[1],
                    flags, num_prompt_logprobs, "" if extras == NO_EXTRAS else f" {extras}")
        model = self._model(params)
        with shared_layer_traces(self._layers):  # one trace for all the layers (lmjax.models.layer_trace)
            hidden_TD, caches = model(inputs.ids_T, inputs.positions_T, caches, inputs.attn)
        last_BD = hidden_TD[inputs.last_rows_B]
        last_BV = self._logits(model, last_BD)
        out = sample(last_BV, smeta, **flags._asdict()) if extras.sample else None
        all_TV = self._logits(model, hidden_TD) if num_prompt_logprobs >= 0 or extras.all_logits else None
        prompt = None
        if num_prompt_logprobs >= 0:
            prompt = prompt_logprobs(all_TV, inputs.next_ids_T, num_prompt_logprobs)
        extra = {name: x for name, x, wanted in (
            ("last_logits", last_BV, extras.last_logits or not extras.sample),
            ("last_hidden", last_BD.astype(jnp.float32), extras.last_hidden),
            ("all_logits", all_TV, extras.all_logits), ("all_hidden", hidden_TD.astype(jnp.float32), extras.all_hidden),
        ) if wanted}
        return out, prompt, extra, caches

    def _decode_fn(self, params, caches, inputs: DecodeInputs, smeta, *, flags: SamplingFlags, num_steps: int):
        logger.info("compiling %d-step decode #%d: B=%d M=%d %s", num_steps, self._count_compilation(),
                    inputs.ids_B.shape[0], inputs.block_tables_BM.shape[1], flags)
        with shared_layer_traces(self._layers):
            return decode_steps(self._model(params), self._logits, caches, inputs, smeta, num_steps=num_steps,
                                block_size=self.block_size, flags=flags)

    def dispatch_decode(self, batch: ScheduledBatch, rows: list[SamplingRow], num_steps: int,
                        after: PendingDecode | PendingStep | None = None) -> PendingDecode | None:
        """Start `num_steps` decode steps of a decode-only batch on the device and return without
        waiting (block tables must already hold slots for all of them). `after`: a call still in
        flight for the same sequences, in the same order; this one continues where it ends, its input
        tokens being that call's last sampled ones, still on the device (the host has not read them).
        After a K-step call the host's num_computed_tokens is K behind; after a one-step call it is
        not (the engine advances the scheduler when it dispatches one: `Scheduler.advance`). None: nothing
        dispatched, the call's sampling variant is still compiling (the engine steps once instead)."""
        items, n = batch.items, len(batch.items)
        ahead = after.num_steps if isinstance(after, PendingDecode) else 0
        B, M = bucket(n, self.min_decode_B), self.table_width(max(len(it.seq.block_table) for it in items))
        positions_B, tables_BM = np.zeros(B, np.int32), np.zeros((B, M), np.int32)
        for b, it in enumerate(items):
            positions_B[b] = it.seq.num_computed_tokens + ahead
            tables_BM[b, :len(it.seq.block_table)] = it.seq.block_table
        # Chained, the input tokens are the previous call's last ones, on the device: the host's
        # last_token_id is behind, so only an unchained call reads it.
        ids_B = pending_ids(after.out.token_ids_B, rows=B) if after is not None else \
            self.decode_ids(_last_token_ids(items, B))
        inputs = DecodeInputs(ids_B, positions_B, tables_BM, np.int32(n))
        smeta, flags = _sampling_inputs(rows, pad_to=B)
        if self.mesh is not None:
            inputs, smeta = parallel.replicate((inputs, smeta), self.mesh)
        result = self._run_decode(inputs, smeta, flags, num_steps)
        return None if result is None else PendingDecode(result, n, num_steps)

    def decode_ids(self, ids_B: np.ndarray):
        """A decode call's input tokens from the host, as a device array like a chained call's (pending_ids'
        output): jit compiles a committed device array and a numpy array as different programs, so warm-up's
        calls and unchained ones would otherwise leave each chained call's first run a full compilation
        (measured: ~4 s on the CPU per batch bucket, in the middle of serving). Under a mesh the call's inputs
        are all replicated onto it anyway."""
        return ids_B if self.mesh is not None else jax.device_put(ids_B, self.caches_device)

    def _run_decode(self, inputs: DecodeInputs, smeta: SamplingMetadata, flags: SamplingFlags, num_steps: int,
                    now: bool = False):
        """The decode call's SamplerOutput (the cache updated), or None while its sampling variant compiles
        (lmjax.engine.background_compile); `now`: compile it now."""
        with parallel.use_mesh(self.mesh):
            result = self._decode(*self._decode_args(inputs, smeta, flags, num_steps),
                                  basic=is_basic(flags, smeta) and not self.pad_warmed, now=now)
        if result is None:
            return None
        out, self.caches = result
        return out

    def collect(self, pending: PendingDecode) -> list[StepOutput]:
        """Wait for a dispatched decode call; one StepOutput per step."""
        tokens, logprobs, top_ids, top_lp, ranks = jax.device_get(pending.out)
        n = pending.num_items
        return [StepOutput(tokens[k, :n], logprobs[k, :n], top_ids[k, :n], top_lp[k, :n], None, ranks[k, :n])
                for k in range(pending.num_steps)]

    def table_width(self, num_blocks: int) -> int:
        """Block-table width M of a step whose longest sequence holds `num_blocks` blocks."""
        return self.max_M if self.fixed_M else bucket(num_blocks, 1)

    def _logits(self, model, hidden_XD):
        logits_XV = model.compute_logits(hidden_XD)
        if self.mesh is not None:
            # Vocab-parallel lm_head: pin its output to vocab shards (else XLA may all-gather the whole
            # tied embedding to meet the constraint below), then gather the logits once and sample them
            # replicated.
            if logits_XV.shape[-1] % parallel.tp_size(self.mesh) == 0:
                vocab_sharded = PartitionSpec(None, parallel.TP_AXIS)
                logits_XV = jax.lax.with_sharding_constraint(logits_XV, NamedSharding(self.mesh, vocab_sharded))
            logits_XV = jax.lax.with_sharding_constraint(logits_XV, NamedSharding(self.mesh, PartitionSpec()))
        return logits_XV

    def build_inputs(self, batch: ScheduledBatch, blocks: BlockManager) -> StepInputs:
        """Padded numpy inputs for the scheduled items (host work: O(new tokens))."""
        items = batch.items
        T = bucket(batch.num_tokens, 16)
        B = bucket(len(items), 4)
        R = bucket(sum(it.num_rows for it in items), 4)  # sampled rows: B unless a draft is verified
        M = self.table_width(max(len(it.seq.block_table) for it in items))
        ids, positions = np.zeros(T, np.int32), np.zeros(T, np.int32)
        slots, seq_lens = np.zeros(T, np.int32), np.ones(T, np.int32)
        next_ids = np.full(T, -1, np.int32)
        kv_lens, tables = np.zeros(B, np.int32), np.zeros((B, M), np.int32)
        cu, last = np.zeros(B + 1, np.int32), np.zeros(R, np.int32)
        t = r = 0
        for b, it in enumerate(items):
            n, seq, end = it.num_new_tokens, it.seq, it.start_pos + it.num_new_tokens
            ids[t:t + n] = seq.token_slice(it.start_pos, end)
            positions[t:t + n] = np.arange(it.start_pos, end)
            slots[t:t + n] = blocks.slots(seq, it.start_pos, n)
            # Dynamic NTK's length as transformers sees it: the whole prompt for every prompt token (its
            # one prefill, however it is chunked or recomputed), then each later token's own position + 1.
            seq_lens[t:t + n] = np.maximum(np.arange(it.start_pos + 1, end + 1), seq.num_prompt_tokens)
            following = seq.token_slice(it.start_pos + 1, end + 1)
            next_ids[t:t + len(following)] = following
            kv_lens[b], tables[b, :len(seq.block_table)] = end, seq.block_table
            t += n
            m = it.num_rows
            cu[b + 1], last[r:r + m] = t, np.arange(t - m, t)
            r += m
        cu[len(items) + 1:] = t
        attn = AttentionMetadata(slot_mapping_T=slots, seq_lens_T=seq_lens, kv_lens_B=kv_lens,
                                 block_tables_BM=tables, cu_q_lens_B1=cu)
        return StepInputs(ids_T=ids, positions_T=positions, attn=attn, last_rows_B=last, next_ids_T=next_ids)

    def dispatch_step(self, batch: ScheduledBatch, blocks: BlockManager, rows: list[SamplingRow],
                      num_prompt_logprobs: int = -1, extras: Extras = NO_EXTRAS) -> PendingStep:
        """Start one step on the device and return without waiting for it (`read_step` reads it); `rows`
        has one SamplingRow per item (used only for items that sample). `extras`: rows for the host
        (lmjax.engine.host_outputs); with extras.sample False, `sample_processed` must run before the read.
        Rows that cannot be packed raise StepInputError before anything is dispatched."""
        inputs = self.build_inputs(batch, blocks)
        smeta, flags = _sampling_inputs(rows, pad_to=inputs.last_rows_B.shape[0])
        if self.leading:  # followers run NO_EXTRAS steps only: the engine refuses host outputs across hosts
            parallel.send_step((inputs, smeta), [*map(int, flags), num_prompt_logprobs], kind=step_kind(smeta))
        out, prompt, extra = self._run(inputs, smeta, flags, num_prompt_logprobs, extras,
                                       rows=None if self.leading else rows)
        return PendingStep(out, prompt, len(rows), extra, None if extras.sample else (smeta, flags))

    def sample_processed(self, pending: PendingStep, rows_R: list[int], logits_RV: list) -> None:
        """Sample a step dispatched with extras.sample False: rows `rows_R` of its logits replaced by the
        host's processed `logits_RV` (the other rows sampled from the model's); logprobs stay the raw ones."""
        smeta, flags = pending.smeta
        R = bucket(len(rows_R), 1)
        idx_R = np.full(R, pending.extra["last_logits"].shape[0], np.int32)  # padding: out of bounds, dropped
        idx_R[:len(rows_R)] = rows_R
        processed_RV = np.zeros((R, pending.extra["last_logits"].shape[1]), np.float32)
        if rows_R:
            processed_RV[:len(rows_R)] = logits_RV
        with parallel.use_mesh(self.mesh):
            pending.out = self._sample_rows(pending.extra["last_logits"], idx_R, processed_RV, smeta, flags=flags)
        pending.smeta = None

    def read_step(self, pending: PendingStep) -> StepOutput:
        """Wait for a dispatched step; host copies of its results."""
        n = pending.num_items
        (tokens, logprobs, top_ids, top_lp, ranks), prompt = jax.device_get((pending.out, pending.prompt))
        return StepOutput(tokens[:n], logprobs[:n], top_ids[:n], top_lp[:n], prompt, ranks[:n])

    def _run(self, inputs: StepInputs, smeta, flags: SamplingFlags, num_prompt_logprobs: int,
             extras: Extras = NO_EXTRAS, rows: list[SamplingRow] | None = None):
        """One step. `rows` (the engine's steps, never warm-up's or a follower's): the step may run at a larger
        compiled shape while its own compiles (lmjax.engine.step_shapes); its outputs keep the padding rows."""
        # Only basic sampling is fused into the step; any other variant samples the step's logits in a small
        # program of its own, so the model step compiles once for them all (lmjax.engine.background_compile),
        # as it does for steps the host samples.
        fused = extras.sample and is_basic(flags, smeta)
        if rows is not None and self.pad_to_compiled and num_prompt_logprobs < 0 and extras == NO_EXTRAS:
            inputs, smeta, fused = self._padded(inputs, smeta, flags, fused, rows)
        apart = extras.sample and not fused
        varying, static, smeta = self._step_args(inputs, smeta, flags, fused, num_prompt_logprobs, extras)
        with parallel.use_mesh(self.mesh):
            if self.pad_to_compiled:  # through the compile worker's programs
                result = self._run_step(varying, static)
            else:
                result = self._step(self.params, self.caches, *varying, **static)
            out, prompt, extra, self.caches = result
            if apart:
                logits_BV = extra["last_logits"] if extras.last_logits else extra.pop("last_logits")
                out = self._run_sampler(logits_BV, smeta, flags) if self.pad_to_compiled else \
                    self._sample(logits_BV, smeta, flags=flags)
        return out, prompt, extra

    def _step_args(self, inputs: StepInputs, smeta, flags: SamplingFlags, fused: bool, num_prompt_logprobs: int = -1,
                   extras: Extras = NO_EXTRAS):
        """The jitted step's varying and static arguments, and smeta (replicated over the mesh, if any)."""
        if self.mesh is not None:
            inputs, smeta = parallel.replicate((inputs, smeta), self.mesh)
        return (inputs, smeta if fused else None), step_static(flags, fused, num_prompt_logprobs, extras), smeta

    def lower_step(self, inputs: StepInputs, smeta, flags: SamplingFlags):
        """The one-step program `_run` runs for these (no prompt logprobs, no host outputs), lowered (warm-up)."""
        varying, static, _ = self._step_args(inputs, smeta, flags, is_basic(flags, smeta))
        with parallel.use_mesh(self.mesh):
            return self._step.lower(self.params, self.caches, *varying, **static)

    def _decode_args(self, inputs: DecodeInputs, smeta: SamplingMetadata, flags: SamplingFlags, num_steps: int):
        """The jitted decode call's fixed, varying and static arguments."""
        return (self.params, self.caches), (inputs, smeta), {"flags": flags, "num_steps": num_steps}

    def lower_decode(self, inputs: DecodeInputs, smeta: SamplingMetadata, flags: SamplingFlags, num_steps: int):
        """The decode program `_run_decode` runs for these, lowered (warm-up)."""
        fixed, varying, static = self._decode_args(inputs, smeta, flags, num_steps)
        with parallel.use_mesh(self.mesh):
            return self._decode.jitted.lower(*fixed, *varying, **static)
