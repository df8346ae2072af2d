"""Review 26 of the day's server changes (the max_tokens cut: tests/serve/test_generation_config_max_tokens.py):
- `lmjax.serve(model, backend_config=TurbomindEngineConfig(...))` lowered the configs' new seed=None onto no
  api_server flag and raised; the api_server (LMDeploy's CLI) draws a random engine seed (LMDeploy's server
  draws one per unseeded request) unless --seed N (vLLM's) asks for repeatable runs."""
import pytest

import lmjax


def test_serve_takes_lmdeploy_backend_configs():
    from lmjax.serve.launch import _engine_options

    for cfg in (lmjax.TurbomindEngineConfig(session_len=64), lmjax.PytorchEngineConfig()):
        assert _engine_options(cfg, None)["seed"] is None
    assert _engine_options(None, None)["seed"] is None
    assert _engine_options(lmjax.EngineConfig(seed=3), None)["seed"] == 3


@pytest.mark.parametrize("argv, seed", [([], None), (["--seed", "7"], 7)])
def test_api_server_engine_seed(monkeypatch, argv, seed):
    import lmjax.api.async_engine as ae
    from lmjax import cli

    seen = {}
    monkeypatch.setattr(ae, "AsyncEngine", lambda model, backend_config=None, **_: seen.update(config=backend_config))
    cli._async_engine(cli.build_parser().parse_args(["serve", "api_server", "m", *argv]))
    assert seen["config"].seed == seed
