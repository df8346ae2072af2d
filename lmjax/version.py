"""lmjax's versions, as `lmdeploy.version` lays them out (`lmjax.__version__`, `lmjax.version_info`).

`__version__` is lmjax's own release (pyproject.toml's). `version_info` is NOT parsed from it: it is the
LMDeploy release whose Python API lmjax mirrors, because every reader of `lmdeploy.version_info` compares
it with LMDeploy releases to pick a code path. The one such gate known in agent and eval code is
`(0, 6, 0)`, where `GenerationConfig.do_sample` appeared, and lmjax's GenerationConfig takes it:
- lagent's LMDeployPipeline raises "do_sample is not supported until v0.6.0" below it, and from it on
  passes `do_sample = top_k > 1 or temperature > 0` (which lmjax honours);
- LightRAG's LMDeploy backend passes do_sample=False by default, so below 0.6 it always raises;
- OpenCompass's TurboMind models ask for greedy decoding with do_sample=False from 0.6 on, top_k=1 before
  (both greedy in lmjax).
lmjax's own (0, 1, 0) would send all of them down the paths for LMDeploy before 0.1. Nothing newer is
claimed: the seed docs describe the API up to 0.6, and no caller is known to gate on a later release.
"""
__version__ = "0.1.0"
LMDEPLOY_API_VERSION = "0.6.0"
version_info: tuple[int, ...] = tuple(int(part) for part in LMDEPLOY_API_VERSION.split("."))

__all__ = ["LMDEPLOY_API_VERSION", "__version__", "version_info"]
