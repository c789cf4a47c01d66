"""Agreeing across ranks before anyone goes on: an error met on one rank is raised on every rank.

A check that fails on one rank only (a local path, host memory, a bad value read from a file) must
not leave the other ranks waiting in the next collective: each place that can fail locally runs
through one of these, which gather every rank's outcome in one collective first.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Sequence, TypeVar

import torch.distributed as dist

__all__ = ["raise_if_any", "on_every_rank", "gathered", "decided_by_rank0", "settings_mismatch", "same_settings"]

T = TypeVar("T")


class _Failed(NamedTuple):
    message: str


def raise_if_any(error: str | None, raise_as: Callable[[str], BaseException] = ValueError, group: Any = None) -> None:
    """Raise the first rank's ``error`` (None: none on this rank) as ``raise_as`` on every rank of ``group``."""
    errors: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    first = next((e for e in errors if e), None)
    if first:
        raise raise_as(first)


def on_every_rank(fn: Callable[[], T], *, catch: tuple[type[BaseException], ...] = (ValueError,),
                  raise_as: Callable[[str], BaseException] = ValueError,
                  describe: Callable[[BaseException], str] = str, group: Any = None) -> T:
    """``fn()`` on every rank; this rank's result. If ``fn`` raised one of ``catch`` on any rank, every rank
    raises ``raise_as(describe(the first rank's error))`` instead (one all-gather of the outcomes)."""
    result: Any = None
    error = None
    try:
        result = fn()
    except catch as exc:
        error = describe(exc) or type(exc).__name__
    raise_if_any(error, raise_as, group)
    return result   # type: ignore[no-any-return]


def gathered(value: T | None, error: str | None, raise_as: Callable[[str], BaseException] = ValueError,
             group: Any = None) -> list[T]:
    """Every rank's ``value`` (one all-gather), or the first rank's ``error`` raised on every rank."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, _Failed(error) if error else value, group=group)
    failed = next((v for v in everyone if isinstance(v, _Failed)), None)
    if failed is not None:
        raise raise_as(failed.message)
    return everyone


def decided_by_rank0(fn: Callable[[], T], *, catch: tuple[type[BaseException], ...] = (ValueError,),
                     raise_as: Callable[[str], BaseException] = ValueError, group: Any = None) -> T:
    """``fn()`` on the group's first rank only; its result on every rank, or its error raised on every rank."""
    answer: list[Any] = [None]
    if dist.get_rank(group) == 0:
        try:
            answer[0] = fn()
        except catch as exc:
            answer[0] = _Failed(str(exc))
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(answer, src=src, group=group)
    if isinstance(answer[0], _Failed):
        raise raise_as(answer[0].message)
    return answer[0]   # type: ignore[no-any-return]


def settings_mismatch(everyone: Sequence[Mapping[str, Any]]) -> str | None:
    """Every rank's settings by name (flag or argument): None if all agree, else the first setting (by name) that
    differs, with its value on each group of ranks."""
    for key in sorted({k for settings in everyone for k in settings}):
        values: dict[str, list[int]] = {}
        for r, settings in enumerate(everyone):
            values.setdefault(repr(settings.get(key)), []).append(r)
        if len(values) > 1:
            where = " but ".join(f"{v} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
                                 for v, rs in values.items())
            return (f"the ranks were given different {key}: {where}; every rank must be started with the same "
                    f"settings")
    return None


def same_settings(settings: Mapping[str, Any], group: Any = None) -> None:
    """One all-gather of every rank's ``settings``; a difference raises ValueError on every rank (see
    :func:`settings_mismatch`)."""
    mismatch = settings_mismatch(gathered(dict(settings), None, group=group))
    if mismatch:
        raise ValueError(mismatch)
