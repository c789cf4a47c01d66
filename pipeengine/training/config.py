"""The trainer's settings, defined once: the sections (sections.py) gathered in one Config, and the flat list of every
setting the command line, ``--help``, ``--config`` TOML and ``--print-config`` are generated from (torch-free).

A value is checked the same way whether it came from a flag or a file; :meth:`Config.resolve` then
checks what involves several settings or the world size.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

from ..runtime.logs import log
from ..runtime.topology import Topology
from ..schedule.builders import ANY_CHUNKS, default_chunks
from .batch import Batch, split_global_batch
from .checks import Check
from .sections import (DataConfig, FaultsConfig, LoggingConfig, ModelConfig, OptimizerConfig, ParallelConfig,
                       PrecisionConfig, RecomputeConfig, SavingConfig, ScheduleConfig)

__all__ = ["Config", "Setting", "settings", "flat_config", "to_toml", "Replan"]

Replan = Callable[[int, int, int], tuple[int, str]]   # (world, --pp, chunks) -> (pp, why): elastic.py


@dataclass
class Config:
    """Everything a training run needs; build it with cli.parse_args, check it with :meth:`resolve`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    saving: SavingConfig = field(default_factory=SavingConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def resolve(self, world_size: int, replan: Replan | None = None) -> Topology:
        """Check what involves several settings or the world; fill the derived ones (chunks, log interval,
        microbatch size); return the PP x DP grid. A ValueError names the flags and how to fix them.
        ``replan(world, pp, chunks) -> (pp, why)``: an elastic group's pipeline depth when ``--pp`` does not
        divide the world (elastic.py; default: the deepest divisor up to ``--pp``)."""
        self.given()
        for s in settings():
            s.set(self, s.checked(s.get(self)))
        sch, opt, log = self.schedule, self.optimizer, self.logging
        if sch.chunks == 0:
            sch.chunks = default_chunks(sch.name)
        if sch.name == "auto" and sch.chunks != 1:
            raise ValueError(f"--schedule auto chooses the stages per position itself (got --chunks {sch.chunks}); "
                             f"drop --chunks")
        if sch.name in ANY_CHUNKS and sch.chunks < 2:
            raise ValueError(f"--schedule {sch.name} needs --chunks >= 2 (got {sch.chunks}); use 1f1b for "
                             f"one stage per position")
        if sch.name not in ANY_CHUNKS and sch.chunks != default_chunks(sch.name):
            n = default_chunks(sch.name)
            raise ValueError(f"--schedule {sch.name} runs {'one stage' if n == 1 else f'{n} stages'} per position "
                             f"(got --chunks {sch.chunks}); use interleaved-1f1b for any number")
        if sch.name == "auto" and sch.partition != "profile":
            raise ValueError(f"--schedule auto chooses the schedule and the split together from measured layer costs: "
                             f"use --partition profile (the default), not {sch.partition!r}")
        if sch.memory_cap is not None and sch.partition != "profile":
            raise ValueError("--memory-cap is planned for by --partition profile only; drop it or use profile")
        if sch.memory_budget is not None and sch.partition != "profile":
            raise ValueError("--memory-budget is planned for by --partition profile only; drop it or use profile")
        if sch.memory_budget is not None and self.recompute.policy != "none":
            raise ValueError(f"--memory-budget chooses recompute per stage itself: drop --recompute "
                             f"{self.recompute.policy}")
        if sch.whole_microbatches and sch.memory_budget is None:
            raise ValueError("--whole-microbatches says how --memory-budget may plan: give a budget, or drop it "
                             "(without one, microbatches are never cut)")
        if sch.link_gbps is not None and sch.partition != "profile":
            raise ValueError("--link-gbps is planned for by --partition profile only; drop it or use profile")
        if opt.min_lr > opt.lr:
            raise ValueError(f"--min-lr {opt.min_lr:g} is above --lr {opt.lr:g}; the cosine decay ends at --min-lr")
        if log.trace_step is not None and not 0 <= log.trace_step < opt.steps:
            raise ValueError(f"--trace-step {log.trace_step} is not one of the run's steps 0..{opt.steps - 1}")
        if log.log_interval == 0:
            log.log_interval = max(1, opt.steps // 50)
        topo = self._topology(world_size, replan)
        self.set_batch(split_global_batch(topo.dp, *self.given_batch(), pp=topo.pp))
        return topo

    def given_batch(self) -> tuple[int | None, int | None, int | None]:
        """(global batch, microbatches, micro-batch size) as the user gave them (None: not given), before
        :meth:`resolve` filled them in."""
        # kept outside the dataclass fields: a record of the input, not a setting
        given = (self.data.global_batch, self.schedule.microbatches, self.data.micro_batch_size)
        return self.__dict__.setdefault("_given_batch", given)  # type: ignore[no-any-return]

    @property
    def batch(self) -> Batch:
        """The global batch and its split, once :meth:`resolve` filled them in."""
        size, m, micro = self.data.global_batch, self.schedule.microbatches, self.data.micro_batch_size
        if size is None or m is None or micro is None:
            raise RuntimeError("Config.batch is known after Config.resolve()")
        return Batch(size, m, micro)

    def set_batch(self, batch: Batch) -> None:
        self.data.global_batch, self.schedule.microbatches, self.data.micro_batch_size = batch

    def _topology(self, world_size: int, replan: Replan | None) -> Topology:
        pp, dp = self.parallel.pp, self.parallel.dp
        elastic = os.environ.get("PIPEENGINE_ELASTIC") == "1"
        if elastic and pp is not None and world_size % pp:
            # an elastic group (launch/pipe.sh NNODES=MIN:MAX) restarted at a size --pp does not divide: a pp that
            # does, fits the model and the memory (elastic.py), the rest data-parallel (the global batch stays)
            if replan is not None:
                pp, why = replan(world_size, pp, self.schedule.chunks)
            else:
                given, pp = pp, max(d for d in range(1, min(pp, world_size) + 1) if world_size % d == 0)
                why = (f"elastic: {world_size} processes: pp {pp} x dp {world_size // pp} (--pp {given} does not "
                       f"divide {world_size})")
            log.warning(why)
            self.parallel.pp, self.parallel.dp, dp = pp, None, None
        elif elastic and dp is not None and pp is not None and pp * dp != world_size:
            self.parallel.dp = dp = None   # elastic: dp follows the world
        if pp is not None and world_size % pp:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ValueError(f"world size {world_size} is not divisible by --pp {pp}; use --pp in {divisors} or "
                             f"launch a multiple of {pp} processes")
        try:
            return Topology.from_world(world_size, pp=pp, dp=dp)
        except ValueError as exc:
            raise ValueError(f"bad --pp/--dp for {world_size} processes: {exc}") from None

    def lr_at(self, step: int) -> float:
        """Linear warmup to ``lr``, then cosine decay to ``min_lr`` at the last step."""
        opt = self.optimizer
        if step < opt.warmup:
            return opt.lr * (step + 1) / opt.warmup
        progress = (step - opt.warmup) / max(1, opt.steps - opt.warmup)
        return opt.min_lr + 0.5 * (opt.lr - opt.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Every setting by section (the form summaries and checkpoint manifests record)."""
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """Every setting by its flat key (the flag's name, ``micro_batch_size``)."""
        return {s.key: s.get(self) for s in settings()}

    def computation(self) -> dict[str, Any]:
        """The settings every rank must have alike, by flag: all but how the run is shown (the logging section)
        and how fast its data is read (``--data-workers``)."""
        return {s.flag: s.get(self) for s in settings() if s.section != "logging" and s.flag != "--data-workers"}

    def given(self) -> dict[str, Any]:
        """:meth:`computation` as the user gave it, before :meth:`resolve` derived the rest (ranks started with
        different settings are told the one they were given, not one derived from it)."""
        return self.__dict__.setdefault("_given", self.computation())  # type: ignore[no-any-return]


# ------------------------------------------------------------------ the settings as a flat list

@dataclass(frozen=True)
class Setting:
    """One setting: where it lives (section, field), how the command line names it, how it is checked."""

    section: str
    name: str
    type: str           # "int", "float", "str" or "bool"
    optional: bool      # None allowed
    default: Any
    help: str
    flag: str
    short: str | None
    aliases: tuple[str, ...]
    choices: tuple[str, ...] | None
    check: Check | None
    metavar: str | None

    @property
    def key(self) -> str:
        """The flat name used in old TOML files and in messages: the flag without its dashes."""
        return self.flag[2:].replace("-", "_")

    def get(self, cfg: Config) -> Any:
        return getattr(getattr(cfg, self.section), self.name)

    def set(self, cfg: Config, value: Any) -> None:
        setattr(getattr(cfg, self.section), self.name, value)

    def checked(self, value: Any, name: str | None = None) -> Any:
        """``value`` if this setting allows it (choices, range); else ValueError naming ``name`` (the flag)."""
        name = name or self.flag
        if value is None:
            if not self.optional:
                raise ValueError(f"{name} needs a value")
            return None
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{name} {value!r} is not one of {', '.join(self.choices)}")
        return self.check(name, value) if self.check is not None else value


_SECTIONS: tuple[tuple[str, Callable[[], Any]], ...] = tuple(
    (f.name, f.default_factory) for f in dataclasses.fields(Config))   # type: ignore[misc]


def _type_of(annotation: str) -> tuple[str, bool]:
    optional = "None" in annotation
    return annotation.replace(" | None", "").strip(), optional


def flat_config(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A recorded config by flat key, from the sectioned form (:meth:`Config.to_dict`) or the flat one that
    records made before sections hold (``checkpoint`` there is recompute's old name)."""
    by_field = {(s.section, s.name): s.key for s in settings()}
    by_alias = {a[2:].replace("-", "_"): s.key for s in settings() for a in s.aliases}
    out: dict[str, Any] = {}
    for key, value in saved.items():
        if isinstance(value, dict):
            out.update({by_field[(key, k)]: v for k, v in value.items() if (key, k) in by_field})
        else:
            out[by_alias.get(key, key)] = value
    return out


def settings() -> Iterator[Setting]:
    """Every setting, section by section, in declaration order."""
    for section, factory in _SECTIONS:
        for f in dataclasses.fields(factory()):
            kind, optional = _type_of(str(f.type))
            m = f.metadata
            yield Setting(section, f.name, kind, optional, f.default, m["help"], m["flag"] or "--" + f.name.replace(
                "_", "-"), m["short"], m["aliases"], m["choices"], m["check"], m["metavar"])


def to_toml(cfg: Config) -> str:
    """Every setting as TOML, by section, each under its flag's name (unset ones commented out): a file to start
    from, and a run's record. (A file may also name a setting by its field, ``[saving] interval``.)"""
    lines = ["# pipeengine.train settings (python -m pipeengine.train --config FILE): each key is its flag's name"]
    section = None
    for s in settings():
        if s.section != section:
            section = s.section
            lines += ["", f"[{section}]"]
        value, key = s.get(cfg), s.flag[2:]
        if value is None:
            lines.append(f"# {key} =")
        elif isinstance(value, bool):
            lines.append(f"{key} = {str(value).lower()}")
        elif isinstance(value, (int, float)):
            lines.append(f"{key} = {value!r}")
        else:
            lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"
