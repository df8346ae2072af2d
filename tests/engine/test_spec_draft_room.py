"""(Probe 26.) A draft never takes the blocks a later running sequence needs for its real next token: an older
sequence's draft took the last free block and the newer sequence was preempted (recomputed from scratch)."""
from lmjax.engine.block_manager import BlockManager
from lmjax.engine.scheduler import Scheduler
from lmjax.engine.sequence import Sequence


def _two_decoding(draft):
    # block_size 4; blocks: 1 pad + A's 2 + B's 2 + 1 free
    bm = BlockManager(num_blocks=6, block_size=4)
    s = Scheduler(bm, max_batch_size=4, max_prefill_token_num=64)
    a = Sequence(1, list(range(10, 16)))   # 6 prompt tokens: after 1 output, next position 6 (block 2 of 2)
    b = Sequence(2, list(range(20, 28)))   # 8 prompt tokens: after 1 output, next position 8 needs a 3rd block
    s.add(a)
    s.add(b)
    s.update(s.schedule(), {1: 7, 2: 9})   # both prefilled, one token sampled each
    assert bm.num_free_blocks == 1 and not s.waiting
    a.draft_token_ids = list(draft)        # what LLMEngine._propose_drafts would set
    return s, s.schedule()


def test_without_draft_both_decode():
    s, batch = _two_decoding([])
    assert not batch.preempted and len(batch.items) == 2


def test_a_draft_does_not_preempt_a_sequence_whose_real_token_needs_the_block():
    s, batch = _two_decoding([7, 7, 7])   # A's draft spans positions 7..9: into a 3rd block
    assert not batch.preempted, f"draft of seq 1 preempted seq {[q.seq_id for q in batch.preempted]}"
    assert len(batch.items) == 2
