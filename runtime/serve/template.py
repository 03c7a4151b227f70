"""A checkpoint's Jinja chat template, rendered as transformers' apply_chat_template renders it.

The template comes with the weights (tokenizer_config.json's `chat_template`, or chat_template.jinja:
core/tokenizer.py) and is untrusted: it runs only in jinja2's ImmutableSandboxedEnvironment (no
attribute access to Python internals, no mutation of the data it is given), with the environment
transformers gives it, so that every template written for transformers renders the same text here:

  trim_blocks, lstrip_blocks, the loopcontrols extension and the `{% generation %}` block (rendered
  as its body), the globals raise_exception(msg), strftime_now(fmt), dict(...), namespace(...) (no
  underscore-prefixed names), the filter tojson(x, ensure_ascii=False, indent, separators, sort_keys),
  and the variables messages, add_generation_prompt, tools (None), bos_token, eos_token.

Nothing else of a checkpoint is executed (no tokenizer remote code).  jinja2 >= 3.1.6: older
versions have known sandbox escapes.
"""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateFailed(Exception):
    """The template raised (raise_exception, an undefined value, a sandbox violation, a type error)."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant spans with it; the text is the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace() without underscore-prefixed names (no way to reach CPython internals)."""

    def __init__(*args, **kwargs):  # jinja's own signature trick: namespace(self=...) stays legal
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace cannot hold the underscore-prefixed name {name!r}")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes HTML characters; a prompt wants the JSON itself
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _dict(*args, **kwargs) -> dict:
    return dict(*args, **kwargs)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str | None, eos_token: str | None):
        """Compile once; a template that does not parse is a ValueError naming the line."""
        if tuple(int(x) for x in jinja2.__version__.split(".")[:3]) < (3, 1, 6):
            raise ValueError(f"chat templates need jinja2 >= 3.1.6 (sandbox fixes), found {jinja2.__version__}")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                           dict=_dict, namespace=_Namespace)
        try:
            self.template = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ValueError(f"the checkpoint's chat template does not compile: {exc.message} (line {exc.lineno})") \
                from None
        self.specials = {"bos_token": bos_token or "", "eos_token": eos_token or ""}

    def render(self, messages: list[dict]) -> str:
        """messages (plain JSON data) -> the prompt text, ending with the assistant's header
        (add_generation_prompt=True); TemplateFailed with the template's own message."""
        try:
            return self.template.render(messages=messages, tools=None, add_generation_prompt=True, **self.specials)
        except Exception as exc:  # noqa: BLE001 - anything the untrusted template raises is the request's failure
            own = type(exc) is jinja2.TemplateError  # raise_exception(message): the template's own words
            raise TemplateFailed(str(exc) if own else f"{type(exc).__name__}: {exc}") from None
