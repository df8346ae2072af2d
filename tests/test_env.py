"""lmjax.env.env_choice: the one reader of the LMJAX_* switches (argument > environment > default)."""
import pytest

from lmjax.env import env_choice

CHOICES = ("auto", "kernel", "reference")


def test_argument_beats_environment_beats_default(monkeypatch):
    monkeypatch.delenv("LMJAX_TEST_SWITCH", raising=False)
    assert env_choice("LMJAX_TEST_SWITCH", CHOICES, "auto") == "auto"
    monkeypatch.setenv("LMJAX_TEST_SWITCH", "")  # set but empty: the default, as if unset
    assert env_choice("LMJAX_TEST_SWITCH", CHOICES, "auto") == "auto"
    monkeypatch.setenv("LMJAX_TEST_SWITCH", "kernel")
    assert env_choice("LMJAX_TEST_SWITCH", CHOICES, "auto") == "kernel"
    assert env_choice("LMJAX_TEST_SWITCH", CHOICES, "auto", "reference") == "reference"


def test_bad_values_name_the_variable_or_the_argument(monkeypatch):
    monkeypatch.setenv("LMJAX_TEST_SWITCH", "fast")
    with pytest.raises(ValueError, match=r"^LMJAX_TEST_SWITCH='fast' must be one of \('auto'"):
        env_choice("LMJAX_TEST_SWITCH", CHOICES, "auto")
    with pytest.raises(ValueError, match=r"^LMJAX_TEST_SWITCH / test impl='slow' must be one of"):
        env_choice("LMJAX_TEST_SWITCH", CHOICES, "auto", "slow", label="test impl")
