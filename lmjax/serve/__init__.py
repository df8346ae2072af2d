"""OpenAI-compatible serving: `openai_server` (the FastAPI app; its routes in `routes_*`, their shared state in
`served`), `run` (`run_server`: uvicorn), `protocol` (request models),
`client` (`APIClient`, LMDeploy's Python client), `launch` (`serve`: the server in a subprocess).
Importing this package imports neither FastAPI nor the client's httpx (`lmjax chat` and `lmjax generate` run
without the `serve` extra): the client's names load on first use.

The package can be called: `lmjax.serve(model_path, ...)` is LMDeploy's `lmdeploy.serve(...)` (see
lmjax.serve.launch). LMDeploy's top-level `serve` function shadows its `serve` subpackage; here the one
name is both, so `lmjax.serve(...)`, `import lmjax.serve.client` and `from lmjax.serve.openai_server
import ...` all work in any order: the import system binds `lmjax.serve` to this module object whenever
a submodule is imported, and the object itself is callable (its class below), so no rebinding can
replace the function.
"""
import sys
import types

__all__ = ["APIClient", "APIClientError", "APIConnectionError", "get_model_list"]


def __getattr__(name: str):
    if name in __all__:
        from lmjax.serve import client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        """`lmjax.serve(model_path, ...)`: see lmjax.serve.launch.serve."""
        from lmjax.serve.launch import serve

        return serve(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
