"""OpenAI-compatible serving: `openai_server` (FastAPI app, `run_server`), `protocol` (request models),
`client` (`APIClient`, LMDeploy's Python client), `launch` (`serve`: the server in a subprocess).
Importing this package does not import FastAPI.

The package can be called: `lmjax.serve(model_path, ...)` is LMDeploy's `lmdeploy.serve(...)` (see
lmjax.serve.launch). LMDeploy's top-level `serve` function shadows its `serve` subpackage; here the one
name is both, so `lmjax.serve(...)`, `import lmjax.serve.client` and `from lmjax.serve.openai_server
import ...` all work in any order: the import system binds `lmjax.serve` to this module object whenever
a submodule is imported, and the object itself is callable (its class below), so no rebinding can
replace the function.
"""
import sys
import types

from lmjax.serve.client import APIClient, APIClientError, APIConnectionError, get_model_list

__all__ = ["APIClient", "APIClientError", "APIConnectionError", "get_model_list"]


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        """`lmjax.serve(model_path, ...)`: see lmjax.serve.launch.serve."""
        from lmjax.serve.launch import serve

        return serve(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
