"""(Review 26.) Scheduler.discard of a step that failed after its tokens were recorded (an exception in
LLMEngine._postprocess / _record_extras, or in MultiStepMixin._finish_pending after scheduler.update) uncounts an
admitted sequence's lookup with cancel_admission, which subtracts seq.num_tokens: by then the sampled token is
appended, so one more query is taken off than match_prefix counted (prefix_cache_queries goes to -1 here)."""
from lmjax.engine.block_manager import BlockManager
from lmjax.engine.scheduler import Scheduler
from lmjax.engine.sequence import Sequence, SequenceStatus


def test_discard_after_record_uncounts_exactly_the_lookup():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    sched = Scheduler(bm, 4, 64)
    seq = Sequence(seq_id=0, prompt_token_ids=list(range(10)))
    sched.add(seq)
    batch = sched.schedule()
    assert bm.prefix_cache_queries == 10
    sched.update(batch, {0: 7})  # advance + record: the step's token is appended
    sched.discard(batch)  # then the step fails (e.g. in _postprocess)
    assert seq.status is SequenceStatus.WAITING
    assert bm.prefix_cache_queries == 0, bm.prefix_cache_queries  # HEAD: -1


def test_a_whole_prompt_sequence_refused_admission_uncounts_nothing():
    """A prompt-logprobs request computes its whole prompt: its lookup counts nothing, and a refused admission
    must take nothing back (cancel_admission subtracted num_tokens it never counted)."""
    from lmjax.config import SamplingParams

    bm = BlockManager(4, 4, enable_prefix_caching=True)
    seq = Sequence(seq_id=0, prompt_token_ids=list(range(10)))
    seq.params = SamplingParams(prompt_logprobs=1)
    bm.match_prefix(seq)
    bm.cancel_admission(seq)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (0, 0)
