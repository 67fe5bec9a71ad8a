"""Stop conditions: EOS, stop tokens, stop strings spanning tokens, max_tokens, stream holdback."""

from pathlib import Path

import tiny_models

from onboard.engine.sampler import SamplingParams
from onboard.engine.stop import check_stop, stop_holdback


def test_stop_strings_spanning_tokens(tmp_path: Path) -> None:
    tokenizer = tiny_models.build_tokenizer(tmp_path)
    ids = tokenizer.encode("The weather today is cloudy with a chance of rain.")
    params = SamplingParams(stop=["zzz", "cloudy with"], max_tokens=100)
    text, reason, cut, offset = "", None, None, 0
    for n, token in enumerate(ids, start=1):
        offset = len(text)
        text = tokenizer.decode(ids[:n])  # incremental detokenization, as the engine does it
        reason, cut = check_stop(text, offset, params, token, {tokenizer.eos_token_id}, n)
        if reason:
            break
    assert reason == "stop"
    assert text[:cut] == "The weather today is "
    assert cut < offset  # the stop string began in text decoded on an earlier step
    assert stop_holdback(params) == len("cloudy with") - 1
    assert stop_holdback(SamplingParams()) == 0


def test_check_stop_reasons() -> None:
    p = SamplingParams(max_tokens=3, stop_token_ids=[9], stop=["END"])
    eos = {2}
    assert check_stop("ab", 1, p, 5, eos, 1) == (None, None)
    assert check_stop("ab", 1, p, 2, eos, 1) == ("stop", None)
    assert check_stop("ab", 1, SamplingParams(ignore_eos=True), 2, eos, 1) == (None, None)
    assert check_stop("ab", 1, p, 9, eos, 1) == ("stop", None)
    assert check_stop("abc", 2, p, 5, eos, 3) == ("length", None)
    assert check_stop("xxEN", 3, p, 5, eos, 2) == (None, None)
    assert check_stop("xxEND and more", 4, p, 5, eos, 3) == ("stop", 2)  # stop wins over length
    # A stop string wholly inside older text was handled on an earlier step; only new text counts.
    assert check_stop("END xx", 4, p, 5, eos, 2) == (None, None)
    # The earliest of several matches is cut.
    both = SamplingParams(stop=["b", "ab"])
    assert check_stop("xab", 1, both, 5, eos, 1) == ("stop", 1)
