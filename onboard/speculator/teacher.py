"""Teacher-forced training text: sequences the target did not generate, labelled by the target itself.

The capture stores the target's final normed hidden state at every position, and training turns
it into the target's next-token distribution with the lm_head, so any text can be distilled from
without generating anything: standard-library source (every position trained on), and existing
answers of DATA files (gsm8k, alpaca / self-instruct, chat), rendered through the chat template
with the prompt as the user turn and the answer as the assistant turn, only the answer trained on.
For a target larger than memory (nothing generated), the traffic prompts themselves too
(`traffic_sequences`): the responses the records carry where they have them, else the prompts.
"""

from itertools import zip_longest
from pathlib import Path

from onboard.data.answers import answered_records
from onboard.data.record import Record
from onboard.data.render import encode, tokenize_records
from onboard.data.stdlib_code import stdlib_code_records
from onboard.errors import OnboardError
from onboard.hashing import fingerprint
from onboard.speculator.data import TrainingSequence


def teacher_forced_code(tokenizer, num_files: int, max_tokens: int) -> list[TrainingSequence]:
    """Standard-library source as plain text, every position trained on."""
    if num_files == 0:
        return []
    records: list[Record] = stdlib_code_records("calib", num_files)
    ids = tokenize_records(records, tokenizer, chat=False, max_length=max_tokens)
    return [TrainingSequence(t, 1, "code") for t in ids if len(t) > 8]


def resolve_data_files(paths: list[str], setting: str = "speculator.teacher_forced_data") -> list[Path]:
    """The files as absolute paths (relative ones against the current directory); a missing one is
    a one-line OnboardError naming the setting."""
    resolved = []
    for text in paths:
        path = Path(text).expanduser().resolve()
        if not path.exists():
            raise OnboardError(f"{setting}: {text}: no such file or directory (relative paths start at {Path.cwd()})")
        resolved.append(path)
    return resolved


def data_files_key(paths: list[Path]) -> list[list[str]]:
    """What the captured data depends on: each file's path and content fingerprint."""
    return [[str(path), fingerprint(path)] for path in paths]


def answer_sequence(record: Record, tokenizer, max_prompt_tokens: int, max_tokens: int) -> TrainingSequence | None:
    """A conversation ending in an answer as one sequence: the rendered prompt (generation prompt
    included) is context, the answer's tokens through its end-of-turn token are trained on. None
    when the prompt is over `max_prompt_tokens` or less than two answer tokens fit `max_tokens`."""
    messages = record.messages or ()
    context = Record(record.traffic, record.source, messages=messages[:-1])
    prompt = encode(context, tokenizer, chat=True, generation_prompt=True)
    full = encode(record, tokenizer, chat=True, generation_prompt=False)
    if len(prompt) > max_prompt_tokens:
        return None
    start = 0  # where the two renderings part: the answer's first token (the template's prefix property)
    while start < min(len(prompt), len(full)) and prompt[start] == full[start]:
        start += 1
    eos = tokenizer.eos_token_id
    end = next((i + 1 for i in range(start, len(full)) if full[i] == eos), len(full))  # not the template's tail
    ids = full[: min(end, max_tokens)]
    if len(ids) - start < 2:
        return None
    return TrainingSequence(ids, start, record.traffic)


def teacher_forced_answers(
    tokenizer, paths: list[Path], limit: int, max_prompt_tokens: int, max_tokens: int
) -> list[TrainingSequence]:
    """Up to `limit` answered sequences from the files, one file's next row in turn (a cap still
    mixes every source); rows whose prompt is too long are skipped."""
    per_file = [answered_records(path) for path in paths]
    out: list[TrainingSequence] = []
    for batch in zip_longest(*per_file):
        for record in batch:
            if record is None or len(out) >= limit:
                continue
            seq = answer_sequence(record, tokenizer, max_prompt_tokens, max_tokens)
            if seq is not None:
                out.append(seq)
        if len(out) >= limit:
            break
    return out


def traffic_sequences(
    records: list[Record], tokenizer, limit: int, max_prompt_tokens: int, max_tokens: int
) -> list[TrainingSequence]:
    """Up to `limit` traffic records teacher-forced, in order: a conversation with an assistant
    turn through its last one, that response trained on (`answer_sequence`); any other record its
    prompt as the target receives it (chat template, assistant turn opened), every position
    trained on. Prompts over `max_prompt_tokens` are skipped, as `training_prompts` skips them."""
    out: list[TrainingSequence] = []
    for record in records:
        if len(out) >= limit:
            break
        messages = record.messages or ()
        last = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=None)
        if last:  # an assistant turn after something to answer
            answered = Record(record.traffic, record.source, messages=messages[: last + 1])
            seq = answer_sequence(answered, tokenizer, max_prompt_tokens, max_tokens)
        else:
            ids = encode(record, tokenizer, chat=True, generation_prompt=True)
            fits = 2 < len(ids) <= max_prompt_tokens
            seq = TrainingSequence(ids[:max_tokens], 1, record.traffic) if fits else None
        if seq is not None:
            out.append(seq)
    return out
