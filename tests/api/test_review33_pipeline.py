"""Review 33 of LMDeploy's pipeline facade (on the pruned SmolLM2: real tokenizer and chat template): Response
indices unique when per-prompt gen_configs mix n; a (text, image) tuple and other non-prompts refused by name;
chat refuses n > 1 and do_preprocess=False before any work; a per-call chat template's stop words apply; a
chat turn's Response keeps its logprobs (streamed too) and the session id; GenerationConfig's flags are bools."""
import pytest

from lmjax import ChatTemplateConfig, GenerationConfig, TurbomindEngineConfig, pipeline

PROMPTS = ["Hi", "What is 2+2?", "Name a color."]


@pytest.fixture(scope="module")
def pipe(smollm2_pruned):
    with pipeline(smollm2_pruned, backend_config=TurbomindEngineConfig(session_len=256,
                                                                       cache_max_entry_count=64)) as p:
        yield p


def test_indices_unique_when_n_differs(pipe):
    configs = [GenerationConfig(max_new_tokens=4), GenerationConfig(max_new_tokens=4, n=2, do_sample=True,
                                                                     random_seed=1), GenerationConfig(max_new_tokens=4)]
    out = pipe(PROMPTS, gen_config=configs)
    assert [r.index for r in out] == [0, 1, 2, 3]
    assert out[1].input_token_len == out[2].input_token_len != out[3].input_token_len
    streamed = {}
    for piece in pipe.stream_infer(PROMPTS, gen_config=configs):
        streamed[piece.index] = streamed.get(piece.index, "") + piece.text
    assert streamed == {r.index: r.text for r in out}


@pytest.mark.parametrize("prompts", [("describe this image", "https://x/a.jpg"), [("describe this image", ["img"])]])
def test_text_image_tuples_refused(pipe, prompts):
    with pytest.raises(TypeError, match=r"\(text, image\) prompt of a vision-language model; lmjax reads text only"):
        pipe(prompts)
    with pytest.raises(TypeError, match="lmjax reads text only"):
        next(iter(pipe.stream_infer(prompts)))


def test_other_non_prompts_refused(pipe):
    with pytest.raises(TypeError, match="prompts must be a str or an OpenAI messages list .* got int 5"):
        pipe(5)
    with pytest.raises(TypeError, match=r"prompts\[1\] must be a str .* got NoneType"):
        pipe(["Hi", None])


def test_chat_refuses_n_and_raw_text_before_work(pipe):
    session = pipe.session()
    with pytest.raises(ValueError, match="chat takes n=1"):
        pipe.chat("Hi", session=session, gen_config=GenerationConfig(n=2, max_new_tokens=4))
    with pytest.raises(ValueError, match="chat takes n=1"):
        pipe.chat("Hi", session=session, gen_config=GenerationConfig(n=2, max_new_tokens=4), stream_response=True)
    with pytest.raises(ValueError, match=r"chat\(do_preprocess=False\) is not supported"):
        pipe.chat("Hi", session=session, do_preprocess=False)
    assert session.messages == [] and session.response is None


def test_chat_turns_keep_logprobs_and_session_id(pipe):
    session = pipe.chat("Hi", gen_config=GenerationConfig(max_new_tokens=6, logprobs=2))
    resp = session.response
    assert resp.session_id == session.session_id and len(resp.logprobs) == resp.generate_token_len == 6
    streamed = pipe.session()
    list(pipe.chat("Hi", session=streamed, gen_config=GenerationConfig(max_new_tokens=6, logprobs=2),
                   stream_response=True))
    again = streamed.response
    assert again.session_id == streamed.session_id and again.text == resp.text
    assert again.logprobs == resp.logprobs and again.token_ids == resp.token_ids


def test_a_per_call_templates_stop_words_apply(pipe):
    template = ChatTemplateConfig(user="<|im_start|>user\n", eoh="<|im_end|>\n", assistant="<|im_start|>assistant\n",
                                  eoa="<|im_end|>", separator="\n")
    free = pipe("Hi", gen_config=GenerationConfig(max_new_tokens=8), chat_template_config=template)
    word = free.text.split()[1]  # a word the reply says after its first one
    template.stop_words = [word]
    cut = pipe("Hi", gen_config=GenerationConfig(max_new_tokens=8), chat_template_config=template)
    assert cut.finish_reason == "stop" and word not in cut.text and free.text.startswith(cut.text)


@pytest.mark.parametrize("field", ["ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                                   "include_stop_str_in_output"])
def test_generation_config_flags_are_bools(field):
    with pytest.raises(ValueError, match=f"{field} must be True or False, got str 'no'"):
        GenerationConfig(**{field: "no"})
    with pytest.raises(ValueError, match="random_seed must be None or an int, got 'x'"):
        GenerationConfig(random_seed="x")


def test_a_session_runs_its_own_turns_and_closes(pipe):
    """LMDeploy's Session: `sess(prompt)` is the next chat turn, close() / a with block forgets the history."""
    g = GenerationConfig(max_new_tokens=5)
    chat = pipe.chat("What is my name? I am Bob.", gen_config=g)
    chat = pipe.chat("Say it again.", session=chat, gen_config=g)
    with pipe.session() as sess:
        assert sess("What is my name? I am Bob.", gen_config=g) is sess
        sess("Say it again.", gen_config=g)
        assert sess.history == chat.history and sess.response.token_ids == chat.response.token_ids
        pieces = list(sess("Thanks.", gen_config=g, stream_response=True))
        assert len(sess.history) == 3 and "".join(p.text for p in pieces) == sess.response.text
    assert sess.messages == [] and sess.response is None
    with pytest.raises(ValueError, match="take one from pipe.session"):
        type(sess)(7)("Hi")


def test_a_plain_one_token_stop_word_is_left_out_of_token_ids(pipe):
    """LMDeploy turns a stop word that is one token into a stop id, and the token that stopped a reply is not in
    its token_ids nor counted in generate_token_len (lmjax matched a plain word only as text: the token stayed)."""
    from lmjax.api.lmdeploy_params import stop_word_ids

    tok, g = pipe.tokenizer, dict(max_new_tokens=10, ignore_eos=True)
    base = pipe("Hi", gen_config=GenerationConfig(**g)).token_ids
    # a token of the reply that is a word of its own, not said before (not even inside other text)
    i, word = next((i, w) for i in range(1, 9) if stop_word_ids(tok, [w := tok.decode([base[i]])]) == [base[i]]
                   and w.strip() and w not in tok.decode(base[:i]))
    r = pipe("Hi", gen_config=GenerationConfig(stop_words=[word], **g))
    assert r.finish_reason == "stop" and r.token_ids == base[:i] and r.generate_token_len == i, (r, base, word)
    assert r.text == tok.decode(base[:i])
