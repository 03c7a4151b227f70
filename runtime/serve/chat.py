"""The chat template: OpenAI `messages` -> prompt ids in Kimi's layout.

Each turn is <|im_{role}|> role <|im_middle|> content <|im_end|>, and the prompt ends with the
assistant header <|im_assistant|> assistant <|im_middle|> (tool turns sit in the system marker, as
Kimi's tokenizer_config.json chat_template puts them).  The markers are the checkpoint's special
tokens (core/tokenizer.py); [system,] user is exactly `kdtree run --chat`'s Tokenizer.chat.
"""

from __future__ import annotations

from core.tokenizer import CHAT_MARKERS, Tokenizer
from runtime.serve.protocol import ApiError

MARKER = {"system": "<|im_system|>", "tool": "<|im_system|>", "user": "<|im_user|>",
          "assistant": "<|im_assistant|>"}


def content_text(msg: dict, i: int) -> str:
    """A message's content: a string, or a list of text parts (other parts are refused)."""
    c = msg.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list) and all(isinstance(p, dict) for p in c):
        kinds = {p.get("type") for p in c} - {"text"}
        if not kinds:
            return "".join(str(p.get("text", "")) for p in c)
        raise ApiError(400, f"messages[{i}].content: only text parts are supported, got {sorted(map(str, kinds))}",
                       "messages")
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")


def chat_ids(tok: Tokenizer, messages) -> list[int]:
    """OpenAI messages -> prompt ids ending with the assistant header."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    s = tok.specials
    missing = [m for m in CHAT_MARKERS if m not in s]
    if missing:
        raise ApiError(400, f"this model's tokenizer lacks the chat markers {missing}: use /v1/completions",
                       "messages")
    ids: list[int] = []
    for i, msg in enumerate(messages):
        role = msg.get("role") if isinstance(msg, dict) else None
        if role == "developer":
            role = "system"
        if role not in MARKER:
            raise ApiError(400, f"messages[{i}].role must be system, user, assistant or tool, got {role!r}",
                           "messages")
        ids += [s[MARKER[role]], *tok.encode(role), s["<|im_middle|>"], *tok.encode(content_text(msg, i)),
                s["<|im_end|>"]]
    return ids + [s["<|im_assistant|>"], *tok.encode("assistant"), s["<|im_middle|>"]]
