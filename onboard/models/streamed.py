"""A checkpoint run one decoder layer at a time over batches of token ids.

Resident at any moment: the embedding table, ONE decoder layer (built from its own tensors by
`onboard.models.layers`, plain or compressed-tensors), and every batch's hidden states.  Each
batch computes exactly what the whole model's forward computes on it (the same layer classes,
mask and rotary embeddings, in the same order), so the streamed stages give the in-memory
stages' numbers (tests compare them).  Layers are read in order, once per pass, so a pass costs
one read of the checkpoint.
"""

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress

from onboard.console import console
from onboard.memory import layer_by_layer
from onboard.models.layers import CheckpointLayers, check_layerwise

# A batch's state between layers: its hidden states, and the top-k indices a DSA layer hands on
# to the next (None elsewhere).
State = tuple[torch.Tensor, Any]


class StreamedModel:
    """transformers' decoder of the checkpoint at `path`, run layer by layer."""

    def __init__(self, path: Path, dtype: torch.dtype = torch.bfloat16, device: str = "cpu"):
        self.path = Path(path)
        self.config = check_layerwise(self.path)
        self.parts = CheckpointLayers(self.path, self.config, dtype, torch.device(device))
        self.dtype = dtype
        self.dsa = getattr(self.config, "indexer_types", None) is not None

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def embedding_table(self) -> torch.Tensor:
        return self.parts.tensors("model.embed_tokens.")["weight"].to(self.parts.device, self.dtype)

    def embed(self, input_ids: torch.Tensor, table: torch.Tensor | None = None) -> State:
        """The first layer's input for ids [b, T]; `table`: `embedding_table()`, read once by a caller
        embedding many batches."""
        table = self.embedding_table() if table is None else table
        return self.parts.open_streams(torch.nn.functional.embedding(input_ids.to(self.parts.device), table)), None

    def layer(self, index: int) -> torch.nn.Module:
        return self.parts.layer(index)

    def run(self, module: torch.nn.Module, state: State) -> State:
        """One decoder layer on a batch [b, T, d], with the mask and rotary embeddings the whole
        model's forward builds for it."""
        hidden, topk = state
        positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
        kwargs = self.parts.layer_kwargs(module, hidden, positions)
        if self.dsa:
            kwargs["prev_topk_indices"] = topk
        out = module(hidden, **kwargs)
        return (out[0], out[1]) if isinstance(out, tuple) else (out, None)

    def indices(self, label: str) -> Iterator[int]:
        """Layer indices in order under a progress bar; the caller builds, runs and deletes each
        layer between steps, and freed memory goes back to the system after each."""
        with Progress(console=console, transient=True) as progress, layer_by_layer() as drop:
            task = progress.add_task(label, total=self.num_layers)
            for index in range(self.num_layers):
                yield index
                drop()
                progress.advance(task)

    @torch.inference_mode()
    def final_hidden(
        self, batches: list[torch.Tensor], label: str, capture: Callable[[int, int, torch.Tensor], None] | None = None
    ) -> list[torch.Tensor]:
        """The last decoder layer's output (before the final norm) for each batch of ids [b, T];
        `capture(layer, batch, hidden)` sees each layer's output on the way."""
        table = self.embedding_table()
        states = [self.embed(ids, table) for ids in batches]
        del table
        for index in self.indices(label):
            module = self.layer(index)
            for b, state in enumerate(states):
                states[b] = self.run(module, state)
                if capture is not None:
                    capture(index, b, states[b][0])
            del module
        return [hidden for hidden, _ in states]

    def norm(self) -> torch.nn.Module:
        return self.parts.norm()

    def head(self) -> torch.Tensor:
        """lm_head's weight as stored (the embedding table where tied); a quantized head is refused."""
        from onboard.errors import OnboardError

        if getattr(self.config, "tie_word_embeddings", False):
            return self.parts.tensors("model.embed_tokens.")["weight"].to(self.parts.device, self.dtype)
        stored = self.parts.tensors("lm_head.")
        if set(stored) != {"weight"}:
            raise OnboardError(f"{self.path}: a quantized lm_head cannot be streamed; keep it in BF16 (ignore)")
        return stored["weight"].to(self.parts.device, self.dtype)

    def logit_chunks(self, normed: torch.Tensor, chunk: int, weight: torch.Tensor) -> Iterator[torch.Tensor]:
        """float32 logits of final-normed hidden states [positions, d], as `evaluate.logits.head_chunks`
        computes them (`weight` from `head().float()`, converted once by the caller)."""
        softcap = getattr(self.config, "final_logit_softcapping", None)
        for start in range(0, normed.shape[0], chunk):
            logits = normed[start : start + chunk].float() @ weight.T
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            yield logits
