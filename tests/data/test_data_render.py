"""`render`, `tokenize_records` and `pack_tokens`, with a tokenizer built in place."""

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from onboard.data import Message, Record, pack_tokens, render, tokenize_records
from onboard.errors import OnboardError

CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b",
    "What is two plus two? Two plus two is four.",
    "Summarize the following text in one sentence.",
]


@pytest.fixture(scope="module")
def plain_tokenizer() -> transformers.PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")


@pytest.fixture(scope="module")
def chat_tokenizer(
    plain_tokenizer: transformers.PreTrainedTokenizerFast,
) -> transformers.PreTrainedTokenizerFast:
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=plain_tokenizer.backend_tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHATML
    return tokenizer


TEXT = Record(traffic="math", source="t", text="What is two plus two?")
CHAT = Record(
    traffic="chat",
    source="c",
    messages=(Message("user", "Hi"), Message("assistant", "Hello")),
)
ASKING = Record(
    traffic="chat",
    source="c2",
    messages=(Message("system", "Be brief."), Message("user", "Sum it up")),
)


def test_plain_rendering(chat_tokenizer: transformers.PreTrainedTokenizerFast) -> None:
    assert render(TEXT, chat_tokenizer, chat=False) == "What is two plus two?"
    assert render(CHAT, chat_tokenizer, chat=False) == "Hi\n\nHello"


def test_chat_without_a_template_falls_back_to_plain(
    plain_tokenizer: transformers.PreTrainedTokenizerFast,
) -> None:
    assert not plain_tokenizer.chat_template
    assert render(CHAT, plain_tokenizer, chat=True) == "Hi\n\nHello"


def test_chat_template(chat_tokenizer: transformers.PreTrainedTokenizerFast) -> None:
    # a text record is one user turn, so the assistant turn is opened after it
    assert render(TEXT, chat_tokenizer, chat=True) == (
        "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\n"
    )
    # ending on the assistant: no generation prompt
    assert render(CHAT, chat_tokenizer, chat=True) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
    )
    assert render(ASKING, chat_tokenizer, chat=True).endswith("Sum it up<|im_end|>\n<|im_start|>assistant\n")


def test_template_errors_name_the_record(
    chat_tokenizer: transformers.PreTrainedTokenizerFast,
) -> None:
    strict = transformers.PreTrainedTokenizerFast(tokenizer_object=chat_tokenizer.backend_tokenizer)
    strict.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(OnboardError, match="c2: the chat template rejected it"):
        render(ASKING, strict, chat=True)


def test_tokenize_records(chat_tokenizer: transformers.PreTrainedTokenizerFast) -> None:
    empty = Record(traffic="text", source="e", text=" ")
    plain = tokenize_records([TEXT, CHAT, empty], chat_tokenizer, chat=False, max_length=1000)
    assert plain[0] == chat_tokenizer.encode("What is two plus two?")
    assert plain[1] == chat_tokenizer.encode("Hi\n\nHello")
    assert len(plain) == 3  # " " is one token

    chat = tokenize_records([TEXT], chat_tokenizer, chat=True, max_length=1000)
    im_start = chat_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert chat[0][0] == im_start and chat[0].count(im_start) == 2

    short = tokenize_records([TEXT, CHAT], chat_tokenizer, chat=True, max_length=3)
    assert [len(ids) for ids in short] == [3, 3]
    with pytest.raises(ValueError):
        tokenize_records([TEXT], chat_tokenizer, chat=False, max_length=0)


def test_tokenize_drops_empty_results() -> None:
    class Silent:
        chat_template = None

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [] if text == "drop" else [len(text)]

    records = [Record(traffic="text", source=s, text=s) for s in ("keep", "drop", "kept")]
    assert tokenize_records(records, Silent(), chat=True, max_length=5) == [[4], [4]]


def test_pack_tokens_windows() -> None:
    docs = [[1, 2, 3], [4, 5], [], [6, 7, 8, 9]]
    # the one-token tail [9] predicts nothing and is dropped
    assert pack_tokens(docs, window=4, max_tokens=100) == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert pack_tokens(docs, window=4, max_tokens=100, separator=0) == [
        [1, 2, 3, 0],
        [4, 5, 0, 6],
        [7, 8, 9],
    ]
    # stops once max_tokens are taken; the short tail is kept when it has 2 tokens
    assert pack_tokens(docs, window=4, max_tokens=6) == [[1, 2, 3, 4], [5, 6]]
    assert pack_tokens(docs, window=4, max_tokens=5) == [[1, 2, 3, 4]]
    assert pack_tokens([], window=4, max_tokens=10) == []
    total = sum(len(w) for w in pack_tokens([list(range(1000))], window=64, max_tokens=300))
    assert total == 300


def test_pack_tokens_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        pack_tokens([[1, 2]], window=1, max_tokens=10)
    with pytest.raises(ValueError):
        pack_tokens([[1, 2]], window=2, max_tokens=0)
