"""transformers as the reference the engine tests compare against."""

import tiny_models
import torch

TOP = 5


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[list[int]]]:
    """transformers' greedy continuation (no EOS stop) and its top-5 token ids per step."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        pad_token_id=tiny_models.PAD_TOKEN_ID,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, [step[0].float().topk(TOP).indices.tolist() for step in out.logits]
