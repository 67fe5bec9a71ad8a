"""What every MTP draft shares (`mtp_draft.MtpDraft` over transformers' layers, Qwen's module in
`qwen_mtp_draft.py`, GLM-5.3-Flash's layer in `glm_mtp_draft.py`): the layers under `mtp`, the
target's final-normed state as their input (aux layer N), a transformers cache, no projection of
that state, and training-time test unless a layout needs another unroll."""

import torch
from transformers import DynamicCache

from onboard.speculator.draft import ttt_unroll


class MtpDraftBase(torch.nn.Module):
    def __init__(self, mtp, num_hidden_layers: int):
        super().__init__()
        self.mtp = mtp
        self.layer_config = mtp.config
        self.aux_layer_ids = [num_hidden_layers]  # transformers' hidden_states[N]: the final-normed state
        self.register_buffer("t2d", torch.ones(mtp.config.vocab_size, dtype=torch.bool))

    @property
    def num_layers(self) -> int:
        return len(self.mtp.layers)

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.mtp.config)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        return aux

    def unroll(self, aux: torch.Tensor, input_ids: torch.Tensor, valid: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test (`draft.ttt_unroll`): step s chains the layer as serving does."""
        return ttt_unroll(self, aux, input_ids, valid, steps)
