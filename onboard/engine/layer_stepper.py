"""A model's decoder layers run one at a time, for checkpoints larger than memory.

`LayerStepper` holds only the embeddings, the final norm and the head; `decoder_layer(i)` builds
layer i from the checkpoint's tensors when asked (the caller keeps it as long as it needs it, so
one layer is resident at a time), and `run_decoder_layer` runs it on `[T, H]` hidden states as
the whole model's forward would at that point: over a `prefill(num_tokens)` step of one sequence
(positions 0 .. T-1) whose private cache holds every layer, with the per-step tables the family
computes once (RoPE cos/sin).  Running layers 0, 1, ... in order over one step hands on what a
layer leaves for the next (DSA: GLM-5's shared layers reuse the previous indexer layer's
selection), so `embed`, every layer, `final_norm` and `compute_logits` give `LLMEngine.score`'s
logits bit for bit.

Numerics are the engine's exact ones (transformers' products: unfused linears, the per-row
attention backend on the CPU); `checkpoint_linears(layer)` names a layer's linears by the
checkpoint module each was read from, to run one alone.
"""

from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig

from onboard.engine.attention import attention_backend
from onboard.engine.batch import ForwardBatch
from onboard.engine.context import StepContext
from onboard.engine.kv_cache import KVCache
from onboard.engine.linear import EngineLinear
from onboard.engine.models import model_class
from onboard.engine.state_cache import StateCache
from onboard.engine.weights import CheckpointWeights
from onboard.models.vlm import text_model_config

_BLOCK_SIZE = 16


def checkpoint_linears(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Each linear in `module` (a decoder layer, say) by the checkpoint module it was read from
    (`model.layers.3.self_attn.o_proj`; "a+b" where fast numerics fused two), callable on `[N, in]`."""
    return {m.name: m for m in module.modules() if isinstance(m, EngineLinear)}


class LayerStepper:
    """The checkpoint at `path` in `dtype` on `device`, with no decoder layer resident."""

    def __init__(self, path: Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.dtype = dtype
        self.hf_config = text_model_config(AutoConfig.from_pretrained(path))
        self._weights = CheckpointWeights(Path(path), dtype=dtype, device=self.device, fuse_linears=False)
        self._model = model_class(self.hf_config)(self.hf_config, self._weights, layer_ids=())
        self._backend = attention_backend(self.device)

    @property
    def num_decoder_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def embed_tokens(self) -> torch.Tensor:
        """The input embeddings `[V, H]` in the compute dtype (the head's weight where tied)."""
        return self._model.embed_tokens

    def decoder_layer(self, index: int) -> torch.nn.Module:
        """Decoder layer `index` (negative: from the end) built now from the checkpoint's tensors,
        as the served model builds it; not kept here."""
        if index < 0:
            index += self.num_decoder_layers
        if not 0 <= index < self.num_decoder_layers:
            raise IndexError(f"decoder layer {index} of {self.num_decoder_layers}")
        return self._model.make_layer(self.hf_config, self._weights, f"model.layers.{index}", index)

    def prefill(self, num_tokens: int) -> StepContext:
        """One sequence's prefill of `num_tokens` tokens (positions 0 .. num_tokens - 1) over a
        private cache holding every layer: pass it to `run_decoder_layer` for each layer in order."""
        blocks = -(-num_tokens // _BLOCK_SIZE)
        cache = KVCache(self._model.kv_layout, blocks, _BLOCK_SIZE, self.device)
        positions = torch.arange(num_tokens, device=self.device)
        batch = ForwardBatch(
            input_ids=torch.zeros(num_tokens, dtype=torch.long, device=self.device),
            positions=positions,
            slot_mapping=positions,
            query_lens=[num_tokens],
            context_lens=[num_tokens],
            block_tables=[list(range(blocks))],
            logits_indices=torch.tensor([num_tokens - 1], device=self.device),
            block_size=_BLOCK_SIZE,
            decoding=[False],
            state_slots=[0],
        )
        layout = self._model.state_layout  # linear attention: one slot, the sequence's
        state = None if layout is None else StateCache(layout, 1, self.device)
        step = StepContext(cache, self._backend, self._backend.build_metadata(batch), positions, state=state)
        self._model.prepare(batch, step)
        return step

    @torch.inference_mode()
    def embed(self, token_ids: list[int] | torch.Tensor) -> torch.Tensor:
        """The embeddings `[T, H]` of `token_ids` as the first decoder layer's input (a
        hyper-connection family's streams `[T, hc, H]`)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).to(self.device)
        return self._model.open_streams(F.embedding(ids, self._model.embed_tokens))

    @torch.inference_mode()
    def run_decoder_layer(self, layer: torch.nn.Module, hidden: torch.Tensor, step: StepContext) -> torch.Tensor:
        """`layer`'s output on its input `hidden` (`[T, H]`, or streams), in `step` (`prefill`)."""
        return layer.forward(hidden, step)

    @torch.inference_mode()
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's final norm of the last layer's output `[T, H]` (streams closed first)."""
        return self._model.norm.forward(self._model.close_streams(hidden))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states `[S, H]` -> float32 logits `[S, V]` (as `LLMEngine.score`)."""
        return self._model.compute_logits(hidden)
