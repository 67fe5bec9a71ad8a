"""The special tokens a tokenizer must agree on with its model: eos from the config, a pad token."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def fix_special_tokens(tokenizer: "PreTrainedTokenizerBase", model_config) -> "PreTrainedTokenizerBase":
    """Make eos agree with the model's config and give batching a pad token.

    transformers' GGUF tokenizer converter sets eos from the bos id (SmolLM2 comes out with
    eos = <|im_start|>) while the config keeps the file's eos id, the real end of turn.
    """
    eos_id = getattr(model_config, "eos_token_id", None)
    if isinstance(eos_id, list):
        eos_id = eos_id[0] if eos_id else None
    if isinstance(eos_id, int) and eos_id != tokenizer.eos_token_id and eos_id < len(tokenizer):
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_id)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
