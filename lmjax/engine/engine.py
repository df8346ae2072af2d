"""LLMEngine: the one engine under every facade.

Each `step()` is three named calls: `scheduler.schedule()` picks the ragged batch (decode tokens and
prefill chunks), `runner.dispatch_step()` / `read_step()` run the jitted step (forward + sampling) on the
device, and `_postprocess()` turns sampled ids into text, stop decisions and finished requests on the
host. Between dispatch and read, a batch that can go on decoding without the host gets its first K-step
call (lmjax.engine.multistep), whose tokens later steps read.
Requests come in through `add_request` (validated before any work), leave through `step()`'s return. A step
that raises is undone first (lmjax.engine.step_failures): the prefix cache already named the blocks it was to fill.
"""
from __future__ import annotations

import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor

from lmjax.config import EngineConfig, PoolingSampling, SamplingParams
from lmjax.engine.bans import row_banned_ids, tokenize_bad_words
from lmjax.engine.block_manager import BlockManager
from lmjax.engine.cache_sizing import kv_cache_blocks
from lmjax.engine.compile_cache import compile_stats, enable_compilation_cache
from lmjax.engine.detokenizer import IncrementalDetokenizer
from lmjax.engine.guided import advance_guide
from lmjax.engine.host_outputs import NO_EXTRAS, HostOutputsMixin, HostRows, needs_host
from lmjax.engine.model_runner import ModelRunner, StepInputError, StepOutput
from lmjax.engine.request import (Completion, ContextOverflowError, Request, check_logprobs, check_n, check_prompt,
                                  check_sampling_ids, in_vocab_terms, new_request_id, truncated_prompt)
from lmjax.engine.multistep import MultiStepMixin
from lmjax.engine.prompt_logprobs import PromptLogprobsMixin
from lmjax.engine.scheduler import ScheduledBatch, Scheduler
from lmjax.engine.sequence import Sequence
from lmjax.engine.sessions import SessionsMixin
from lmjax.engine.speculative import SpeculativeMixin, row_starts
from lmjax.engine.step_failures import StepFailuresMixin
from lmjax.engine.stop import StopStringMatcher
from lmjax.engine.vllm_names import VLLMNamesMixin
from lmjax.engine.warmup import warm_up
from lmjax.layers.sampler import NO_TOKEN, SamplingRow, seed32
from lmjax.loader.generation_config import generation_eos_ids, read_generation_config, sampling_defaults
from lmjax.loader.model_loader import load_model
from lmjax.loader.resolve import resolve_model_path
from lmjax.loader.tokenizer import load_tokenizer, tokenizer_source
from lmjax.models.kv_calibration import calibrated_or_none, calibration_ids

logger = logging.getLogger("lmjax.engine")
_GREEDY_ROW = SamplingRow(SamplingParams(temperature=0.0), seed=0)


class LLMEngine(SessionsMixin, MultiStepMixin, HostOutputsMixin, SpeculativeMixin, PromptLogprobsMixin, VLLMNamesMixin,
                StepFailuresMixin):
    def __init__(self, model: str | None = None, config: EngineConfig | None = None, tokenizer: str | None = None):
        self.config = config = config or EngineConfig()
        self.compilation_cache_dir = enable_compilation_cache()  # a second start compiles nothing
        path = resolve_model_path(model)
        tokenizer_source(path, tokenizer)  # no tokenizer there: fail now, not after the weights load
        # The tokenizer (transformers' import and a 128k vocabulary: seconds) loads on a thread while the
        # weights stream to the device: on a second start, with nothing to compile, these two are the start.
        with ThreadPoolExecutor(1, thread_name_prefix="lmjax-tokenizer") as pool:
            tokenizer_future = pool.submit(load_tokenizer, path, tokenizer)
            loaded = load_model(path, config.dtype, tp=config.tp, rope_scaling_factor=config.rope_scaling_factor,
                                use_dynamic_ntk=config.use_dynamic_ntk, use_logn_attn=config.use_logn_attn)
            self.tokenizer = tokenizer_future.result()
        self.model_path, self.model_config = loaded.path, loaded.config
        self.load_seconds = loaded.load_seconds  # per load phase (read, place, transpose, sync, ...)
        self.session_len = config.session_len or loaded.config.context_len
        generation = read_generation_config(loaded.path)
        self.checkpoint_eos_ids = set(loaded.config.eos_token_ids) | generation_eos_ids(generation)
        self.sampling_defaults = sampling_defaults(generation)  # the checkpoint's, as SamplingParams fields
        num_blocks = kv_cache_blocks(config, loaded.config, loaded.dtype, self.session_len)
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_batch_size, config.max_prefill_token_num)
        self.scheduler.reclaim = self._evict_idle_session
        self.kv_maps = self._kv_maps(loaded.model) if config.quant_policy == 4 else None
        self.runner = ModelRunner(loaded.model, num_blocks, config.block_size, config.max_prefill_token_num,
                                  config.max_batch_size, -(-self.session_len // config.block_size), loaded.dtype,
                                  config.quant_policy, self.kv_maps)
        self.set_tokenizer(self.tokenizer)  # its EOS ids (with the checkpoint's), its guides
        self._rng = random.Random(config.seed)
        self._by_seq: dict[int, tuple[Request, Completion]] = {}
        self._seq_ids = iter(range(1 << 62))
        self.requests: dict[str, Request] = {}
        self.sessions: dict = {}  # session id -> its finished Sequence (tokens, kept KV blocks)
        self._session_of: dict[int, object] = {}  # seq_id -> session id, for turns that keep their KV
        self.weights_version = 0  # bumped by apply_model: part of the prefix cache's salt
        self.num_prefill_tokens = self.num_generated_tokens = 0  # prompt tokens computed, tokens sampled
        self.num_decode_loops = 0  # multi-step decode calls (num_scheduler_steps tokens per sequence each)
        self._pending = None  # (batch, PendingDecode): a multi-step call dispatched, its tokens unread
        self.num_chained_loops = 0  # of those, dispatched while the previous call's tokens were unread
        self.num_loop_steps_read = 0  # device steps of the multi-step calls whose tokens were read so far
        logger.info("engine ready: %s, %d KV blocks of %d tokens, session_len=%d", loaded.path, num_blocks,
                    config.block_size, self.session_len)
        if self.cache_tokens < self.session_len:
            logger.warning("the KV cache holds %d tokens, fewer than session_len=%d: requests without max_tokens "
                           "stop there; give the cache more memory or lower session_len", self.cache_tokens,
                           self.session_len)
        self.prefetch = None  # (set by warm-up: lmjax.engine.prefetch)
        self.warmup_stats = self.warmup() if config.warmup else None  # (start-up benchmarks read it)

    def _kv_maps(self, model):
        """The int4 KV cache's per-layer K / q maps, calibrated on the built-in text (lmjax.models.kv_calibration)."""
        start = time.perf_counter()
        maps = calibrated_or_none(model, calibration_ids(self.tokenizer))
        self.load_seconds["kv_calibration"] = seconds = time.perf_counter() - start
        logger.info("int4 KV cache calibrated in %.1f s", seconds)
        return maps

    # ------------------------------------------------------------------ requests in
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                    request_id: str | None = None) -> Request:
        """Validate and queue a request; raises ValueError (naming the value) before any work."""
        if isinstance(prompt_token_ids, str):  # vLLM's engine.add_request(request_id, prompt, params) by habit
            raise TypeError(f"add_request takes token ids first, got the str {prompt_token_ids!r}: this is lmjax's "
                            "own engine; vLLM's add_request(request_id, prompt, params) is lmjax.LLMEngine's")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use by an unfinished request")
        prompt_token_ids = truncated_prompt(prompt_token_ids, params, self.session_len)  # `prompt`: as given (vLLM)
        max_tokens = self.validate_request(prompt_token_ids, params)
        params = in_vocab_terms(params.clone(), self.model_config.vocab_size)  # vLLM's defensive copy
        n = len(prompt_token_ids)
        req = Request(request_id or new_request_id(self.requests), prompt, list(prompt_token_ids), params, max_tokens)
        if params.bad_words:
            req.bad_words_ids = tokenize_bad_words(self.tokenizer, params.bad_words)
        req.allowed_W = self.guided.allowed_mask(params)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs, req.prompt_ranks = [None] * n, [0] * n
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        for i in range(params.n):
            self._add_completion(req, i, seed32(base_seed + i))  # vLLM's: completion i is seed + i
        self.requests[req.request_id] = req
        return req

    @property
    def cache_tokens(self) -> int:
        """The longest sequence the whole KV cache can hold."""
        return self.blocks.num_usable_blocks * self.config.block_size

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Every check `add_request` makes, nothing queued (a batch checks all its requests first, so a bad
        one leaves no other behind); returns the request's token budget (max_tokens capped by the context)."""
        check_n(params, self.blocks.num_usable_blocks)  # first: overflowed_request also makes n completions
        prompt_token_ids = truncated_prompt(prompt_token_ids, params, self.session_len)
        check_prompt(prompt_token_ids, self.model_config.vocab_size, self.session_len)
        check_logprobs(params, self.model_config.vocab_size, self.config.max_logprobs)
        check_sampling_ids(params, self.model_config.vocab_size)
        self.guided.check(params)  # compiles a guide: a bad schema or regex fails here, naming it
        if needs_host(params) and self.runner.leading:
            raise NotImplementedError("logits_processors, output_logits and output_last_hidden_state are not "
                                      "supported by a multi-process (multi-host) engine")
        n = len(prompt_token_ids)
        # No max_tokens: up to the context, or as far as the whole cache holds one sequence (LMDeploy caps so)
        longest = self.session_len if params.max_tokens else min(self.session_len, self.cache_tokens)
        max_tokens = min(params.max_tokens or longest, longest - n)
        if max_tokens < 1 or not self.scheduler.fits_in_cache(n + max_tokens):
            asked = f" + max_tokens={params.max_tokens}" if params.max_tokens else ""
            raise ValueError(f"prompt of {n} tokens{asked} needs more KV cache than the "
                             f"{self.blocks.num_usable_blocks} blocks of {self.config.block_size} tokens there are")
        return max_tokens

    def validate_batch(self, batch) -> dict[int, ContextOverflowError]:
        """`validate_request` for each (prompt ids, params) of a batch, all before any is queued: the other
        errors raise; the prompts that leave no room in session_len come back by position (LMDeploy's
        facades answer them with `overflowed_request`, vLLM's raise)."""
        overflowed = {}
        for i, (ids, params) in enumerate(batch):
            try:
                self.validate_request(ids, params)
            except ContextOverflowError as e:
                overflowed[i] = e
        return overflowed

    def _add_completion(self, req: Request, index: int, seed: int) -> None:
        p = req.params
        seq = Sequence(next(self._seq_ids), list(req.prompt_token_ids), params=p,
                       cache_salt=self._cache_salt(len(req.prompt_token_ids), p.cache_salt),
                       pooling=isinstance(p, PoolingSampling))
        # The text continues the prompt (vLLM, LMDeploy): SentencePiece keeps the first word's space
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, p.skip_special_tokens,
                                       p.spaces_between_special_tokens, continue_prompt=True)
        comp = Completion(index, seq, seed, detok, StopStringMatcher(p.stop, p.include_stop_str_in_output),
                          logprobs=[] if p.logprobs is not None else None,
                          guide=self.guided.new_state(p, req.allowed_W),  # guided: its own walk of the guide
                          host_rows=HostRows() if p.output_logits or p.output_last_hidden_state else None)
        req.completions.append(comp)
        self._by_seq[seq.seq_id] = (req, comp)
        self.scheduler.add(seq)

    def overflowed_request(self, prompt_token_ids: list[int], params: SamplingParams, error: ContextOverflowError,
                           prompt: str | None = None) -> Request:
        """LMDeploy's answer to a prompt that leaves no room in session_len: a request already finished,
        each completion empty with finish reason "length", the error logged; nothing is queued."""
        logger.error("run out of tokens: %s", error)
        req = Request(new_request_id(), prompt, list(prompt_token_ids), params, 0, error=str(error))
        for i in range(params.n):
            seq = Sequence(next(self._seq_ids), list(prompt_token_ids), params=params)
            empty = Completion(i, seq, 0, IncrementalDetokenizer(self.tokenizer), StopStringMatcher(None),
                               logprobs=[] if params.logprobs is not None else None, finish_reason="length")
            req.completions.append(empty)
        return req

    def _cache_salt(self, num_prompt_tokens: int, request_salt: str | None = None):
        """What a prompt's block hashes start from: only prompts alike in it share cached blocks. The
        request's own salt (vLLM's cache_salt); dynamic NTK's base, set by the prompt's length once it passes
        the trained context (below it: all alike); after apply_model, the weights' version."""
        rope = self.model_config.rope
        ntk = max(num_prompt_tokens, rope.max_position_embeddings) if rope.is_dynamic else None
        parts = (request_salt, ntk, self.weights_version)
        return None if parts == (None, None, 0) else parts

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        for comp in req.completions if req else ():
            if not comp.finished:
                self.scheduler.abort(comp.seq.seq_id)
                self._finish(req, comp, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> dict:
        """Counters worth logging and exporting: compilations (traces of a step; `cache_hits` of them
        were loaded from the persistent compilation cache), prefix-cache hits (a preempted sequence's readmissions
        apart, as vLLM), preemptions, cache use."""
        b = self.blocks
        return {"num_compilations": self.runner.num_compilations, "prefix_cache_queries": b.prefix_cache_queries,
                "prefix_cache_hits": b.prefix_cache_hits, "prefix_cache_hit_rate": b.hit_rate,
                "prefix_cache_preempted_queries": b.preempted_queries, "prefix_cache_preempted_hits": b.preempted_hits,
                "num_preemptions": self.scheduler.num_preemptions, "kv_cache_usage": b.usage,
                "num_running": self.scheduler.num_running, "num_waiting": self.scheduler.num_waiting,
                "num_free_blocks": b.num_free_blocks, "num_usable_blocks": b.num_usable_blocks,
                "num_prefill_tokens": self.num_prefill_tokens, "num_generated_tokens": self.num_generated_tokens,
                "num_sessions": len(self.sessions), **self.spec_stats(), **compile_stats()}

    # ------------------------------------------------------------------ one step
    def step(self) -> list[Request]:
        """Advance every running request by one step (K steps for a multi-step decode call); returns
        the requests that changed."""
        self.runner.lower_deferred()  # (new one-step shapes the last step met; the device may be busy meanwhile)
        if self._pending is not None:
            return self._finish_pending({})
        self._propose_drafts()
        batch = self.scheduler.schedule()  # (idle sessions' KV gives way first: scheduler.reclaim)
        changed: dict[str, Request] = {}
        for seq in batch.failed:
            req, comp = self._by_seq[seq.seq_id]
            req.error = f"request needs more KV cache than exists ({seq.num_tokens} tokens)"
            self._finish(req, comp, "error")
            changed[req.request_id] = req
        if not batch.items:
            return list(changed.values())
        try:
            return self._run_batch(batch, changed)
        except BaseException:
            self._step_failed(batch)  # nothing may read the blocks it did not write (their hashes are out)
            raise

    def _run_batch(self, batch: ScheduledBatch, changed: dict[str, Request]) -> list[Request]:
        """Run a scheduled batch's step and apply its results (`step` undoes it when this raises)."""
        now = time.time()
        for it in batch.items:
            if it.seq.seq_id in self._by_seq:
                self._by_seq[it.seq.seq_id][0].metrics.scheduled(now)
        num_steps = self._decode_steps(batch)
        if num_steps > 1:  # (its blocks allocated: one step uses the first, the next steps the others)
            rows = [self._row(it) for it in batch.items]
            try:
                decoding = self.runner.dispatch_decode(batch, rows, num_steps)
            except StepInputError as e:
                return self._inputs_failed(batch, rows, list(range(len(rows))), e, changed)
            if decoding is not None:  # else its sampling variant is compiling: one step now
                self._count_prefilled(batch)  # (a prompt's last token can start a call: a 1-token or cached prompt)
                self._pending = (batch, decoding)
                self.num_decode_loops += 1
                return self._finish_pending(changed)
        extras = self._extras(batch)
        starts = row_starts(batch)  # each item's first sampled row (items verifying a draft have several)
        rows = [self._row(it, ahead=j) for it in batch.items for j in range(it.num_rows)]
        try:
            pending = self.runner.dispatch_step(batch, self.blocks, rows, self._prompt_logprobs_k(batch), extras)
        except StepInputError as e:
            return self._inputs_failed(batch, rows, starts, e, changed)
        failed = {} if extras.sample else self._process_logits(batch, pending, starts)
        self.scheduler.advance(batch)
        if len(rows) == len(batch.items):
            self._decode_after(batch, pending)
        out = self.runner.read_step(pending)
        if out.prompt is not None:
            self._record_prompt_logprobs(batch, out)
        if extras != NO_EXTRAS:
            self._record_extras(batch, pending, starts)
        drafted = self._accept_drafts(batch, out, starts, changed)
        sampled = {it.seq.seq_id: int(out.token_ids[starts[i]]) for i, it in enumerate(batch.items)
                   if it.samples and it.seq.seq_id not in failed and it.seq.seq_id not in drafted}
        self._count_prefilled(batch)
        self.num_generated_tokens += self.scheduler.record(batch, sampled)
        for i, it in enumerate(batch.items):
            if it.samples and it.seq.seq_id in self._by_seq and it.seq.seq_id not in drafted:
                req, comp = self._by_seq[it.seq.seq_id]
                if it.seq.seq_id in failed:
                    req.error = failed[it.seq.seq_id]
                    self._finish(req, comp, "error")
                else:
                    self._postprocess(req, comp, out, starts[i])
                changed[req.request_id] = req
        return list(changed.values())

    def warmup(self, sampling_params: list[SamplingParams] | None = None, max_batch_size: int | None = None) -> dict:
        """Compile the decode step of every batch-size bucket now rather than in the middle of a run, as vLLM
        captures its CUDA graphs at start-up (else each bucket compiles when first reached: seconds on a CPU).
        One compilation per (batch bucket, block-table width bucket; one width off GPU) per distinct SamplingFlags
        of `sampling_params` (default: greedy); on a GPU also the largest one-step shapes (lmjax.engine.warmup),
        compiled on several threads. Returns the compilations and seconds spent, and the compile pool's figures."""
        stats, self.prefetch = warm_up(self, sampling_params, max_batch_size)
        return stats

    def idle_work(self) -> bool:
        """An idle engine thread's work: trace the one-step shapes the last steps met (not in the next request's
        first step), and hand the compile worker the next sampling program requests may soon need
        (lmjax.engine.prefetch). Whether some remains (the thread then polls instead of blocking)."""
        self.runner.lower_deferred()
        return self.prefetch is not None and self.prefetch.step()

    def _row(self, item, ahead: int = 0) -> SamplingRow:
        """The sampler's view of an item; `ahead` tokens of it are still on the device (their step
        count matters to seeded sampling; multi-step rows have no output-dependent bans)."""
        if not item.samples:
            return _GREEDY_ROW
        req, comp = self._by_seq[item.seq.seq_id]
        outputs = item.seq.output_token_ids
        # EOS is banned until min_tokens are out even with ignore_eos (vLLM adds it to all_stop_token_ids,
        # which min_tokens bans, whatever ignore_eos says)
        banned = row_banned_ids(req.params, outputs, self.eos_token_ids, req.bad_words_ids)
        allowed_W = comp.guide.mask_W() if comp.guide is not None else req.allowed_W  # None: any token
        return SamplingRow(req.params, comp.seed, req.prompt_token_ids, outputs, banned, len(outputs) + ahead,
                           allowed_W, guided=comp.guide is not None)

    # ------------------------------------------------------------------ results out
    def _postprocess(self, req: Request, comp: Completion, out: StepOutput, i: int) -> None:
        token = int(out.token_ids[i])
        if token == NO_TOKEN:  # (recorded as no token: Scheduler.record, _accept_drafts)
            req.error = (f"nothing could be sampled for output token {len(comp.token_ids)}: the request's "
                         "bans, allowed tokens, guide or logits processors left every logit at -inf")
            return self._finish(req, comp, "error")
        req.metrics.token(time.time())
        if len(comp.token_ids) == 1:  # its first admission's hit, as vLLM counts it (not a recompute's)
            hit = min(comp.seq.num_first_cached_tokens, len(req.prompt_token_ids))
            req.num_cached_tokens = max(req.num_cached_tokens, hit)
        comp.cumulative_logprob += float(out.logprobs[i])
        if comp.logprobs is not None:
            k = req.params.logprobs
            entry = dict(zip(out.top_ids[i, :k].tolist(), out.top_logprobs[i, :k].tolist()))
            entry[token] = float(out.logprobs[i])
            comp.logprobs.append(entry)
            comp.ranks.append(int(out.ranks[i]) if out.ranks is not None else 0)
        p = req.params
        stop_token = token in (p.stop_token_ids or ()) or (token in self.eos_token_ids and not p.ignore_eos)
        if stop_token and not p.include_stop_str_in_output:
            comp.hidden_tail = 1  # as vLLM: the text leaves out the token that stopped it (token_ids keep it)
        elif comp.stops.stops:  # stop strings: the text decides, decode it now (after min_tokens, as vLLM V1)
            result = comp.stops.feed(comp.detokenizer.step([token]), armed=len(comp.token_ids) > p.min_tokens)
            comp.add_text(result.text)
            if result.stopped:
                comp.stop_reason = result.stop_str
                return self._finish(req, comp, "stop", flush=False)
        else:
            comp.defer_text()
        if stop_token:
            # vLLM's: None for the tokenizer's EOS; the id for stop_token_ids and other EOS ids (stop ids to vLLM)
            comp.stop_reason = None if token == self.tokenizer_eos and not p.ignore_eos else token
            comp.stop_token_id = token
            return self._finish(req, comp, "stop")
        if comp.guide is not None and (reason := advance_guide(req, comp, token)):
            return self._finish(req, comp, reason)  # the guided output is complete ("stop") or stuck
        if len(comp.token_ids) >= req.max_tokens:
            self._finish(req, comp, "stop" if comp.seq.pooling else "length")  # (vLLM's pooling requests "stop")

    def _count_prefilled(self, batch: ScheduledBatch) -> None:
        self.num_prefill_tokens += sum(max(0, min(it.start_pos + it.num_new_tokens, it.seq.num_prompt_tokens)
                                           - it.start_pos) for it in batch.items)

    def _finish(self, req: Request, comp: Completion, reason: str, flush: bool = True) -> None:
        if flush and req.params.detokenize:
            comp.catch_up_text()
            tail = comp.stops.feed(comp.detokenizer.flush())
            comp.add_text(tail.text + comp.stops.flush())
        comp.finish_reason = reason
        session_id = self._session_of.pop(comp.seq.seq_id, None)
        if not comp.seq.is_finished:
            blocks = comp.seq.block_table
            if session_id is not None:
                comp.seq.block_table = []  # a session turn keeps its KV blocks: finish frees none of them
            self.scheduler.finish(comp.seq, reason)
            comp.seq.block_table = blocks
        if session_id is not None:
            self.sessions[session_id] = comp.seq
        self._by_seq.pop(comp.seq.seq_id, None)
        if req.finished:
            req.metrics.finished_time = time.time()
            self.requests.pop(req.request_id, None)
