"""A piece's bytes as a stream, in bounded blocks (a seeked file, a ``.gz`` or ``.zst`` decompressor), and
their decoding as UTF-8 with the line of any bad byte named. Used by the text and JSONL readers
(:mod:`shardlm.data.readers`)."""

from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import Iterator
from typing import Any

from shardlm.data import pieces
from shardlm.data.corpus import DataError
from shardlm.data.pieces import Piece, optional_module


def _open_binary(piece: Piece) -> io.BufferedIOBase:
    """The piece's bytes as a stream: a seeked file (positioned at ``start``) or a decompressor."""
    raw = open(piece.path, "rb")
    if piece.compression == "gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    if piece.compression == "zst":
        return io.BufferedReader(_ZstdStream(raw), buffer_size=pieces.READ_BLOCK)  # type: ignore[return-value]
    raw.seek(piece.start)
    return raw  # type: ignore[return-value]


class _ZstdStream(io.RawIOBase):
    """Decompresses a ``.zst`` file frame after frame; a file that ends inside a frame is an error.

    (``zstandard``'s ``stream_reader`` returns a truncated stream's data and then a clean end of file.)
    """

    def __init__(self, raw: io.BufferedReader) -> None:
        self.zstd = optional_module("zstandard", ".zst files")
        self.raw = raw
        self.dobj = self.zstd.ZstdDecompressor().decompressobj()
        self.in_frame = False
        self.pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self.pending:
            data = self.raw.read(pieces.READ_BLOCK)
            if not data:
                if self.in_frame:
                    raise EOFError("the file ends inside a zstd frame (truncated)")
                return 0
            while data:
                self.in_frame = True
                self.pending += self.dobj.decompress(data)
                data = b""
                if self.dobj.eof:  # frame complete: the rest starts a new frame
                    data = self.dobj.unused_data
                    self.dobj = self.zstd.ZstdDecompressor().decompressobj()
                    self.in_frame = False
        n = min(len(buffer), len(self.pending))
        buffer[:n] = self.pending[:n]
        self.pending = self.pending[n:]
        return n

    def close(self) -> None:
        self.raw.close()
        super().close()


def _stream_errors(piece: Piece) -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [OSError, EOFError, zlib.error]
    if piece.compression == "zst":
        errors.append(optional_module("zstandard", ".zst files").ZstdError)
    return tuple(errors)


def line_of(path: str, offset: int) -> int:
    """1-based line number of byte ``offset`` of an uncompressed file (counted only on an error path)."""
    n = 1
    with open(path, "rb") as f:
        left = offset
        while left > 0:
            block = f.read(min(pieces.READ_BLOCK, left))
            if not block:
                break
            n += block.count(b"\n")
            left -= len(block)
    return n


def blocks(piece: Piece) -> Iterator[bytes]:
    """The piece's bytes in blocks of about 1 MiB, each ending at a line end (or the piece end)."""
    errors = _stream_errors(piece)
    remaining = piece.end - piece.start if piece.end >= 0 else -1
    carry = b""
    try:
        with _open_binary(piece) as f:
            while True:
                want = pieces.READ_BLOCK if remaining < 0 else min(pieces.READ_BLOCK, remaining)
                block = f.read(want) if want else b""
                if remaining >= 0:
                    remaining -= len(block)
                if not block:
                    break
                data = carry + block
                cut = data.rfind(b"\n") + 1
                if cut == 0 and len(data) < 4 * pieces.READ_BLOCK:
                    carry = data  # one long line: keep reading (up to 4 MiB, then cut anywhere)
                    continue
                if cut == 0:
                    cut = len(data)
                    while cut > 0 and 0x80 <= data[cut - 1] < 0xC0:
                        cut -= 1  # not inside a UTF-8 character
                    if cut > 0 and data[cut - 1] >= 0xC0:
                        cut -= 1
                    cut = cut or len(data)
                carry = data[cut:]
                yield data[:cut]
    except errors as exc:
        raise DataError(f"{piece.path}: cannot read ({piece.compression or 'file'} stream is corrupt or "
                        f"truncated: {exc})") from None
    if carry:
        yield carry


def decode(data: bytes, piece: Piece, offset: int, lineno: int | None) -> str:
    """``data`` (bytes at ``offset`` of the piece) as UTF-8 text; DataError naming the file and the line of
    the first bad byte (``lineno`` of the block's first line when known, else counted from the file)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if lineno is None:  # uncompressed: count the lines before the bad byte
            lineno = line_of(piece.path, offset + exc.start)
        else:
            lineno += data[: exc.start].count(b"\n")
        raise DataError(f"{piece.path}:{lineno}: not valid UTF-8 text ({exc.reason} at byte "
                        f"{offset + exc.start})") from None
