"""Documents: pieces that cover each document exactly, splits by document, the three sources and their errors."""

from __future__ import annotations

import ast
import struct
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from pipeengine.models import data
from pipeengine.models.documents import Documents
from pipeengine.training.data import SourceDataset

SPLITS = ("train", "val")


def reassemble(c: Documents, split: str) -> list[list[int]]:
    """Each document of a split from its pieces (the first input token, then every piece's targets), checking every
    piece on the way: 1..context tokens, targets the inputs shifted by one, each overlapping the one before by one
    token, all but a document's last exactly context long."""
    docs, i = [], 0
    for length in c.document_lengths(split).tolist():
        tokens: list[int] = []
        while len(tokens) < length:
            x, y = c.example(split, i)
            assert x.dtype == y.dtype == torch.int64
            assert 1 <= len(x) == len(y) == int(c.lengths(split)[i]) <= c.context
            assert torch.equal(x[1:], y[:-1])
            assert not tokens or int(x[0]) == tokens[-1]
            tokens = (tokens or [int(x[0])]) + y.tolist()
            assert len(tokens) == length or len(y) == c.context
            i += 1
        assert len(tokens) == length
        docs.append(tokens)
    assert i == c.num_examples(split) == len(c.lengths(split))
    return docs


def write_tokens(path: Path, docs: list[list[int]]) -> str:
    """A nanoGPT-style token file (little-endian uint16) and its document index (little-endian int64 offsets)."""
    tokens = [t for doc in docs for t in doc]
    offsets = [0]
    for doc in docs:
        offsets.append(offsets[-1] + len(doc))
    path.write_bytes(struct.pack(f"<{len(tokens)}H", *tokens))
    path.with_suffix(".idx").write_bytes(struct.pack(f"<{len(offsets)}q", *offsets))
    return str(path)


def test_stdlib_documents_are_its_top_level_definitions_in_order() -> None:
    c = Documents(context=64, max_bytes=300_000)
    assert c.vocab_size == 256 and c.context == 64
    docs = [bytes(d) for split in SPLITS for d in reassemble(c, split)]
    assert 300_000 - 1 <= sum(map(len, docs)) <= 300_000
    source, at = data._stdlib_bytes(2_000_000), 0   # the same files, in the same order
    for doc in docs:
        at = source.index(doc, at) + len(doc)
        assert doc.startswith((b"def ", b"async def ", b"class ", b"@"))
    for doc in docs[:-1]:   # the last may be cut short at max_bytes
        (node,) = ast.parse(doc).body   # one whole statement, whole lines
        assert doc.endswith(b"\n")
        assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    assert any(doc.startswith(b"@") for doc in docs) and any(doc.startswith(b"class ") for doc in docs)


def test_stdlib_document_lengths_at_the_default_size() -> None:
    c = Documents(context=128)
    lengths = torch.cat([c.document_lengths(s) for s in SPLITS])
    assert 4_000_000 - 1 <= int(lengths.sum()) <= 4_000_000
    q = torch.quantile(lengths.double(), torch.tensor([0.25, 0.5, 0.75, 0.9], dtype=torch.double)).tolist()
    n = torch.cat([c.lengths(s) for s in SPLITS])
    assert int(n.sum()) == int((lengths - 1).sum())   # every byte but a document's first predicted once
    waste = {}
    for context in (128, 1024):   # one document's pieces a row each, padded to the context
        rows = int(((lengths - 2) // context + 1).sum())
        waste[context] = 1 - int(n.sum()) / (rows * context)
    assert waste[128] == 1 - int(n.sum()) / (len(n) * 128)
    print(f"{len(lengths)} documents, bytes: quartiles {q[0]:.0f} {q[1]:.0f} {q[2]:.0f}, 90th percentile "
          f"{q[3]:.0f}; padding waste at context 128: {waste[128]:.3f}, at 1024: {waste[1024]:.3f}")
    assert 300 <= q[1] <= 800


def test_the_split_is_deterministic() -> None:
    a, b = Documents(max_bytes=300_000), Documents(max_bytes=300_000)
    for split in SPLITS:
        assert torch.equal(a.lengths(split), b.lengths(split))
        assert torch.equal(a.document_lengths(split), b.document_lengths(split))
        for i in (0, a.num_examples(split) // 2, a.num_examples(split) - 1):
            assert all(torch.equal(u, v) for u, v in zip(a.example(split, i), b.example(split, i)))
    docs = sum(len(a.document_lengths(s)) for s in SPLITS)
    assert len(a.document_lengths("val")) == max(1, int(docs * 0.1))


def test_a_folder_is_one_document_a_file_split_by_document(tmp_path: Path) -> None:
    texts = {f"d{k}.txt": f"document {k}: ".encode() + bytes(range(65 + k, 91)) * (k + 1) for k in range(10)}
    texts["sub/z.txt"] = b"in a sub-folder, walked after the files beside it"
    texts["d5.txt"] = b"x"   # one byte: nothing to predict, dropped
    (tmp_path / "sub").mkdir()
    for name, text in texts.items():
        (tmp_path / name).write_bytes(text)
    kept = [list(t) for t in texts.values() if len(t) >= 2]
    c = Documents(str(tmp_path), context=16, val_fraction=0.3)
    train, val = reassemble(c, "train"), reassemble(c, "val")
    assert train + val == kept and len(val) == 3   # the last documents, whole, in walk order
    assert all(int(n) == 1 for n in Documents(str(tmp_path), context=1).lengths("train"))


@pytest.mark.parametrize("length,pieces", [(2, [1]), (17, [16]), (18, [16, 1]), (33, [16, 16]), (34, [16, 16, 1])])
def test_pieces_start_every_context_tokens_while_one_is_left(tmp_path: Path, length: int, pieces: list[int]) -> None:
    (tmp_path / "a.txt").write_bytes(b"a" * length)
    (tmp_path / "b.txt").write_bytes(b"validation")
    c = Documents(str(tmp_path), context=16)
    assert c.lengths("train").tolist() == pieces and c.lengths("train").dtype == torch.int64
    assert c.document_lengths("train").tolist() == [length] and reassemble(c, "train") == [list(b"a" * length)]


def test_text_paths_that_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist; give a text file"):
        Documents(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="not a regular file or folder"):
        Documents("/dev/null")
    with pytest.raises(ValueError, match="a folder without files"):
        Documents(str(tmp_path))
    (tmp_path / "a.txt").write_text("one file: its last tenth validates")
    one = Documents(str(tmp_path / "a.txt"))
    assert one.document_lengths("train").tolist() == [31] and one.document_lengths("val").tolist() == [3]
    (tmp_path / "a.txt").write_text("ab")   # 2 bytes: one for each split, neither of 2 tokens
    with pytest.raises(ValueError, match="the train split has no examples .* give more text"):
        Documents(str(tmp_path / "a.txt"))
    (tmp_path / "b.bin.txt").write_bytes(b"text\x00with a NUL")
    with pytest.raises(ValueError, match="is binary"):
        Documents(str(tmp_path))
    with pytest.raises(ValueError, match="context 0 is below 1"):
        Documents(str(tmp_path), context=0)


def test_token_file(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 40_000, (n,), generator=g).tolist() for n in (5, 1, 0, 300, 2, 130, 65)]
    docs[3][7] = 39_999
    c = Documents(write_tokens(tmp_path / "tokens.bin", docs), context=64, max_bytes=10)
    assert c.vocab_size == max(t for doc in docs for t in doc) + 1 == 40_000
    assert reassemble(c, "train") + reassemble(c, "val") == [doc for doc in docs if len(doc) >= 2]
    assert c.lengths("train").tolist() == [4, 64, 64, 64, 64, 43, 1, 64, 64, 1]
    assert c.lengths("val").tolist() == [64]
    assert c.document_lengths("train").tolist() == [5, 300, 2, 130] and c.document_lengths("val").tolist() == [65]


def test_malformed_token_files_are_refused(tmp_path: Path) -> None:
    good = write_tokens(tmp_path / "t.bin", [[1, 2, 3], [4, 5]])
    idx = tmp_path / "t.idx"
    with pytest.raises(ValueError, match="does not exist; give a token file"):
        Documents(str(tmp_path / "missing.bin"))
    for offsets, problem in (([1, 3, 5], "does not start at 0"), ([0, 4, 3, 5], "decreases"),
                             ([0, 3, 4], "ends at 4, not at the 5 tokens"), ([], "0 bytes, not a whole number")):
        idx.write_bytes(struct.pack(f"<{len(offsets)}q", *offsets))
        with pytest.raises(ValueError, match=f"{problem}.*; write little-endian int64 offsets"):
            Documents(good)
    idx.write_bytes(b"\x00" * 12)
    with pytest.raises(ValueError, match="12 bytes, not a whole number"):
        Documents(good)
    idx.unlink()
    with pytest.raises(ValueError, match="has no document index .*t.idx"):
        Documents(good)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    (tmp_path / "odd.idx").write_bytes(struct.pack("<2q", 0, 1))
    with pytest.raises(ValueError, match="3 bytes, an odd number"):
        Documents(str(odd))


def test_ten_thousand_documents_index_quickly(tmp_path: Path) -> None:
    docs = [[0] * (1 + k % 200) for k in range(10_000)]
    path = write_tokens(tmp_path / "many.bin", docs)
    start = time.perf_counter()
    c = Documents(path, context=64)
    assert time.perf_counter() - start < 0.5
    assert c.vocab_size == 1
    assert sum(c.num_examples(s) for s in SPLITS) == sum(-(-(len(d) - 1) // 64) for d in docs)
    assert len(c.document_lengths("val")) == int(0.1 * sum(len(d) >= 2 for d in docs))


def test_through_a_dataloader(tmp_path: Path) -> None:
    docs = [list(range(k, 3 * k + 2)) for k in range(1, 8)]
    c = Documents(write_tokens(tmp_path / "t.bin", docs), context=4)
    loaded = list(DataLoader(SourceDataset(c, "train"), batch_size=None))
    assert len(loaded) == c.num_examples("train")
    for i, (x, y) in enumerate(loaded):
        assert all(torch.equal(u, v) for u, v in zip((x, y), c.example("train", i)))


def test_the_parsed_stdlib_is_cached_per_machine_and_a_damaged_cache_is_parsed_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeengine.models import documents
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    parse = documents._stdlib_documents.__wrapped__   # (past the per-process cache)
    first = parse(100_000)
    (cached,) = (tmp_path / "pipeengine").iterdir()
    assert parse(100_000) == first and sum(map(len, first)) == 100_000
    cached.write_bytes(cached.read_bytes()[:-1])   # cut short: not trusted
    assert parse(100_000) == first and cached.stat().st_size == 8 + 8 * len(first) + 100_000
