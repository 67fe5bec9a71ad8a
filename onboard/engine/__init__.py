"""onboard's reference serving engine (nano-vllm's shape); this is its public surface.

Stages, the server and the bench use these names only, never the runner, the scheduler or the
block manager (`tests/engine/test_public_api.py` checks).  Beside requests in, tokens out
(`add_request`, `step`, `generate`), an `LLMEngine` gives what stages read of the model it serves:

* `score(token_ids)`            float32 logits at every position (teacher forcing);
* `hidden_states(token_ids, aux_layers)` and `batched_hidden_states(token_lists, aux_layers)`
                                the final normed hidden states and decoder layers' inputs, as served
                                (an EAGLE-3 speculator trains on them);
* `decoder_layer(index)`        a decoder layer's modules and weights as served, for reading;
* `target_tensors()`, `hf_config`, `vocab_size`, `kv_layout`, `kernel_report`, `stats()`;
* `tokenizer`, `config`, `dtype`, `eos_ids`, `grammars`, `speculator` (its `stats`), and for a
  server's loop `has_unfinished()` and `abort(request_id)`.

What a `decoder_layer` holds is read through `EngineLinear`, `LlamaAttention` and `LlamaMLP`;
`CheckpointWeights` reads a checkpoint's tensors as the engine loads them; `uses_mla(config)`
and `kv_layout_for(config)` describe a model's attention and KV cache without building it.

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

Names load on first use, so importing one engine module does not import them all. `examples/engine.py`
shows the API in 30 lines (`tests/test_examples.py` runs it).
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLMEngine": "onboard.engine.llm_engine",
    "Completion": "onboard.engine.llm_engine",
    "RequestOutput": "onboard.engine.llm_engine",
    "StepBench": "onboard.engine.step_bench",
    "LayerStepper": "onboard.engine.layer_stepper",
    "checkpoint_linears": "onboard.engine.layer_stepper",
    "EngineConfig": "onboard.engine.config",
    "NUMERICS": "onboard.engine.config",
    "SamplingParams": "onboard.engine.sampler",
    "MAX_LOGPROBS": "onboard.engine.logprobs",
    "check_num_logprobs": "onboard.engine.logprobs",
    "GrammarSpec": "onboard.engine.grammar",
    "KVLayout": "onboard.engine.kv_cache",
    "CheckpointWeights": "onboard.engine.weights",
    "EngineLinear": "onboard.engine.linear",
    "LlamaAttention": "onboard.engine.layers.mha",
    "LlamaMLP": "onboard.engine.layers.mlp",
    "UnsupportedArchitecture": "onboard.engine.models",
    "engine_model_name": "onboard.engine.models",
    "kv_layout_for": "onboard.engine.models",
    "supported_architectures": "onboard.engine.models",
    "uses_mla": "onboard.engine.models",
    "draft_input": "onboard.engine.layers.residual",
}

__all__ = [  # spelled out so that linters and type checkers read it; equal to _EXPORTS's keys
    "MAX_LOGPROBS",
    "NUMERICS",
    "CheckpointWeights",
    "Completion",
    "EngineConfig",
    "EngineLinear",
    "GrammarSpec",
    "KVLayout",
    "LLMEngine",
    "LayerStepper",
    "LlamaAttention",
    "LlamaMLP",
    "RequestOutput",
    "SamplingParams",
    "StepBench",
    "UnsupportedArchitecture",
    "check_num_logprobs",
    "checkpoint_linears",
    "draft_input",
    "engine_model_name",
    "kv_layout_for",
    "supported_architectures",
    "uses_mla",
]

if TYPE_CHECKING:  # the same names, eagerly, for type checkers and IDEs
    from onboard.engine.config import NUMERICS, EngineConfig
    from onboard.engine.grammar import GrammarSpec
    from onboard.engine.kv_cache import KVLayout
    from onboard.engine.layer_stepper import LayerStepper, checkpoint_linears
    from onboard.engine.layers.mha import LlamaAttention
    from onboard.engine.layers.mlp import LlamaMLP
    from onboard.engine.layers.residual import draft_input
    from onboard.engine.linear import EngineLinear
    from onboard.engine.llm_engine import Completion, LLMEngine, RequestOutput
    from onboard.engine.logprobs import MAX_LOGPROBS, check_num_logprobs
    from onboard.engine.models import (
        UnsupportedArchitecture,
        engine_model_name,
        kv_layout_for,
        supported_architectures,
        uses_mla,
    )
    from onboard.engine.sampler import SamplingParams
    from onboard.engine.step_bench import StepBench
    from onboard.engine.weights import CheckpointWeights


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'onboard.engine' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
