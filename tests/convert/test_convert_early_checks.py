"""`lmjax convert` refuses what it cannot finish before it loads or calibrates anything (minutes on a real
model), keeps what the source's tokenizer carries, and its w4 output is what LMDeploy's model_format='awq' means
(review 32)."""
import os
import sys

import pytest

import convert.convert as convert_module
from convert import convert_checkpoint
from lmjax.loader.awq import require_awq
from lmjax.loader.model_loader import load_model
from lmjax.loader.tokenizer import load_tokenizer
from test_convert import tiny  # noqa: F401


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if the conversion gets as far as loading the weights."""
    def load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the bad option was refused")
    monkeypatch.setattr(convert_module, "load_model", load)


def test_a_tp_that_does_not_divide_the_heads_is_refused_before_the_load(tiny, tmp_path, no_load):  # noqa: F811
    with pytest.raises(ValueError, match="tp=3"):
        convert_checkpoint(tiny, str(tmp_path / "out"), dtype="float32", tp=3, quant="w4")


def test_a_calibration_text_too_short_is_refused_before_the_load(tiny, tmp_path, no_load):  # noqa: F811
    short = tmp_path / "calib.txt"
    short.write_text("t5 t6")
    with pytest.raises(ValueError, match="calib"):
        convert_checkpoint(tiny, str(tmp_path / "out"), dtype="float32", quant="w4", calib_text=str(short))


@pytest.mark.parametrize("options, bad", [(dict(tp="2"), "tp='2'"), (dict(tp=2.0), "tp=2.0"),
                                          (dict(quant="w4", group_size=48.5), "group_size=48.5")])
def test_options_of_the_wrong_type_are_refused(tiny, tmp_path, no_load, options, bad):  # noqa: F811
    with pytest.raises(ValueError, match=bad):
        convert_checkpoint(tiny, str(tmp_path / "out"), dtype="float32", **options)


def test_without_orbax_convert_and_load_say_what_to_install(tiny, tmp_path, monkeypatch):  # noqa: F811
    out = convert_checkpoint(tiny, str(tmp_path / "out"), dtype="float32")
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)  # as if `pip install lmjax` without [convert]
    with pytest.raises(ValueError, match=r"lmjax\[convert\]"):
        convert_checkpoint(tiny, str(tmp_path / "again"), dtype="float32")
    with pytest.raises(ValueError, match=r"lmjax\[convert\]"):
        load_model(out, "float32")


def test_named_chat_templates_travel_with_the_conversion(tiny, tmp_path):  # noqa: F811
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny, src)
    tok = load_tokenizer(str(src))
    tok.chat_template = {"default": "{% for m in messages %}t3 {{ m['content'] }} {% endfor %}",
                         "tool_use": "{% for t in tools %}t6 {% endfor %}{% for m in messages %}t4 {{ m['content'] }} "
                                     "{% endfor %}"}
    tok.save_pretrained(str(src))
    assert os.path.isdir(src / "additional_chat_templates")  # where transformers puts the named ones
    out = convert_checkpoint(str(src), str(tmp_path / "out"), dtype="float32")
    messages, tools = [{"role": "user", "content": "t9"}], [{"type": "function", "function": {"name": "f"}}]
    for path in (str(src), out):
        converted = load_tokenizer(path)
        assert converted.apply_chat_template(messages, tools=tools, tokenize=False) == "t6 t4 t9 ", path


def test_an_lmjax_w4_conversion_is_what_model_format_awq_means(tiny, tmp_path):  # noqa: F811
    w4 = convert_checkpoint(tiny, str(tmp_path / "w4"), dtype="float32", quant="w4", group_size=32, w4_method="rtn")
    require_awq(w4, "TurbomindEngineConfig(model_format='awq')")
    w8 = convert_checkpoint(tiny, str(tmp_path / "w8"), dtype="float32", quant="w8")
    with pytest.raises(ValueError, match="'w8', not 'w4'"):
        require_awq(w8, "TurbomindEngineConfig(model_format='awq')")
