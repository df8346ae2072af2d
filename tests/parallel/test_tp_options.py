"""Tensor-parallel options as LMDeploy's and vLLM's users spell them (review 32): `lmjax generate --tp`, vLLM's
`-tp`, launcher-only settings accepted with no effect (and a typo refused), and a server that will not start
in a process joined to others."""
import pytest

from conftest import write_tiny_llama
from lmjax import LLM, PytorchEngineConfig, TurbomindEngineConfig, cli


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("argv", [["generate", "--tp", "2", "hi"], ["generate", "-tp", "2", "hi"],
                                  ["generate", "--tensor-parallel-size", "2", "hi"],
                                  ["serve", "api_server", "m", "-tp", "2"], ["chat", "m", "-tp", "2"]])
def test_tp_spellings(argv):
    assert cli.build_parser().parse_args(argv).tp == 2


def test_generate_runs_tensor_parallel(tiny, monkeypatch):
    seen = {}

    class Pipe:  # what `lmjax generate` builds, recorded instead of run
        def __init__(self, model, backend_config):
            seen["tp"] = backend_config.tp

        def __enter__(self):
            raise SystemExit(0)

        def __exit__(self, *exc):
            return False
    monkeypatch.setattr("lmjax.api.pipeline.pipeline", Pipe)
    with pytest.raises(SystemExit):
        cli.main(["generate", "--model", tiny, "--tp", "2", "hi"])
    assert seen == {"tp": 2}


def test_launcher_settings_have_no_effect_and_typos_fail(tiny):
    assert PytorchEngineConfig(tp=2, distributed_executor_backend="mp").to_engine_config().tp == 2
    assert TurbomindEngineConfig(tp=2, communicator="native").to_engine_config().tp == 2
    with pytest.raises(ValueError, match="distributed_executor_backend='bogus'"):
        LLM(tiny, distributed_executor_backend="bogus")


def test_the_server_refuses_a_process_joined_to_others(tiny, monkeypatch, capsys):
    import jax

    from lmjax import parallel

    monkeypatch.setattr(parallel, "initialize_distributed", lambda: None)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(cli, "_async_engine", lambda *a: pytest.fail("it loaded the model"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "api_server", tiny, "--server-port", "0"])
    assert exit_.value.code == 2 and "joined to 1 other(s)" in capsys.readouterr().err
