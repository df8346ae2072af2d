"""`lmdeploy.serve.openai.api_client`'s names: lmjax's client (lmjax/serve/client.py) under LMDeploy's path."""
from lmjax.serve.client import APIClient, APIClientError, APIConnectionError, get_model_list, json_loads

__all__ = ["APIClient", "APIClientError", "APIConnectionError", "get_model_list", "json_loads"]
