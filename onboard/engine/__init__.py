"""onboard's reference serving engine (nano-vllm's shape); this is its public surface.

Stages, the server and the bench use these names only, never the runner, the scheduler or the
block manager.  Where the engine's parts live:

* `attention/`  attention backends behind one interface (`base.py`), chosen per engine;
* `kv_cache.py` the KV layout a model declares (`KVLayout`) and the paged cache built from it;
* `layers/`     model pieces: norms, MLPs, attention types (`mha.py`, `mla.py`, `dsa.py`), MoE blocks;
* `models/`     one file per family and the registry (`models/__init__.py`).

Names load on first use, so importing one engine module does not import them all.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "LLMEngine": "onboard.engine.llm_engine",
    "Completion": "onboard.engine.llm_engine",
    "RequestOutput": "onboard.engine.llm_engine",
    "EngineConfig": "onboard.engine.config",
    "SamplingParams": "onboard.engine.sampler",
    "MAX_LOGPROBS": "onboard.engine.sampler",
    "GrammarSpec": "onboard.engine.grammar",
    "KVLayout": "onboard.engine.kv_cache",
    "UnsupportedArchitecture": "onboard.engine.models",
    "engine_model_name": "onboard.engine.models",
    "kv_layout_for": "onboard.engine.models",
    "supported_architectures": "onboard.engine.models",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'onboard.engine' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
