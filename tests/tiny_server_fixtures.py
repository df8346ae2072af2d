"""Fixtures several robustness tests share: a tiny Llama checkpoint and an in-process server over it.
A test module imports the ones it uses (a second conftest.py would shadow tests/conftest.py's module name)."""
import pytest

from app_client import app_client
from tiny_llama import write_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), eos_token_id=3)


@pytest.fixture(scope="module")
def served(tiny):
    """(engine, client): the server's engine and an HTTP client of its app, 256 tokens a session."""
    with app_client(tiny, 256) as (engine, client):
        yield engine, client


@pytest.fixture(scope="module")
def http(served):
    return served[1]
