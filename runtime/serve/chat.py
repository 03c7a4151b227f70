"""Chat prompts: OpenAI `messages` -> prompt ids, by the checkpoint's chat template or Kimi's markers.

With a template (the tokenizer's chat_template: tokenizer_config.json or chat_template.jinja, which
`kdtree build` carries into the artifact's tokenizer/): the messages are rendered by it in a sandbox
(runtime/serve/template.py, add_generation_prompt=True) and the text is encoded with its special-token
strings read as special tokens, as transformers' apply_chat_template(tokenize=True) does.  A template
that fails on the messages (its raise_exception, an undefined value) is a 400 with its message.

Without one: Kimi's layout.  Each turn is <|im_{role}|> role <|im_middle|> content <|im_end|>, and the
prompt ends with the assistant header <|im_assistant|> assistant <|im_middle|> (tool turns sit in the
system marker, as Kimi's chat_template puts them); [system,] user is exactly `kdtree run --chat`'s
Tokenizer.chat, and special-token strings inside the content stay text.

Either way a message is a dict with a string role (developer is taken as system) and a content that is
a string, a list of text parts, or absent; other content parts are refused.
"""

from __future__ import annotations

from core.tokenizer import CHAT_MARKERS, Tokenizer
from runtime.serve.protocol import ApiError
from runtime.serve.template import ChatTemplate, TemplateFailed

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


class ChatPrompt:
    def __init__(self, tok: Tokenizer):
        """Compiles the tokenizer's chat template, if it has one (a ValueError when it does not parse)."""
        self.tok = tok
        self.template = ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token) \
            if tok.chat_template is not None else None

    def ids(self, messages) -> list[int]:
        """OpenAI messages -> prompt ids ending with the assistant header; ApiError 400 naming what is wrong."""
        msgs = _checked(messages)
        if self.template is None:
            return self._kimi(msgs)
        try:
            text = self.template.render(msgs)
        except TemplateFailed as exc:
            raise ApiError(400, f"the model's chat template failed on these messages: {exc}", "messages") from None
        return self.tok.encode(text, allowed_special=True)

    def _kimi(self, msgs: list[dict]) -> list[int]:
        tok, s = self.tok, self.tok.specials
        missing = [m for m in CHAT_MARKERS if m not in s]
        if missing:
            raise ApiError(400, f"this model has no chat template and its tokenizer lacks the chat markers {missing}: "
                                f"use /v1/completions", "messages")
        ids: list[int] = []
        for i, msg in enumerate(msgs):
            role = msg["role"]
            if role not in MARKER:
                raise ApiError(400, f"messages[{i}].role must be system, user, assistant or tool, got {role!r}",
                               "messages")
            ids += [s[MARKER[role]], *tok.encode(role), s["<|im_middle|>"], *tok.encode(content_text(msg, i)),
                    s["<|im_end|>"]]
        return ids + [s["<|im_assistant|>"], *tok.encode("assistant"), s["<|im_middle|>"]]


def _checked(messages) -> list[dict]:
    """The messages as the template sees them: keys whose value is null dropped (as transformers does),
    developer -> system; content checked (string or text parts)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    out = []
    for i, msg in enumerate(messages):
        role = msg.get("role") if isinstance(msg, dict) else None
        if not isinstance(role, str):
            raise ApiError(400, f"messages[{i}] must be an object with a string role", "messages")
        content_text(msg, i)
        out.append({k: v for k, v in msg.items() if v is not None} | {"role": "system" if role == "developer"
                                                                       else role})
    return out
