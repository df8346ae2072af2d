"""vLLM's LLM.apply_model (and the pipeline's): a researcher's edit of the engine's weights reaches every later
call (probe 25: an edit of `nnx.merge(runner.graphdef, runner.state)` reached get_logits only, while generate
and get_ppl kept the old weights: the steps read the runner's flat parameter list)."""
import numpy as np
import pytest
from flax import nnx

from lmjax import LLM, GenerationConfig, PytorchEngineConfig, SamplingParams, pipeline
from lmjax.api.batch import encode_text
from tiny_llama import write_tiny_llama

PROMPT = [5, 9, 14, 3, 7, 21, 8]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"))


def _negate_final_norm(model):
    model.norm.weight[...] = -model.norm.weight[...]
    return "done"


def _greedy(llm, ids=PROMPT):
    return llm.generate([ids], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids


def test_llm_apply_model_changes_what_generate_runs(tiny):
    llm = LLM(tiny, max_model_len=128, block_size=16)
    before = _greedy(llm)
    assert llm.apply_model(_negate_final_norm) == ["done"]
    assert _greedy(llm) != before  # the argmax of negated logits is another token


LONG = [(7 * i + 5) % 200 + 4 for i in range(40)]  # two full blocks of 16: cached by a first request


def _scale_layer0_v(model):  # changes the keys and values the prompt's blocks hold (review 25)
    attn = model.layers[0].self_attn
    w = (attn.qkv_proj if attn.qkv_proj is not None else attn.v_proj).kernel
    w[...] = w[...] * 3.0


@pytest.mark.parametrize("idle_session", [False, True])
def test_no_request_reads_kv_cached_from_the_old_weights(tiny, idle_session):
    """Also while an idle interactive session holds a block (the prefix cache cannot be reset then)."""
    llm, ref = LLM(tiny, max_model_len=128, block_size=16, enable_prefix_caching=True), LLM(tiny, max_model_len=128)
    engine = llm.llm_engine
    _greedy(llm, LONG)
    if idle_session:
        engine.add_session_request(1, [10, 11, 12], SamplingParams(max_tokens=2, temperature=0),
                                   sequence_start=True, sequence_end=False)
        while engine.has_unfinished():
            engine.step()
        assert engine.blocks.num_free_blocks != engine.blocks.num_usable_blocks  # the session holds a block
    llm.apply_model(_scale_layer0_v)
    ref.apply_model(_scale_layer0_v)
    assert _greedy(llm, LONG) == _greedy(ref, LONG)


def test_pipeline_scores_and_generates_with_the_edited_weights(tiny):
    pipe = pipeline(tiny, backend_config=PytorchEngineConfig(session_len=128))
    try:
        assert pipe.apply_model(_negate_final_norm) == ["done"]
        logits = pipe.get_logits([PROMPT])[0]
        targets = np.asarray(PROMPT[1:])
        logp = logits[:-1] - np.log(np.exp(logits[:-1] - logits[:-1].max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits[:-1].max(-1, keepdims=True)
        nll = -logp[np.arange(len(targets)), targets].mean()
        assert pipe.get_ppl([PROMPT])[0] == pytest.approx(nll, rel=1e-4)
        text = " ".join(f"t{i}" for i in PROMPT)
        ids = encode_text(pipe.engine.tokenizer, text)
        out = pipe([text], gen_config=GenerationConfig(max_new_tokens=1, top_k=1), do_preprocess=False)[0]
        assert out.token_ids[0] == int(pipe.get_logits([ids])[0][-1].argmax())
    finally:
        pipe.close()


def test_a_structural_change_is_refused_and_leaves_the_weights(tiny):
    llm = LLM(tiny, max_model_len=128)
    before = _greedy(llm)

    def reshape(model):
        model.norm.weight.set_value(model.norm.weight[...][:-1])
    with pytest.raises(ValueError, match=r"changed .*norm.* keep each parameter's shape and dtype"):
        llm.apply_model(reshape)

    def replace_module(model):
        model.norm = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="not the model's structure"):
        llm.apply_model(replace_module)
    assert _greedy(llm) == before


def test_a_queued_request_reads_no_kv_cached_from_the_old_weights(tiny):
    """(Review 26.) A request queued before apply_model (here: behind a running one, which keeps the prefix
    cache from being reset) took the old weights' salt and shared the blocks an earlier request cached."""
    llm = LLM(tiny, max_model_len=128, block_size=16, enable_prefix_caching=True, max_num_seqs=1)
    ref = LLM(tiny, max_model_len=128, enable_prefix_caching=False)
    engine = llm.llm_engine
    _greedy(llm, LONG)  # caches LONG's two full blocks
    engine.add_request([30, 31, 32], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()  # running: it holds a block, so apply_model cannot reset the prefix cache
    queued = engine.add_request(LONG, SamplingParams(temperature=0, max_tokens=4))
    hits = engine.blocks.prefix_cache_hits
    llm.apply_model(_scale_layer0_v)
    ref.apply_model(_scale_layer0_v)
    while engine.has_unfinished():
        engine.step()
    assert engine.blocks.prefix_cache_hits == hits
    assert queued.completions[0].token_ids == _greedy(ref, LONG)
