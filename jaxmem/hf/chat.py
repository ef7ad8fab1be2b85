"""A Hugging Face tokenizer directory's chat template, rendered as ``transformers`` renders it
(pure: Jinja2 only; no JAX, no PyTorch, no ``transformers``).

``jaxmem prepare`` turns ``{"messages": [...]}`` records into text with the directory's template
and needs to know which characters are the assistant's (the loss counts only those).
``transformers``' ``apply_chat_template`` is the reference: the template is compiled in Jinja2's
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, a ``{% generation %}`` block tag, ``raise_exception``,
``strftime_now``, a ``tojson`` that does not escape HTML, and the tokenizer's named special tokens
(``bos_token``, ``eos_token``, ...) as variables. ``tests/test_instruct.py`` compares the text
and the assistant mask with ``transformers`` on a local tokenizer.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
from typing import Any

from jaxmem.config import ConfigError

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
# the named special tokens transformers passes to a template (its SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")


def _tokenizer_config(directory: str) -> dict[str, Any]:
    try:
        with open(os.path.join(directory, TOKENIZER_CONFIG), encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def chat_template(directory: str) -> str | None:
    """``directory``'s chat template: ``chat_template.jinja`` when it has one (as transformers
    prefers it), else ``chat_template`` in ``tokenizer_config.json`` (a string, or a list of
    ``{"name", "template"}`` of which the one named ``default``); None when it has neither."""
    path = os.path.join(directory, TEMPLATE_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    found = _tokenizer_config(directory).get("chat_template")
    if isinstance(found, list):
        named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
        found = named.get("default")
    return found if isinstance(found, str) and found else None


def special_tokens(directory: str) -> dict[str, str]:
    """The named special tokens of ``directory``'s ``tokenizer_config.json`` as strings (a token
    written as ``{"content": ...}`` too): what a template sees as ``bos_token`` and the rest."""
    raw = _tokenizer_config(directory)
    out = {}
    for name in SPECIAL_TOKENS:
        value = raw.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[name] = value
    return out


def has_generation_tags(template: str) -> bool:
    """The template marks the assistant's text with ``{% generation %}`` blocks."""
    return GENERATION_TAG.search(template) is not None


class ChatTemplate:
    """A compiled chat template: ``render`` gives the text and, with ``{% generation %}`` blocks,
    the character spans they produced."""

    def __init__(self, template: str, specials: dict[str, str], where: str = "the chat template"):
        try:
            import jinja2
            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise ConfigError(
                "chat templates need the jinja2 package, which is not installed: "
                "pip install 'jinja2>=3.1.6'"
            ) from None
        self._jinja = jinja2
        self.specials = dict(specials)
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_generation_extension(jinja2), jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception(jinja2)
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        env.globals["dict"] = dict
        try:
            self._template = env.from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(
                f"{where} is not valid Jinja2 ({e.message}, line {e.lineno} of the template); "
                "fix the template"
            ) from None
        self.generation_tags = has_generation_tags(template)

    def render(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False
    ) -> tuple[str, list[tuple[int, int]]]:
        """``(text, spans)``: the conversation rendered, and the ``[start, end)`` character spans
        of its ``{% generation %}`` blocks (empty without them).

        Raises:
            jinja2.TemplateError: the template refuses the conversation (``raise_exception``).
        """
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        env = self._template.environment
        with env.track_generation(blocks, spans):
            for block in self._template.generate(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.specials,
            ):
                blocks.append(block)
        return "".join(blocks), spans

    @property
    def errors(self) -> tuple[type[BaseException], ...]:
        """What rendering raises for a conversation the template refuses or cannot render."""
        return (self._jinja.TemplateError, TypeError, ValueError, KeyError, AttributeError)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' override: Jinja's own tojson escapes HTML characters
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(jinja2: Any):
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    return raise_exception


def _generation_extension(jinja2: Any) -> type:
    """A Jinja2 extension for ``{% generation %}...{% endgeneration %}``: the block renders its
    body and, while tracking, records the body's character span in the text rendered so far
    (transformers' ``AssistantTracker``, the same spans)."""
    from jinja2.ext import Extension

    class GenerationTracker(Extension):
        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            self._tracking: tuple[list[str], list[tuple[int, int]]] | None = None
            environment.extend(track_generation=self.track)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            call = self.call_method("_generation", [], [], None, None)
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _generation(self, caller):
            text = caller()
            if self._tracking is not None:
                blocks, spans = self._tracking
                start = len("".join(blocks))
                spans.append((start, start + len(text)))
            return text

        @contextlib.contextmanager
        def track(self, blocks, spans):
            self._tracking = (blocks, spans)
            try:
                yield
            finally:
                self._tracking = None

    return GenerationTracker
