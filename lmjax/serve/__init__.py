"""OpenAI-compatible serving: `openai_server` (FastAPI app, `run_server`), `protocol` (request models),
`client` (`APIClient`, LMDeploy's Python client). Importing this package does not import FastAPI."""
from lmjax.serve.client import APIClient, APIClientError, APIConnectionError, get_model_list

__all__ = ["APIClient", "APIClientError", "APIConnectionError", "get_model_list"]
