"""lmjax.env.env_choice / env_int: the readers of the LMJAX_* switches (argument > environment > default)."""
import os

import pytest

from lmjax.env import env_choice, env_int

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


def test_env_int_argument_beats_environment_beats_default(monkeypatch):
    monkeypatch.delenv("LMJAX_TEST_NUMBER", raising=False)
    assert env_int("LMJAX_TEST_NUMBER", 4) == 4
    monkeypatch.setenv("LMJAX_TEST_NUMBER", "")  # set but empty: the default
    assert env_int("LMJAX_TEST_NUMBER", 4) == 4
    monkeypatch.setenv("LMJAX_TEST_NUMBER", " 16 ")
    assert env_int("LMJAX_TEST_NUMBER", 4, minimum=1) == 16
    assert env_int("LMJAX_TEST_NUMBER", 4, 0) == 0  # an argument of 0 is a value, not "unset"


def test_env_int_bad_values_name_the_variable_and_the_value(monkeypatch):
    for bad in ("four", "2.5", "0x10"):
        monkeypatch.setenv("LMJAX_TEST_NUMBER", bad)
        with pytest.raises(ValueError, match=rf"^LMJAX_TEST_NUMBER='{bad}' must be an integer$"):
            env_int("LMJAX_TEST_NUMBER", 4)
    monkeypatch.setenv("LMJAX_TEST_NUMBER", "-3")
    with pytest.raises(ValueError, match=r"^LMJAX_TEST_NUMBER=-3 must be >= 1$"):
        env_int("LMJAX_TEST_NUMBER", 4, minimum=1)
    with pytest.raises(ValueError, match=r"^LMJAX_TEST_NUMBER / test size=2.5 must be an integer$"):
        env_int("LMJAX_TEST_NUMBER", 4, 2.5, label="test size")
    monkeypatch.delenv("LMJAX_TEST_NUMBER")
    with pytest.raises(ValueError, match=r"^LMJAX_TEST_NUMBER=0 must be >= 1$"):  # a bad default too
        env_int("LMJAX_TEST_NUMBER", 0, minimum=1)


def test_xla_flag_defaults_add_nccl_sync_allreduce_once_and_respect_the_user(monkeypatch):
    import subprocess
    import sys

    from lmjax.env import NCCL_SYNC_XLA_FLAGS, apply_xla_flag_defaults, has_cuda_plugin

    monkeypatch.delenv("LMJAX_TP_ALLREDUCE", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    assert apply_xla_flag_defaults(cuda=False) == []  # CPU-only installs: left alone
    assert apply_xla_flag_defaults(cuda=True) == list(NCCL_SYNC_XLA_FLAGS)
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2 " + " ".join(NCCL_SYNC_XLA_FLAGS)
    assert apply_xla_flag_defaults(cuda=True) == []  # already there: not added twice
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_disable_async_collectives=ALLGATHER")  # the user's own choice
    assert apply_xla_flag_defaults(cuda=True) == []
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.setenv("LMJAX_TP_ALLREDUCE", "xla")
    assert apply_xla_flag_defaults(cuda=True) == [] and "XLA_FLAGS" not in os.environ
    monkeypatch.setenv("LMJAX_TP_ALLREDUCE", "fast")
    with pytest.raises(ValueError, match=r"LMJAX_TP_ALLREDUCE / tp allreduce='fast' must be one of"):
        apply_xla_flag_defaults(cuda=True)
    # `import lmjax` adds them only where JAX has its CUDA plugin (not on this CPU-only install), and the
    # flags are ones this jaxlib knows (an unknown flag in XLA_FLAGS aborts the process).
    code = "import os, lmjax, jax.numpy as jnp; print(float(jnp.ones(()) + 1), os.environ.get('XLA_FLAGS', '-'))"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "LMJAX_TP_ALLREDUCE")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["2.0", *(NCCL_SYNC_XLA_FLAGS if has_cuda_plugin() else ["-"])]
    env["XLA_FLAGS"] = " ".join(NCCL_SYNC_XLA_FLAGS)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["2.0", *NCCL_SYNC_XLA_FLAGS]


def test_prefill_impl_switch(monkeypatch):
    from lmjax.layers.attention import prefill_impl

    monkeypatch.delenv("LMJAX_PREFILL_IMPL", raising=False)
    assert prefill_impl() == "auto"
    monkeypatch.setenv("LMJAX_PREFILL_IMPL", "triton")
    assert prefill_impl() == "triton" and prefill_impl("mosaic") == "mosaic"
    monkeypatch.setenv("LMJAX_PREFILL_IMPL", "flash")
    with pytest.raises(ValueError, match="LMJAX_PREFILL_IMPL / prefill impl='flash'"):
        prefill_impl()
