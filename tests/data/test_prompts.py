"""`chat_prompts`: records as the prompts a model answers, with each policy for the ones that do
not fit, on the tiny tokenizer (ChatML template), a copy without a template, and one whose
encoder adds a BOS that its template also writes."""

import pytest
import transformers
from tiny_models import BOS_TOKEN_ID, CHAT_TEMPLATE, EOS_TOKEN, PAD_TOKEN, build_tokenizer
from tokenizers import Tokenizer, processors

from onboard.data import ChatPrompt, Message, Record, chat_prompts
from onboard.errors import OnboardError

HEADER = "<|im_start|>assistant\n"
SHORT = Record(traffic="math", source="math.jsonl:1", text="What is two plus two?")
LONG = Record(traffic="code", source="code.jsonl:7", text="def add(a, b): return a + b\n" * 20)
TALK = Record(
    traffic="chat",
    source="chat.jsonl:3",
    messages=(
        Message("system", "Be brief."),
        Message("user", "Hi"),
        Message("assistant", "Hello"),
        Message("user", "Why?"),
    ),
)
ANSWERED = Record(
    traffic="chat", source="chat.jsonl:4", messages=(Message("user", "Hi"), Message("assistant", "Hello"))
)


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> transformers.PreTrainedTokenizerFast:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def plain_tokenizer(chat_tokenizer: transformers.PreTrainedTokenizerFast) -> transformers.PreTrainedTokenizerFast:
    return _with(chat_tokenizer.backend_tokenizer, chat_template=None)


@pytest.fixture(scope="module")
def bos_tokenizer(chat_tokenizer: transformers.PreTrainedTokenizerFast) -> transformers.PreTrainedTokenizerFast:
    """Llama-style: `encode` adds a BOS, and the template writes `bos_token` itself."""
    backend = Tokenizer.from_str(chat_tokenizer.backend_tokenizer.to_str())
    backend.add_special_tokens(["<s>"])
    bos = backend.token_to_id("<s>")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    return _with(backend, chat_template="{{- bos_token -}}" + CHAT_TEMPLATE, bos_token="<s>")


def _with(backend: Tokenizer, **kwargs) -> transformers.PreTrainedTokenizerFast:
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, **kwargs
    )


def _length(record: Record, tokenizer) -> int:
    return len(chat_prompts([record], tokenizer, max_tokens=100_000)[0].token_ids)


def test_prompts_open_the_assistant_turn_and_keep_traffic_and_text(chat_tokenizer) -> None:
    prompts = chat_prompts([SHORT, TALK], chat_tokenizer, max_tokens=1000)
    assert all(isinstance(p, ChatPrompt) for p in prompts)
    assert [(p.traffic, p.text, p.source) for p in prompts] == [
        ("math", "What is two plus two?", "math.jsonl:1"),
        ("chat", "Why?", "chat.jsonl:3"),
    ]
    assert chat_tokenizer.decode(prompts[0].token_ids) == f"<|im_start|>user\nWhat is two plus two?<|im_end|>\n{HEADER}"
    text = chat_tokenizer.decode(prompts[1].token_ids)
    assert text.startswith("<|im_start|>system\nBe brief.") and text.endswith(f"Why?<|im_end|>\n{HEADER}")


def test_a_conversation_ending_in_an_answer_is_prompted_up_to_it(chat_tokenizer) -> None:
    (prompt,) = chat_prompts([ANSWERED], chat_tokenizer, max_tokens=1000)
    assert chat_tokenizer.decode(prompt.token_ids) == f"<|im_start|>user\nHi<|im_end|>\n{HEADER}"
    assert prompt.text == "Hi"
    only_answers = Record(traffic="chat", source="x", messages=(Message("assistant", "Hello"),))
    assert [p.source for p in chat_prompts([only_answers, SHORT], chat_tokenizer, max_tokens=1000)] == [SHORT.source]


def test_skip_drops_prompts_over_the_limit(chat_tokenizer) -> None:
    limit = _length(SHORT, chat_tokenizer)
    assert _length(LONG, chat_tokenizer) > limit
    prompts = chat_prompts([LONG, SHORT, LONG], chat_tokenizer, max_tokens=limit, fit="skip")
    assert [p.source for p in prompts] == [SHORT.source]
    assert len(prompts[0].token_ids) == limit  # exactly at the limit fits


def test_truncate_keeps_the_tail_with_the_assistant_header(chat_tokenizer) -> None:
    whole = chat_prompts([LONG], chat_tokenizer, max_tokens=100_000)[0].token_ids
    (prompt,) = chat_prompts([LONG], chat_tokenizer, max_tokens=20, fit="truncate")
    assert prompt.token_ids == whole[-20:]
    assert chat_tokenizer.decode(prompt.token_ids).endswith(f"<|im_end|>\n{HEADER}")
    assert prompt.text == LONG.text and prompt.traffic == "code"


def test_error_names_the_record_on_one_line(chat_tokenizer) -> None:
    limit = _length(SHORT, chat_tokenizer)
    assert len(chat_prompts([SHORT], chat_tokenizer, max_tokens=limit, fit="error")) == 1
    with pytest.raises(OnboardError, match=r"^code\.jsonl:7: the prompt is \d+ tokens, over the limit of") as err:
        chat_prompts([SHORT, LONG], chat_tokenizer, max_tokens=limit, fit="error")
    assert "\n" not in str(err.value)


def test_limit_stops_early_and_none_left_is_an_error(chat_tokenizer) -> None:
    records = [Record(traffic="math", source=f"q{i}", text=f"question {i}") for i in range(5)]
    assert [p.source for p in chat_prompts(records, chat_tokenizer, max_tokens=100, limit=2)] == ["q0", "q1"]
    assert chat_prompts(records, chat_tokenizer, max_tokens=100, limit=0) == []
    with pytest.raises(OnboardError, match="no usable prompt in 2 records, 2 of them over 5 tokens"):
        chat_prompts([LONG, SHORT], chat_tokenizer, max_tokens=5)
    with pytest.raises(OnboardError, match="no usable prompt in 0 records"):
        chat_prompts([], chat_tokenizer, max_tokens=5)


def test_bad_arguments(chat_tokenizer) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        chat_prompts([SHORT], chat_tokenizer, max_tokens=0)
    with pytest.raises(ValueError, match="fit must be one of skip, truncate, error"):
        chat_prompts([SHORT], chat_tokenizer, max_tokens=10, fit="cut")  # type: ignore[arg-type]


def test_without_a_template_the_plain_text_is_the_prompt(plain_tokenizer) -> None:
    prompts = chat_prompts([SHORT, ANSWERED], plain_tokenizer, max_tokens=1000)
    assert prompts[0].token_ids == plain_tokenizer.encode("What is two plus two?")
    assert prompts[1].token_ids == plain_tokenizer.encode("Hi")  # the answer is left to the model
    assert [p.traffic for p in prompts] == ["math", "chat"]


def test_a_template_that_writes_the_bos_gets_one(bos_tokenizer) -> None:
    bos = bos_tokenizer.bos_token_id
    assert bos_tokenizer.encode("Hi")[0] == bos  # the encoder adds one ...
    rendered = bos_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert bos_tokenizer.encode(rendered).count(bos) == 2  # ... so encoding the template naively doubles it
    (prompt,) = chat_prompts([SHORT], bos_tokenizer, max_tokens=1000)
    assert prompt.token_ids[0] == bos and prompt.token_ids.count(bos) == 1
    assert prompt.token_ids.count(BOS_TOKEN_ID) == 2  # <|im_start|> of the user and the assistant turn
    plain = _with(bos_tokenizer.backend_tokenizer, chat_template=None, bos_token="<s>")
    (prompt,) = chat_prompts([SHORT], plain, max_tokens=1000)
    assert prompt.token_ids == plain.encode(SHORT.text) and prompt.token_ids.count(bos) == 1
