"""LMDeploy's `lmdeploy.serve.openai` layout, for code that imports from there (lagent's LMDeployClient:
`from lmdeploy.serve.openai.api_client import APIClient`). The server itself is lmjax.serve.openai_server.

Named `openai` as in LMDeploy; imports are absolute, so `import openai` anywhere still gets the PyPI package.
"""
