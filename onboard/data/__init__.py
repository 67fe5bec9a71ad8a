"""DATA inputs: user files and the built-in traffic sets, read into Records and rendered
into token windows or the chat prompts a model answers."""

from onboard.data.builtin import TRAFFIC_TYPES, builtin_records
from onboard.data.holdout import Split, split_of
from onboard.data.load import existing_data, load_records
from onboard.data.mix import interleave, tokens_by_traffic
from onboard.data.prompts import FIT_POLICIES, ChatPrompt, Fit, chat_prompts
from onboard.data.record import Message, Record
from onboard.data.render import pack_tokens, render, tokenize_records
from onboard.data.stdlib_code import stdlib_code_records

__all__ = [
    "FIT_POLICIES",
    "TRAFFIC_TYPES",
    "ChatPrompt",
    "Fit",
    "Message",
    "Record",
    "Split",
    "builtin_records",
    "chat_prompts",
    "existing_data",
    "interleave",
    "load_records",
    "pack_tokens",
    "render",
    "split_of",
    "stdlib_code_records",
    "tokenize_records",
    "tokens_by_traffic",
]
