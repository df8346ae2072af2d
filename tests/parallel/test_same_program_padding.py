"""Several processes making the same engine calls (no leader) must run the same program for each step: padded
steps and background-compiled decode variants depend on each process's own compile worker, so they are off there
(process 1's worker made 3 s slower; with them on, the processes launched different programs for one step and
their collectives did not match: review 29)."""
import json
import os
import sys

import pytest

from conftest import write_tiny_llama
from processes import run_joined

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "same_program_driver.py")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)


def test_processes_run_the_same_programs_with_padding_asked_for(tiny):
    results = run_joined([sys.executable, DRIVER, tiny, "1"], timeout=240)
    for rc, _, err in results:
        assert rc == 0, err[-3000:]
    runs = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in results]
    assert runs[0]["tokens"] == runs[1]["tokens"]
    assert runs[0]["padded"] == runs[1]["padded"] == 0
