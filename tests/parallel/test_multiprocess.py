"""Two CPU processes joined by jax.distributed from the LMJAX_* environment alone, as the README says (a read-only
probe found each case failing before its fix): LLM and pipeline join the processes themselves (JAX's backend
used to start first: "jax.distributed.initialize() must be called before any JAX calls"); a tp whose mesh would
leave a process without devices is a clear error (was a failure deep in placement, then a Gloo timeout); the
int4 KV cache's calibration and get_logits gather arrays spread over both processes (each process running the
same program); a leader refuses get_logits, which its followers would never join."""
import os
import sys

import pytest

from conftest import write_tiny_llama
from processes import run_joined

DRIVER = os.path.join(os.path.dirname(__file__), "mp_driver.py")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tp"), num_attention_heads=8, num_key_value_heads=8)


def _run_two(ckpt: str, devices: int, tp: int, case: str) -> list[tuple[int, str, str]]:
    return run_joined([sys.executable, DRIVER, ckpt, str(devices), str(tp), case])


def _last(text: str) -> str:
    return text.strip().splitlines()[-1] if text.strip() else ""


@pytest.mark.parametrize("case", ["llm", "pipeline", "kv4", "get_logits"])
def test_two_processes_from_the_environment(ckpt, case):
    results = _run_two(ckpt, 2, 4, case)
    for i, (rc, out, err) in enumerate(results):
        assert rc == 0 and _last(out).startswith("OK"), f"process {i}: {_last(err)}"
    assert _last(results[0][1]) == _last(results[1][1])  # the same tokens / logits shape on both


def test_tp1_runs_each_process_on_its_own_devices(ckpt):
    """(Review 32.) The KV cache went to jax.devices()[0], process 0's device, while the weights sat on this
    process's own: every process but 0 failed its first step ("incompatible devices")."""
    results = _run_two(ckpt, 2, 1, "llm")
    for i, (rc, out, err) in enumerate(results):
        assert rc == 0 and _last(out).startswith("OK"), f"process {i}: {_last(err)}"
    assert _last(results[0][1]) == _last(results[1][1])


def test_a_leader_refuses_get_logits(ckpt):
    (rc0, out0, err0), (rc1, out1, err1) = _run_two(ckpt, 2, 4, "leader_get_logits")
    assert rc0 == 0 and "OK refused: get_logits is not supported" in out0, _last(err0)
    assert rc1 == 0 and _last(out1) == "OK followed 0 steps", _last(err1)  # released, never sent a step


def test_a_mesh_that_leaves_a_process_out_is_a_clear_error(ckpt):
    results = _run_two(ckpt, 4, 4, "llm")
    assert results[1][0] != 0
    assert "tp=4 takes the first 4 of 8 devices, none of process(es) [1]" in results[1][2], _last(results[1][2])
