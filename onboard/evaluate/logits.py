"""Next-token logits in float32, a chunk of positions at a time."""

from collections.abc import Iterator

import torch
from transformers import PreTrainedModel


def head_chunks(model: PreTrainedModel, hidden: torch.Tensor, chunk: int) -> Iterator[torch.Tensor]:
    """float32 logits [<=chunk, vocab] from final hidden states [positions, d], a chunk at a time.

    The output projection runs in float32, because bf16 logits carry rounding noise of the same
    order as small KLs.
    """
    head = model.get_output_embeddings()
    weight = head.weight.float()
    bias = head.bias.float() if getattr(head, "bias", None) is not None else None
    softcap = getattr(model.config, "final_logit_softcapping", None)
    quantized_head = hasattr(head, "quantization_scheme")  # emulated activations: call it
    for start in range(0, hidden.shape[0], chunk):
        part = hidden[start : start + chunk]
        logits = head(part).float() if quantized_head else part.float() @ weight.T
        if bias is not None:
            logits = logits + bias
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        yield logits


@torch.inference_mode()
def logit_chunks(model: PreTrainedModel, input_ids: torch.Tensor, chunk: int) -> Iterator[torch.Tensor]:
    """float32 logits [<=chunk, vocab] for the positions of a single sequence [1, T]; the decoder
    runs once in its own dtype."""
    yield from head_chunks(model, model.base_model(input_ids=input_ids).last_hidden_state[0], chunk)
