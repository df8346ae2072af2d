"""README's `convert.convert_checkpoint(...)` line is the real signature, and a positional call past group_size
is refused (probe 26: README left `overwrite` out, so a call in its order put the w4 method into `overwrite`,
truthy, replacing an existing OUT, and the calibration file into w4_method)."""
import inspect
import os
import re

import pytest

import convert

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def test_readme_signature_matches_the_code():
    text = " ".join(open(README).read().split())
    documented = re.search(r"`convert\.convert_checkpoint\((.*?)\)` \(keyword-only", text).group(1)
    names = [p.split("=")[0].strip() for p in re.sub(r"\([^)]*\)", "", documented).split(",")]
    params = inspect.signature(convert.convert_checkpoint).parameters
    code = [("*" if p.kind is p.KEYWORD_ONLY and i and list(params.values())[i - 1].kind is not p.KEYWORD_ONLY
             else None, name) for i, (name, p) in enumerate(params.items())]
    assert names == [n for star, name in code for n in ((star, name) if star else (name,))]


def test_options_past_group_size_are_keyword_only():
    with pytest.raises(TypeError):
        inspect.signature(convert.convert_checkpoint).bind("src", "out", "bfloat16", 1, "w4", 128, "gptq")
