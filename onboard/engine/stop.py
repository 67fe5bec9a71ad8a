"""When a request is finished: EOS, stop tokens, stop strings (vLLM's semantics), max_tokens."""

from collections.abc import Sequence

from onboard.engine.sampler import SamplingParams


def check_stop(
    text: str,
    new_text_offset: int,
    params: SamplingParams,
    last_token: int,
    eos_ids: set[int],
    num_output_tokens: int,
) -> tuple[str | None, int | None]:
    """Whether a sequence is finished after its latest token.

    `text` is the whole decoded output so far; `text[new_text_offset:]` came from the latest step.
    Returns (finish reason, cut): ("stop", None) for EOS or a stop token, ("stop", i) for a stop
    string (the visible output is `text[:i]`, the stop string excluded), ("length", None) at
    `max_tokens`, else (None, None). A stop wins over the length cap on the same step.
    """
    if not params.ignore_eos and last_token in eos_ids:
        return "stop", None
    if last_token in params.stop_token_ids:
        return "stop", None
    cut = find_stop_string(text, new_text_offset, params.stop)
    if cut is not None:
        return "stop", cut
    if num_output_tokens >= params.max_tokens:
        return "length", None
    return None, None


def find_stop_string(text: str, new_text_offset: int, stop: Sequence[str]) -> int | None:
    """Start of the earliest stop string that ends inside the new text (it may start before it)."""
    found = None
    for s in stop:
        i = text.find(s, max(0, new_text_offset - len(s) + 1))
        if i != -1 and (found is None or i < found):
            found = i
    return found


def stop_holdback(params: SamplingParams) -> int:
    """Characters at the end of the text a stream must hold back: they may begin a stop string."""
    return max((len(s) for s in params.stop), default=1) - 1
