"""The example models' data, made locally (no downloads): the stdlib walk and text files (documents.py builds the
GPT's documents on them), a byte stream in fixed windows (benchmarks, tests), images, a synthetic regression.

Each source gives examples by index; pipeengine.training.data turns them into each step's batches.
"""

from __future__ import annotations

import os
import sysconfig
from typing import Iterator

import torch

__all__ = ["ByteCorpus", "ImageSource", "SyntheticRegression", "stdlib_sources", "text_files", "check_path"]


SKIP = ("site-packages", "test", "tests", "__pycache__", "idlelib", "lib2to3")   # stdlib folders left out


def stdlib_sources() -> Iterator[bytes]:
    """The Python standard library's .py files (not its tests or site-packages), walked in sorted order."""
    root = sysconfig.get_paths()["stdlib"]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP)
        for name in sorted(filenames):
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name), "rb") as fh:
                    yield fh.read()


def _stdlib_bytes(max_bytes: int) -> bytes:
    chunks, total = [], 0
    for data in stdlib_sources():
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            return b"".join(chunks)[:max_bytes]
    return b"".join(chunks)


def check_path(path: str, what: str) -> None:
    """A ValueError unless ``path`` is a regular file or folder (``what``: what to give instead)."""
    if not os.path.exists(path):
        raise ValueError(f"--data {path!r} does not exist; give {what}")
    if not os.path.isfile(path) and not os.path.isdir(path):   # /dev/zero, a named pipe: reads that never end
        raise ValueError(f"--data {path!r} is not a regular file or folder (a device, pipe or socket); give {what}")


def text_files(path: str, max_bytes: int) -> list[bytes]:
    """Each file of a text file or folder (walked in sorted order), ``max_bytes`` bytes in all; binary files and
    empty paths refused."""
    what = "a text file or a folder of text files"
    check_path(path, what)
    files = [path] if os.path.isfile(path) else [
        os.path.join(d, n) for d, dirs, names in sorted(os.walk(path)) for n in sorted(names)
        if os.path.isfile(os.path.join(d, n))]
    chunks, total = [], 0
    for name in files:
        with open(name, "rb") as fh:
            data = fh.read(max_bytes - total)
        if b"\x00" in data[:65536]:
            raise ValueError(f"--data: {name!r} is binary (it holds NUL bytes), not text; give text files")
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not total:
        raise ValueError(f"--data {path!r} is empty" + ("" if files else " (a folder without files)")
                         + f"; give {what}")
    return chunks


class ByteCorpus:
    """Byte-level text: the Python standard library's own sources by default, or a file/folder."""

    def __init__(self, path: str | None = None, block_size: int = 64, max_bytes: int = 4_000_000,
                 val_fraction: float = 0.1) -> None:
        raw = _stdlib_bytes(max_bytes) if path is None else b"".join(text_files(path, max_bytes))
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long() if raw else torch.zeros(0, dtype=torch.long)
        n_val = int(len(data) * val_fraction)
        self.train, self.val = data[:len(data) - n_val], data[len(data) - n_val:]
        self.block_size = block_size
        for split, d in (("train", self.train), ("validation", self.val)):
            if len(d) < block_size + 1:
                raise ValueError(f"the {split} text has {len(d)} bytes, fewer than block_size+1 = {block_size + 1}; "
                                 f"give more text (--data) or a smaller block size")

    def _data(self, split: str) -> torch.Tensor:
        return self.train if split == "train" else self.val

    def num_examples(self, split: str) -> int:
        return len(self._data(split)) - self.block_size

    def example(self, split: str, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        d = self._data(split)
        return d[index:index + self.block_size], d[index + 1:index + 1 + self.block_size]


class ImageSource:
    """torchvision FakeData (deterministic, made locally) or an ImageFolder, resized to ``image_size``."""

    def __init__(self, path: str | None, image_size: int, num_classes: int, size: int = 2048, seed: int = 0) -> None:
        from torchvision import datasets, transforms
        tf = transforms.Compose([transforms.Resize((image_size, image_size)), transforms.ToTensor()])
        if path is None:
            self.sets = {split: datasets.FakeData(size=n, image_size=(3, image_size, image_size),
                                                  num_classes=num_classes, transform=transforms.ToTensor(),
                                                  random_offset=seed + off)
                         for split, n, off in (("train", size, 0), ("val", size // 8, 10**6))}
        else:
            if not os.path.isdir(path):
                raise ValueError(f"--data {path!r} is not a folder; give an ImageFolder root "
                                 f"(one sub-folder per class)")
            try:
                full = datasets.ImageFolder(path, transform=tf)
            except (FileNotFoundError, OSError) as exc:   # no class folders, or none with images in it
                raise ValueError(f"--data {path!r} is no ImageFolder root ({str(exc).rstrip('. ')}); give a folder "
                                 f"with one sub-folder of images per class") from None
            n_val = max(1, len(full) // 10)
            perm = torch.randperm(len(full), generator=torch.Generator().manual_seed(seed)).tolist()
            self.sets = {"train": torch.utils.data.Subset(full, perm[n_val:]),
                         "val": torch.utils.data.Subset(full, perm[:n_val])}

    def num_examples(self, split: str) -> int:
        return len(self.sets["train" if split == "train" else "val"])

    def example(self, split: str, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        img, label = self.sets["train" if split == "train" else "val"][index]
        return img, torch.tensor(int(label))


class SyntheticRegression:
    """Inputs x ~ N(0, 1) and targets from a fixed random teacher network: learnable, made locally."""

    def __init__(self, in_dim: int, out_dim: int, size: int = 4096, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(size, in_dim, generator=g)
        w1 = torch.randn(in_dim, 64, generator=g) / in_dim ** 0.5
        w2 = torch.randn(64, out_dim, generator=g) / 8
        y = torch.tanh(x @ w1) @ w2
        n_val = size // 8
        self.x = {"train": x[n_val:], "val": x[:n_val]}
        self.y = {"train": y[n_val:], "val": y[:n_val]}

    def num_examples(self, split: str) -> int:
        return len(self.x["train" if split == "train" else "val"])

    def example(self, split: str, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = "train" if split == "train" else "val"
        return self.x[s][index], self.y[s][index]
