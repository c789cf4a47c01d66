"""The installed torch and torchvision: the releases the project is tested on, and a mismatch said in one line.

The install admits exactly the torch series the tests run on (``setup.cfg``); torchvision must be the
release built for the installed torch (0.29 for torch 2.14: its minor is torch's plus 15), or its
compiled operators fail to load (``operator torchvision::nms does not exist``) on the first model that
uses them. Both are read from the installed packages' metadata, without importing torchvision.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["TESTED_TORCH", "torchvision_for", "install_problem"]

TESTED_TORCH = (2, 14)   # the series setup.cfg admits (torch>=2.14.1,<2.15)


def _release(text: str) -> tuple[int, int]:
    major, minor = text.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def torchvision_for(torch_version: str) -> str:
    """The torchvision series built for ``torch_version`` (``2.14.1`` -> ``0.29``)."""
    major, minor = _release(torch_version)
    return f"0.{minor + 15}" if major == 2 else "?"


def install_problem(torch_version: str | None = None, torchvision_version: str | None = None) -> str | None:
    """What is wrong with the installed torch and torchvision, with the fix, or None (default: what is installed)."""
    try:
        torch_version = torch_version or version("torch")
    except PackageNotFoundError:
        return "torch is not installed: pip install -e . (from the project's folder)"
    if torchvision_version is None:
        try:
            torchvision_version = version("torchvision")
        except PackageNotFoundError:
            torchvision_version = ""   # only the ResNet needs it; its import says so
    want = torchvision_for(torch_version)
    if torchvision_version and ".".join(map(str, _release(torchvision_version))) != want:
        return (f"torchvision {torchvision_version} does not match torch {torch_version} (its compiled operators "
                f"would fail to load): pip install 'torchvision=={want}.*' (or the torch that torchvision "
                f"{torchvision_version} was built for)")
    if _release(torch_version) != TESTED_TORCH:
        return (f"torch {torch_version} is not the series pipeengine is tested on "
                f"({'.'.join(map(str, TESTED_TORCH))}): pip install -e . installs it")
    return None
