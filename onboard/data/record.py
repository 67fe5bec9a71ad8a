"""One unit of input text: a plain document or a chat conversation."""

import hashlib
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class Record:
    """Exactly one of `text` and `messages` is set.

    `traffic` names the kind of request the record stands for ("chat", "code", "math",
    "summarization", "structured", or "text" when unknown); `source` says where it came from,
    e.g. "file.jsonl:12", "json:key" or a relative path.
    """

    traffic: str
    source: str
    text: str | None = None
    messages: tuple[Message, ...] | None = None

    def __post_init__(self) -> None:
        if (self.text is None) == (self.messages is None):
            raise ValueError("a Record needs exactly one of text and messages")
        if self.messages is not None:
            if not self.messages:
                raise ValueError("a Record's messages must not be empty")
            # Accept any sequence of Message or (role, content) pairs, but store a tuple of
            # Message so the record stays hashable.
            messages = tuple(m if isinstance(m, Message) else Message(*m) for m in self.messages)
            object.__setattr__(self, "messages", messages)

    @property
    def uid(self) -> str:
        """First 16 hex digits of a sha256 over the content alone: the same text read from
        two places has the same uid, and a text never equals a conversation."""
        if self.messages is not None:
            content: list[object] = ["messages", [[m.role, m.content] for m in self.messages]]
        else:
            content = ["text", self.text]
        encoded = json.dumps(content, ensure_ascii=False, separators=(",", ":"))
        return hashlib.sha256(encoded.encode("utf-8")).hexdigest()[:16]
