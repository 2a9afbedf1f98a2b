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

The whole rendered text is tokenized at once (so ids equal ``apply_chat_template``'s). The response
mask (:meth:`ChatTemplate.encode_chat`) marks what the model generates for each assistant turn: its
reply and the template's end-of-turn token, not the text printed after that token (ChatML's ``\\n``
after ``<|im_end|>``). A template with ``{% generation %}`` blocks says so itself: the mask is
``transformers``' ``apply_chat_template(..., return_assistant_tokens_mask=True)``. Otherwise each
assistant turn is located in the whole rendering, without assuming that a conversation renders as an
extension of its shorter prefixes (Qwen3's template, for one, drops the ``<think></think>`` block of
every reply but the last): see :meth:`ChatTemplate.response_spans`.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from shardlm.data.tokenizer import load_tokenizer
from shardlm.data.tokenizer_files import OpenedTokenizer, read_tokenizer_config
from shardlm.errors import DataError

__all__ = ["DEFAULT_CHAT_TEMPLATE", "ChatTemplate", "EncodedChat"]

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""A ``{% generation %}`` tag: the test ``transformers`` makes before it computes an assistant mask."""

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] }}"
    "{% if message['role'] == 'assistant' and eos_token is defined %}{{ eos_token }}{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)
"""Used when the tokenizer has no chat template: ``role: content`` lines, a reply ending with ``eos_token``.

The generation prompt is ``assistant:`` without the space, so the reply's first word keeps its
leading space inside one token (as the whole rendered chat tokenizes)."""

@dataclass
class EncodedChat:
    """One rendered and tokenized conversation.

    Attributes:
        ids: token ids, as ``apply_chat_template(messages)`` returns them (length n).
        mask: 0/1 per token (length n), 1 = response (trained).
        turns: the assistant messages of the conversation.
        supervised: the assistant turns with response tokens (every one, unless a template's
            ``{% generation %}`` blocks leave some out).
    """

    ids: list[int]
    mask: list[int]
    turns: int
    supervised: int


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
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def overlap_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """0/1 per token: 1 when the token's characters ``[start, end)`` overlap a span ``[lo, hi)``.

    The rule of ``transformers``' ``return_assistant_tokens_mask`` (``end > lo and start < hi``), so a
    token cut by a span's edge is trained, and masks from both agree.
    """
    return [int(any(e > lo and s < hi for lo, hi in spans)) for s, e in offsets]


def _find_reply(text: str, content: str, start: int) -> tuple[int, int] | None:
    """Where an assistant reply's ``content`` is rendered in ``text`` at or after ``start``: (begin, end)
    characters, or None. Tried in turn: the content as given, stripped of surrounding whitespace (a
    template's ``| trim``), and the part after its last ``</think>`` (reasoning templates that move the
    reasoning out of the content). An empty reply is at ``start``."""
    candidates = [content, content.strip()]
    if "</think>" in content:
        candidates.append(content.split("</think>")[-1].strip())
    for c in candidates:
        if not c:
            return start, start
        pos = text.find(c, start)
        if pos >= 0:
            return pos, pos + len(c)
    return None


class ChatTemplate:
    """Render and tokenize conversations with a tokenizer's chat template (or :data:`DEFAULT_CHAT_TEMPLATE`).

    Args:
        tokenizer_path: a ``tokenizer.json``; ``tokenizer_config.json`` / ``chat_template.jinja``
            beside it are read (see :func:`read_tokenizer_config`); or an :class:`OpenedTokenizer` (nothing
            read again).
        use_transformers: render and tokenize through ``transformers`` when it is installed (default);
            False forces the ``jinja2`` + ``tokenizers`` path.

    Raises:
        DataError: the tokenizer files are unreadable, or the template does not compile (naming the
            file, the template's line and jinja's message).
    """

    def __init__(
        self, tokenizer_path: str | pathlib.Path | OpenedTokenizer, use_transformers: bool = True
    ) -> None:
        if isinstance(tokenizer_path, OpenedTokenizer):
            self.files, self.tokenizer = tokenizer_path.files, tokenizer_path.tokenizer
        else:
            self.files = read_tokenizer_config(tokenizer_path)
            self.tokenizer = load_tokenizer(str(self.files.tokenizer_path))
        self.template = self.files.chat_template or DEFAULT_CHAT_TEMPLATE
        self.source = str(self.files.template_source or "shardlm's default chat template")
        self.special_tokens = self.files.special_tokens
        import jinja2

        try:
            self._jinja = _jinja_template(self.template)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise DataError(f"{self.source}: the chat template does not compile: template line {e.lineno}: "
                            f"{_one_line(e.message or e)}") from None
        self._hf = self._transformers_tokenizer() if use_transformers else None
        self.marked = bool(GENERATION_TAG.search(self.template))
        """True when the template marks replies with ``{% generation %}`` (the mask is then transformers')."""
        specials = {t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special}
        specials |= {t for t in self.special_tokens.values() if t}
        self.end_of_turn_tokens = sorted(specials, key=lambda t: (-len(t), t))
        """The texts that can end an assistant turn: the tokenizer's special tokens (``tokenizer.json``'s
        added tokens marked special and ``tokenizer_config.json``'s ``bos_token``, ``eos_token``, ...)."""
        self._end_of_turn = (
            re.compile("|".join(map(re.escape, self.end_of_turn_tokens))) if specials else None
        )

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
        return PreTrainedTokenizerFast(tokenizer_file=str(self.files.tokenizer_path),
                                       chat_template=self.template, **kwargs)

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = False, where: str = ""
    ) -> str:
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
        except (
            jinja2.exceptions.TemplateError,
            TypeError,
            ValueError,
            KeyError,
            IndexError,
            AttributeError,
        ) as e:
            prefix = f"{where}: " if where else ""
            raise DataError(
                f"{prefix}the chat template ({self.source}) failed: {type(e).__name__}: {_one_line(e)}"
            ) from None

    def tokenize(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of ``text`` without added special tokens, and each token's (start, end) characters."""
        if self._hf is not None:
            enc = self._hf(text, add_special_tokens=False, return_offsets_mapping=True)
            return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        return list(enc.ids), [tuple(o) for o in enc.offsets]

    def encode(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
               where: str = "") -> tuple[list[int], list[int]]:
        """Token ids of the rendered chat and a 0/1 response mask of the same length: ``ids`` and
        ``mask`` of :meth:`encode_chat` (see there for the rules and errors)."""
        out = self.encode_chat(messages, add_generation_prompt, where)
        return out.ids, out.mask

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
                    where: str = "") -> EncodedChat:
        """Render and tokenize ``messages``; mark the tokens the model is trained to generate.

        The ids are those of ``apply_chat_template(messages, add_generation_prompt=...)``. A template
        with ``{% generation %}`` blocks: the mask is ``transformers``' ``return_assistant_tokens_mask``
        (the blocks are the template author's statement of what is generated). Any other template:
        each assistant turn's span is found in the whole text by :meth:`response_spans`, and a token is
        response when it overlaps a span (:func:`overlap_mask`, transformers' rule).

        Raises:
            DataError: ``{where}: ...``: a render error (see :meth:`render`), an assistant turn whose
                span cannot be located (see :meth:`response_spans`), or a ``{% generation %}`` template
                without ``transformers`` installed.
        """
        turns = sum(1 for m in messages if m.get("role") == "assistant")
        prefix = f"{where}: " if where else ""
        if self.marked and turns:
            if self._hf is None:
                raise DataError(f"{prefix}the chat template ({self.source}) marks replies with {{% "
                                "generation %}; its response mask is computed by transformers, which is not "
                                "installed: pip install 'transformers==5.24.0'")
            import jinja2

            try:
                out = self._hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                   tokenize=True, return_dict=True,
                                                   return_assistant_tokens_mask=True)
            except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError, IndexError,
                    AttributeError) as e:
                raise DataError(f"{prefix}the chat template ({self.source}) failed: {type(e).__name__}: "
                                f"{_one_line(e)}") from None
            mask = [int(m) for m in out["assistant_masks"]]
            runs = sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))
            return EncodedChat(list(out["input_ids"]), mask, turns, min(runs, turns))
        text = self.render(messages, add_generation_prompt, where)
        ids, offsets = self.tokenize(text)
        spans = self.response_spans(messages, text, where) if turns else []
        return EncodedChat(ids, overlap_mask(offsets, spans), turns, len(spans))

    def response_spans(
        self, messages: list[dict[str, Any]], text: str, where: str = ""
    ) -> list[tuple[int, int]]:
        """The characters ``[start, end)`` of ``text`` (``render(messages)``) each assistant turn generates.

        For assistant message i, in order:

        - start: the end of the turn's prompt ``render(messages[:i], add_generation_prompt=True)`` when
          it is a prefix of ``text``; else where ``text`` leaves it, which must be inside its generation
          prompt (after the history ``render(messages[:i])`` and after the previous turn);
        - the reply: the message's content (see :func:`_find_reply`) at or after start;
        - end: the end of the first special token after the reply (its end-of-turn token: ``<|im_end|>``,
          ``<|eot_id|>``, ``</s>``, ...); text the template prints after it (a ``\\n``) is not included.
          The template must put the same token after the reply when the turn is the last message
          (``render(messages[:i + 1])``), so a token of the next turn (``[INST]``) is never taken for it,
          and print nothing after it there but whitespace and special tokens (Phi-3's ``\\n<|endoftext|>``).

        Nothing assumes that ``render(messages[:i + 1])`` is a prefix of ``text``: templates that render
        a turn differently once more follow (Qwen3 drops ``<think></think>``) are located exactly.

        Raises:
            DataError: ``{where}: assistant message {i}: ...``: the whole text leaves its prompt before
                the generation prompt (or before the previous turn's end), its content is not in the text
                after that point, or no special token ends
                it (or not the same one as when it is the last message, or text follows it in the
                turn: a tool call after Llama 3.1's ``<|python_tag|>``). The message says to mark
                replies with ``{% generation %}`` instead.
        """
        spans: list[tuple[int, int]] = []
        cursor = 0
        prefix = f"{where}: " if where else ""
        hint = ("; give the template {% generation %} blocks around each reply and its end-of-turn token "
                "(transformers' assistant masks) to say what is trained")
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            what = f"{prefix}assistant message {i}: the chat template ({self.source})"
            prompt = self.render(messages[:i], True, where)
            start = len(prompt)
            if not text.startswith(prompt):  # the generation prompt differs (DeepSeek R1's adds "<think>\n")
                start = len(os.path.commonprefix([prompt, text]))
                # the history (the prompt without its generation prompt) must agree with the whole text
                history = len(os.path.commonprefix([prompt, self.render(messages[:i], False, where)]))
                cursor = max(cursor, history)
            if start < cursor:
                raise DataError(f"{what} renders the conversation before it differently in the whole chat "
                                "than in its prompt (messages[:i] with the generation prompt): cannot tell "
                                f"where the reply starts{hint}")
            content = message.get("content") if isinstance(message.get("content"), str) else ""
            reply = _find_reply(text, content, start)
            if reply is None:
                raise DataError(f"{what} does not render its content where the reply belongs (after "
                                f"character {start}): cannot locate the reply to train it{hint}")
            end_of_turn = self._end_of_turn.search(text, reply[1]) if self._end_of_turn else None
            last = self.render(messages[:i + 1], False, where)
            last_start = len(os.path.commonprefix([prompt, last]))
            last_reply = _find_reply(last, content, last_start)
            last_end = (self._end_of_turn.search(last, last_reply[1])
                        if self._end_of_turn and last_reply is not None else None)
            if end_of_turn is None or last_end is None:
                raise DataError(f"{what} puts no special token after the reply (its end-of-turn token, where "
                                f"generation stops): nothing teaches the model to stop{hint}")
            if end_of_turn.group() != last_end.group():
                raise DataError(f"{what} ends the reply with {end_of_turn.group()!r} in the whole chat but "
                                f"with {last_end.group()!r} when it is the last message: cannot tell which "
                                f"token ends the turn{hint}")
            rest = self._end_of_turn.sub("", last[last_end.end():])
            if rest.strip():  # e.g. a tool call after a special token (Llama 3.1's <|python_tag|>)
                raise DataError(f"{what} prints text after the reply's first special token "
                                f"{last_end.group()!r} ({_one_line(rest)[:60]!r}): cannot tell which token "
                                f"ends the turn{hint}")
            spans.append((start, end_of_turn.end()))
            cursor = end_of_turn.end()
        return spans
