"""onboard's reference serving engine (nano-vllm's shape); this is its public surface.

Stages, the server and the bench use these names only, never the runner, the scheduler or the
block manager (`tests/engine/test_public_api.py` checks).  Beside requests in, tokens out
(`add_request`, `step`, `generate`), an `LLMEngine` gives what stages read of the model it serves:

* `score(token_ids)`            float32 logits at every position (teacher forcing);
* `hidden_states(token_ids, aux_layers)` and `batched_hidden_states(token_lists, aux_layers)`
                                the final normed hidden states and decoder layers' inputs, as served
                                (an EAGLE-3 speculator trains on them);
* `decoder_layer(index)`        a decoder layer's modules and weights as served, for reading;
* `target_tensors()`, `hf_config`, `vocab_size`, `kv_layout`, `kernel_report`, `stats()`.

`StepBench` runs one model's forward steps by hand, at any context without prefilling it, as
either numerics' step (`onboard bench-kv` times them).  `LayerStepper` runs a checkpoint larger
than memory one decoder layer at a time, in exact numerics (layerwise parity):

* `LayerStepper(path, dtype, device)`   embeddings, final norm and head only, no layer resident;
* `decoder_layer(index)`                layer `index` built from the checkpoint now, not kept;
* `prefill(num_tokens)`                 one sequence's step, to run every layer in order over;
* `run_decoder_layer(layer, hidden, step)`  the layer's `[T, H]` output, as the model's forward
                                        gives it (DSA: a layer's selection handed on in `step`);
* `embed(token_ids)`, `final_norm(hidden)`, `compute_logits(hidden)`, `embed_tokens`, `hf_config`;
* `checkpoint_linears(module)`          a layer's linears by the checkpoint module each was read from.

Where the engine's parts live:

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
    "StepBench": "onboard.engine.step_bench",
    "LayerStepper": "onboard.engine.layer_stepper",
    "checkpoint_linears": "onboard.engine.layer_stepper",
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
