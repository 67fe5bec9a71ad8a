"""Run a decoder from any layer on, from that layer's recorded input, and score the logits.

Candidate selections differ from each other in a few layers; every layer before the first
changed one computes exactly what it computed last time. Replaying its recorded output
instead of recomputing it makes each measured candidate cost only the layers from the first
change on. No library exposes "run layers i..L of a transformers model", so this swaps the
early layers of the decoder's own ModuleList for stand-ins that return the recorded tensor
while the model's forward (masks, rotary embeddings, norms) runs unchanged; a self-check at
construction proves the replay equals the plain forward for the architecture at hand.
"""

import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from onboard.errors import OnboardError
from onboard.evaluate.kl import token_kl
from onboard.evaluate.logits import head_chunks

# A module name's decoder layer index (`model.layers.3.mlp.down_proj` -> 3).
LAYER = re.compile(r"\.layers\.(\d+)\.")

CHUNK = 256  # positions per float32 logit block


class _Recorded(nn.Module):
    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.hidden


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise OnboardError(f"{type(model).__name__}: no decoder layer list to measure layer by layer")
    return layers


class LayerReplay:
    """A model, token windows [n, T], and the reference's next-token distribution on them."""

    def __init__(self, model: nn.Module, input_ids: torch.Tensor) -> None:
        self.model = model
        self.input_ids = input_ids
        self.layers = decoder_layers(model)
        self.reference_inputs, hidden = self.run(0)
        with torch.inference_mode():
            chunks = head_chunks(self.model, hidden, CHUNK)
            self.reference_logp = torch.cat([torch.log_softmax(chunk, dim=-1) for chunk in chunks])
        middle = len(self.layers) // 2
        _, replayed = self.run(middle, self.reference_inputs[middle])
        if not torch.equal(replayed, hidden):
            raise OnboardError(f"{type(model).__name__}: replaying recorded layer inputs does not reproduce the model")

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @contextmanager
    def _replaying(self, start: int, hidden: torch.Tensor | None) -> Iterator[None]:
        saved = [self.layers[i] for i in range(start)]
        for i in range(start):
            self.layers[i] = _Recorded(hidden)
        try:
            yield
        finally:
            for i, layer in enumerate(saved):
                self.layers[i] = layer

    @torch.inference_mode()
    def run(self, start: int = 0, hidden: torch.Tensor | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Layers `start`.. from `hidden` (the recorded input of layer `start`); returns the inputs
        of layers start.. (earlier entries None) and the final hidden states [n * T, d].

        Where decoder layers return a tuple (GLM-5's DSA layers return (hidden, top-k indices), and
        the model hands the indices to the next layer, which a "shared" indexer layer reuses), a
        layer's recorded input is the previous layer's whole output: what a stand-in must return.
        """
        inputs: list[torch.Tensor | None] = [None] * len(self.layers)

        def record(index: int):
            def hook(module, args, kwargs):
                if inputs[index] is None:
                    inputs[index] = args[0] if args else kwargs["hidden_states"]

            return hook

        def record_output(index: int):
            def hook(module, args, output):
                if isinstance(output, tuple):
                    inputs[index + 1] = output

            return hook

        if start:
            inputs[start] = hidden
        handles = [
            self.layers[i].register_forward_pre_hook(record(i), with_kwargs=True)
            for i in range(start, len(self.layers))
        ]
        handles += [self.layers[i].register_forward_hook(record_output(i)) for i in range(start, len(self.layers) - 1)]
        try:
            with self._replaying(start, hidden):
                last = self.model.base_model(input_ids=self.input_ids).last_hidden_state
        finally:
            for handle in handles:
                handle.remove()
        return inputs, last.reshape(-1, last.shape[-1])

    @torch.inference_mode()
    def kl(self, hidden: torch.Tensor, model: nn.Module | None = None) -> torch.Tensor:
        """KL(reference || candidate) per position, float64, from the candidate's final hidden states
        (the eval's own per-token function, a chunk of positions at a time), through `model`'s head
        (default: the replayed model's)."""
        out = []
        for index, logits in enumerate(head_chunks(model or self.model, hidden, CHUNK)):
            out.append(token_kl(self.reference_logp[index * CHUNK : index * CHUNK + len(logits)], logits).double())
        return torch.cat(out)

    @torch.inference_mode()
    def model_kl(self, candidate: nn.Module) -> torch.Tensor:
        """Per-position KL of another model of the same vocabulary, run whole with its own head (a
        rotated model's hidden states are in another basis)."""
        last = candidate.base_model(input_ids=self.input_ids).last_hidden_state
        return self.kl(last.reshape(-1, last.shape[-1]), candidate)

    def kl_from(self, start: int = 0, hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Per-position KL of the model as it now is, run from layer `start`, and the layer inputs."""
        inputs, last = self.run(start, hidden)
        return self.kl(last), inputs

    def mean_kl(self, start: int = 0, hidden: torch.Tensor | None = None) -> tuple[float, list[torch.Tensor]]:
        values, inputs = self.kl_from(start, hidden)
        return float(values.mean()), inputs
