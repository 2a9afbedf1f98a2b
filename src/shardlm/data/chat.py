"""Chat templates and special tokens, read and rendered exactly as ``transformers`` does.

A tokenizer is a ``tokenizer.json`` plus, beside it, the files ``transformers`` reads with it:
``tokenizer_config.json`` (special tokens ``bos_token``/``eos_token``/``pad_token``/``unk_token``,
``chat_template``, ``model_max_length``) and ``chat_template.jinja`` (a template in its own file,
which wins over the one in ``tokenizer_config.json``, as in ``transformers``).

:class:`ChatTemplate` renders a conversation (``[{"role", "content"}, ...]``) with the variables
``transformers``' ``apply_chat_template`` gives a template: ``messages``, ``add_generation_prompt``,
``tools``/``documents`` (None) and every special token of the tokenizer config (``bos_token``,
``eos_token``, ...), with ``raise_exception``, ``strftime_now``, a ``tojson`` that does not escape
HTML, ``loopcontrols`` and ``trim_blocks``/``lstrip_blocks``. When ``transformers`` is installed the
text is rendered and tokenized by ``transformers`` itself (a ``PreTrainedTokenizerFast`` built from
the same two files, ``apply_chat_template(tokenize=False)`` then ``add_special_tokens=False``);
otherwise by an equivalent sandboxed ``jinja2`` environment and the ``tokenizers`` library.

The whole rendered text is tokenized at once (so ids equal ``apply_chat_template``'s); the response
mask marks each token that overlaps the text an assistant turn adds after its generation prompt
(the reply and the template's end-of-turn marker), found by rendering growing prefixes of the chat.
"""

from __future__ import annotations

import bisect
import json
import os
import pathlib
import re
from datetime import datetime
from typing import Any

from shardlm.data.tokenizer import load_tokenizer
from shardlm.data.tokenizer_files import read_tokenizer_config
from shardlm.errors import DataError

__all__ = ["DEFAULT_CHAT_TEMPLATE", "ChatTemplate"]

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] }}"
    "{% if message['role'] == 'assistant' and eos_token is defined %}{{ eos_token }}{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)
"""Used when the tokenizer has no chat template: ``role: content`` lines, a reply ending with ``eos_token``.

The generation prompt is ``assistant:`` without the space, so the reply's first word keeps its
leading space inside one token (as the whole rendered chat tokenizes)."""

def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", str(text)).strip()


def _jinja_template(template: str) -> Any:
    """Compile ``template`` in a sandboxed environment with the globals, filters and extensions of
    ``transformers``' chat templates (a ``{% generation %}`` block renders its body)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


class ChatTemplate:
    """Render and tokenize conversations with a tokenizer's chat template (or :data:`DEFAULT_CHAT_TEMPLATE`).

    Args:
        tokenizer_path: a ``tokenizer.json``; ``tokenizer_config.json`` / ``chat_template.jinja``
            beside it are read (see :func:`read_tokenizer_config`).
        use_transformers: render and tokenize through ``transformers`` when it is installed (default);
            False forces the ``jinja2`` + ``tokenizers`` path.

    Raises:
        DataError: the tokenizer files are unreadable, or the template does not compile (naming the
            file, the template's line and jinja's message).
    """

    def __init__(self, tokenizer_path: str | pathlib.Path, use_transformers: bool = True) -> None:
        self.files = read_tokenizer_config(tokenizer_path)
        self.template = self.files.chat_template or DEFAULT_CHAT_TEMPLATE
        self.source = str(self.files.template_source or "shardlm's default chat template")
        self.special_tokens = self.files.special_tokens
        self.tokenizer = load_tokenizer(str(self.files.tokenizer_path))
        import jinja2

        try:
            self._jinja = _jinja_template(self.template)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise DataError(f"{self.source}: the chat template does not compile: template line {e.lineno}: "
                            f"{_one_line(e.message or e)}") from None
        self._hf = self._transformers_tokenizer() if use_transformers else None

    @property
    def backend(self) -> str:
        """``"transformers"`` or ``"jinja2"``: which library renders the template."""
        return "jinja2" if self._hf is None else "transformers"

    def _transformers_tokenizer(self) -> Any:
        try:
            from transformers import PreTrainedTokenizerFast
        except ImportError:
            return None
        kwargs: dict[str, Any] = dict(self.special_tokens)
        for key in ("model_max_length", "clean_up_tokenization_spaces"):
            if key in self.files.config:
                kwargs[key] = self.files.config[key]
        return PreTrainedTokenizerFast(tokenizer_file=str(self.files.tokenizer_path), chat_template=self.template,
                                       **kwargs)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False, where: str = "") -> str:
        """The text of ``messages`` rendered by the template.

        Raises:
            DataError: ``{where}: the chat template (<file>) failed: <the template's own error text>``
                (``raise_exception`` in the template, an undefined variable, a type error...).
        """
        import jinja2

        try:
            if self._hf is not None:
                return self._hf.apply_chat_template(messages, tokenize=False,
                                                    add_generation_prompt=add_generation_prompt)
            return self._jinja.render(messages=messages, tools=None, documents=None,
                                      add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            prefix = f"{where}: " if where else ""
            raise DataError(f"{prefix}the chat template ({self.source}) failed: {type(e).__name__}: "
                            f"{_one_line(e)}") from None

    def tokenize(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of ``text`` without added special tokens, and each token's (start, end) characters."""
        if self._hf is not None:
            enc = self._hf(text, add_special_tokens=False, return_offsets_mapping=True)
            return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        return list(enc.ids), [tuple(o) for o in enc.offsets]

    def encode(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
               where: str = "") -> tuple[list[int], list[int]]:
        """Token ids of the rendered chat and a 0/1 response mask of the same length.

        The ids are those of ``apply_chat_template(messages, add_generation_prompt=...)``. A token
        is response (1) when it overlaps the text an assistant turn adds after the generation prompt:
        from the end of ``render(messages[:i], add_generation_prompt=True)`` to where
        ``render(messages[:i + 1])`` stops agreeing with the whole text (at a token boundary).

        Raises:
            DataError: a render error (see :meth:`render`), or a template whose generation prompt
                before an assistant turn is not a prefix of the whole text (the response cannot be found).
        """
        text = self.render(messages, add_generation_prompt, where)
        ids, offsets = self.tokenize(text)
        ends = sorted({e for _, e in offsets} | {0})
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = self.render(messages[:i], True, where)
            after = self.render(messages[:i + 1], False, where)
            if not text.startswith(before):
                prefix = f"{where}: " if where else ""
                raise DataError(f"{prefix}the chat template ({self.source}) does not render message {i} as an "
                                "extension of the previous ones; cannot tell response tokens apart")
            # the turn ends where ``after`` leaves the whole text (a template may close the chat
            # differently, e.g. with eos_token), cut back to a token boundary of the whole text
            common = len(os.path.commonprefix([after, text]))
            end = ends[bisect.bisect_right(ends, common) - 1]
            if end > len(before):
                spans.append((len(before), end))
        mask = [int(any(s < hi and (e > lo or (e == s and lo <= s)) for lo, hi in spans)) for s, e in offsets]
        return ids, mask
