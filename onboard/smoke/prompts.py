"""The smoke prompts: what both sides answer, in-process or through endpoints."""

from pathlib import Path

from onboard.data import ChatPrompt, builtin_records, chat_prompts, load_records
from onboard.recipes import Smoke

MAX_PROMPT_TOKENS = 1024


def smoke_prompts(tokenizer, config: Smoke, data: Path | None) -> list[ChatPrompt]:
    """`num_prompts` chat prompts: DATA's, or the built-in sets (eval split first, every traffic
    type interleaved). Prompts longer than MAX_PROMPT_TOKENS are skipped, not cut: a cut chat
    prompt loses its assistant header and the model would continue the user's text."""
    records = (
        load_records(data)
        if data
        else builtin_records("eval", stdlib_files=0) + builtin_records("calib", stdlib_files=0)
    )
    return chat_prompts(records, tokenizer, max_tokens=MAX_PROMPT_TOKENS, fit="skip", limit=config.num_prompts)
