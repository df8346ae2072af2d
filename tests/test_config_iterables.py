"""validation.as_list (d587389) now only iterates list/tuple/set/frozenset/array-likes: a range, a generator or
dict keys — accepted before (list(value)), and by vLLM — are a ValueError "must hold int values"."""
from lmjax import SamplingParams


def test_range_of_allowed_token_ids():
    assert SamplingParams(allowed_token_ids=range(3)).allowed_token_ids == [0, 1, 2]


def test_generator_and_dict_keys_of_stop_strings():
    assert SamplingParams(stop=(s for s in ["a", "b"])).stop == ["a", "b"]
    assert SamplingParams(stop={"x": 1}.keys()).stop == ["x"]
