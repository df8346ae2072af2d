"""The OpenAI app over an AsyncEngine, in process (fastapi's TestClient: a server exception comes back as the
response a client would see), for test modules' fixtures."""
import contextlib


@contextlib.contextmanager
def app_client(path: str, session_len: int = 256, enable_prefix_caching: bool = False, **app_kwargs):
    """Yields (engine, client) over the model at `path` (served as "tiny"); closes the engine after."""
    from fastapi.testclient import TestClient

    from lmjax.api.async_engine import AsyncEngine
    from lmjax.lmdeploy_config import TurbomindEngineConfig
    from lmjax.serve.openai_server import create_app

    engine = AsyncEngine(path, model_name="tiny",
                         backend_config=TurbomindEngineConfig(session_len=session_len, cache_block_seq_len=16,
                                                              enable_prefix_caching=enable_prefix_caching))
    try:
        with TestClient(create_app(engine, **app_kwargs), raise_server_exceptions=False) as client:
            yield engine, client
    finally:
        engine.close()
