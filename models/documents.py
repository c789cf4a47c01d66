"""A language-model corpus of documents, each cut into pieces no longer than the context (no piece spans two).

The documents: the Python standard library's top-level definitions (made locally, the default), the files of a
text file or folder (bytes, vocab 256), or a nanoGPT-style token file (``.bin``, little-endian uint16 tokens,
memory-mapped) with its document index beside it (``.idx``, little-endian int64 offsets: 0, each document's end).
A document of L tokens gives pieces starting at 0, context, 2 x context, ... while the start is below L - 1, each
ending one token after the next piece starts, so every token but the first is predicted exactly once. The last
documents are the validation split; documents of fewer than two tokens are dropped.
"""

from __future__ import annotations

import ast
import functools
import itertools
import os
import struct
import sys
import sysconfig
import zlib
from typing import Iterator, NamedTuple

import torch

from .data import SKIP, check_path, stdlib_sources, text_files

__all__ = ["Documents"]

_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_CHUNK = 1 << 24   # tokens widened at a time to find a token file's largest token


def _stdlib_definitions() -> Iterator[bytes]:
    """The standard library's top-level def, async def and class statements, file by file in sorted order, each
    from its first decorator line (or its own) through its last line: whole lines, as bytes."""
    for source in stdlib_sources():
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):   # bad syntax, an undecodable file, NUL bytes: not a source to learn
            continue
        lines = source.splitlines(keepends=True)   # bytes split at \n, \r\n and \r, as Python counts lines
        for node in tree.body:
            if isinstance(node, _DEFINITIONS):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                yield b"".join(lines[first - 1:node.end_lineno])


@functools.lru_cache(maxsize=2)   # once per process; parsed once per machine (about a second for the default 4 MB)
def _stdlib_documents(max_bytes: int) -> list[bytes]:
    """The first standard-library definitions, ``max_bytes`` bytes in all (the last one cut short), from the cache
    (``$XDG_CACHE_HOME`` or ``~/.cache``, ``pipeengine/``) when an earlier run made them with this Python."""
    path = _cache_path(max_bytes)
    cached = _read_cache(path)
    if cached is not None:
        return cached
    docs, room = [], max_bytes
    for doc in _stdlib_definitions():
        if room <= 0:
            break
        docs.append(doc[:room])
        room -= len(docs[-1])
    try:   # written whole or not at all: ranks starting together may race to write it
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(struct.pack("<q", len(docs)) + struct.pack(f"<{len(docs)}q", *map(len, docs)) + b"".join(docs))
        os.replace(tmp, path)
    except OSError:   # a read-only home: parse again next time
        pass
    return docs


def _cache_path(max_bytes: int) -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    key = zlib.crc32(f"{sysconfig.get_paths()['stdlib']}|{sys.version}|{max_bytes}|{SKIP}|v1".encode())
    return os.path.join(root, "pipeengine", f"stdlib-documents-{key:08x}.bin")


def _read_cache(path: str) -> list[bytes] | None:
    """The documents a cache file holds (count, each length, the bytes), or None if it is missing or damaged."""
    try:
        with open(path, "rb") as fh:
            blob = fh.read()
        (count,) = struct.unpack_from("<q", blob)
        lengths = struct.unpack_from(f"<{count}q", blob, 8)
    except (OSError, struct.error):
        return None
    starts = list(itertools.accumulate(lengths, initial=8 + 8 * count))
    if starts[-1] != len(blob):
        return None
    return [blob[a:b] for a, b in zip(starts, starts[1:])]


def _token_file(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``.bin`` file's tokens (uint16, memory-mapped) and its ``.idx`` document offsets (int64), checked."""
    check_path(path, "a token file (.bin) with its document index (.idx) beside it")
    index = path[:-len(".bin")] + ".idx"
    layout = "little-endian int64 offsets: 0, then the end of each document, the last the number of tokens"
    if not os.path.isfile(index):
        raise ValueError(f"--data {path!r} has no document index {index!r} beside it; write one there ({layout})")
    size = os.path.getsize(path)
    if size % 2:
        raise ValueError(f"--data {path!r} has {size} bytes, an odd number: not little-endian uint16 tokens; give a "
                         f"token file of 2 bytes a token")
    tokens = torch.from_file(path, shared=False, size=size // 2, dtype=torch.uint16)
    with open(index, "rb") as fh:
        raw = fh.read()
    if not raw or len(raw) % 8:
        raise ValueError(f"the document index {index!r} has {len(raw)} bytes, not a whole number (1 or more) of "
                         f"int64 offsets; write {layout}")
    offsets = torch.frombuffer(bytearray(raw), dtype=torch.int64)
    problem = ("does not start at 0" if offsets[0] != 0 else "decreases" if bool((offsets.diff() < 0).any())
               else f"ends at {int(offsets[-1])}, not at the {len(tokens)} tokens" if offsets[-1] != len(tokens)
               else "")
    if problem:
        raise ValueError(f"the document index {index!r} {problem}; write {layout} of {path!r}")
    return tokens, offsets


def _largest(tokens: torch.Tensor) -> int:
    """The largest token (0 if none), widened a chunk at a time: uint16 has no max and the file may be large."""
    return max((int(tokens[i:i + _CHUNK].int().max()) for i in range(0, len(tokens), _CHUNK)), default=0)


class _Split(NamedTuple):
    starts: torch.Tensor      # int64 [examples]: where each piece starts in the token stream
    n: torch.Tensor           # int64 [examples]: each piece's predicted tokens (its length - 1)
    documents: torch.Tensor   # int64 [documents]: each document's tokens


def _pieces(starts: torch.Tensor, lengths: torch.Tensor, context: int) -> _Split:
    """The pieces of documents of ``lengths`` (each at least 2) starting at ``starts``, in document order."""
    counts = (lengths - 2) // context + 1   # ceil((L - 1) / context): starts 0, context, ... below L - 1
    doc = torch.repeat_interleave(torch.arange(len(lengths)), counts)
    step = torch.arange(len(doc)) - (torch.cumsum(counts, 0) - counts)[doc]   # the piece's number in its document
    return _Split(starts[doc] + step * context, torch.clamp(lengths[doc] - 1 - step * context, max=context), lengths)


class Documents:
    """Documents cut into examples of at most ``context`` predicted tokens: (input, target) = (piece[:-1], piece[1:]).

    ``path`` None: the standard library's top-level definitions, ``max_bytes`` bytes in all; a text file or
    folder: each file a document, ``max_bytes`` bytes in all (a single file: its last ``val_fraction`` is a
    second document); ``*.bin``: a token file with its ``.idx`` (all of it). The last ``val_fraction`` of the
    documents (at least one) are the validation split ("val").
    """

    def __init__(self, path: str | None = None, context: int = 64, max_bytes: int = 4_000_000,
                 val_fraction: float = 0.1) -> None:
        if context < 1:
            raise ValueError(f"context {context} is below 1; give a context of at least one token")
        self.context = context
        if path is not None and path.endswith(".bin"):
            self._tokens, offsets = _token_file(path)
            self.vocab_size = _largest(self._tokens) + 1
        else:
            docs = _stdlib_documents(max_bytes) if path is None else text_files(path, max_bytes)
            if len(docs) == 1:   # one text file: its last val_fraction validates, as two documents
                cut = len(docs[0]) - max(1, int(len(docs[0]) * val_fraction))
                docs = [docs[0][:cut], docs[0][cut:]]
            raw = bytearray(b"".join(docs))
            self._tokens = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
            offsets = torch.cumsum(torch.tensor([0] + [len(d) for d in docs], dtype=torch.int64), 0)
            self.vocab_size = 256
        starts, lengths = offsets[:-1], offsets.diff()
        keep = lengths >= 2
        starts, lengths = starts[keep], lengths[keep]
        n_train = len(lengths) - (max(1, int(len(lengths) * val_fraction)) if len(lengths) >= 2 else 0)
        self._splits = {"train": _pieces(starts[:n_train], lengths[:n_train], context),
                        "val": _pieces(starts[n_train:], lengths[n_train:], context)}
        for split, table in self._splits.items():
            if not len(table.n):
                raise ValueError(f"the {split} split has no examples ({len(lengths)} documents of 2+ tokens, "
                                 f"{len(lengths) - n_train} of them for validation): give more text (--data)")

    def _split(self, split: str) -> _Split:
        return self._splits["train" if split == "train" else "val"]

    def num_examples(self, split: str) -> int:
        return len(self._split(split).n)

    def example(self, split: str, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._split(split)
        start, n = int(table.starts[index]), int(table.n[index])
        piece = self._tokens[start:start + n + 1].long()
        return piece[:-1], piece[1:]

    def lengths(self, split: str) -> torch.Tensor:
        """Each example's n (its input's and target's length), int64."""
        return self._split(split).n

    def document_lengths(self, split: str) -> torch.Tensor:
        """Each kept document's tokens (two or more), int64, in order."""
        return self._split(split).documents
