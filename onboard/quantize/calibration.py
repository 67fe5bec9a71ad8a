"""Calibration samples: real text, templated as the model will be prompted, packed to length."""

from pathlib import Path

from datasets import Dataset

from onboard.data import builtin_records, interleave, load_records, pack_tokens, tokens_by_traffic
from onboard.recipes import Calibration


def calibration_dataset(tokenizer, settings: Calibration, data: Path | None) -> Dataset:
    """`num_samples` windows of `max_seq_length` tokens, in a fixed order.

    Prompts are chat-templated when the tokenizer has a template (that is how a chat model
    sees them when served), shared fairly between traffic types, interleaved and packed, so
    that each sample is full length and mixes traffic.
    """
    records = load_records(data) if data else builtin_records("calib", settings.traffic)
    total = settings.num_samples * settings.max_seq_length
    groups = tokens_by_traffic(records, tokenizer, chat=True, max_tokens=total, max_length=settings.max_seq_length)
    windows = pack_tokens(
        interleave(groups), window=settings.max_seq_length, max_tokens=total, separator=tokenizer.eos_token_id
    )
    return Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * len(w) for w in windows]})
