"""The trainer's command line, generated from config.py: flags, --help, --config TOML, --print-config (torch-free).

    launch/pipe.sh 4 cpus --model gpt --preset tiny --steps 100      # pp=2 x dp=2 on Gloo
    launch/pipe.sh 8 gpus --model gpt --preset small                 # pp=4 x dp=2 on NCCL
    python -m pipeengine.train --steps 20                            # one process, no torchrun
    python -m pipeengine.train --print-config > run.toml             # every setting, to edit
    tensorboard --logdir runs                                        # throughput views
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
import sys
from typing import Any, NoReturn, Sequence

from ..runtime.logs import log
from .config import Config, Setting, settings, to_toml
from .sections import MODELS

__all__ = ["parse_args", "load_config", "main"]


def _presets() -> str:
    names = importlib.import_module("pipeengine.models.presets").PRESETS   # torch-free
    return "; ".join(f"{m}: {', '.join(names[m])}" for m in MODELS)


def _converter(s: Setting) -> Any:
    """argparse ``type=``: parse the text, then the setting's own check (argparse reports the message)."""
    def convert(text: str) -> Any:
        try:
            value = {"int": int, "float": float}.get(s.type, str)(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n' if s.type == 'int' else ''} {s.type}") from None
        try:
            return s.checked(value, s.flag)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = s.type
    return convert


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad value in one line (no usage block): ``error: --lr must be ...``."""

    def error(self, message: str) -> NoReturn:
        message = re.sub(r"^argument [^:]+: (?=--)", "", message)   # the check's message names the flag already
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:   # a misspelt flag: the nearest ones (prefixes are not accepted: allow_abbrev=False)
            flags = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
            hints = [f"{w} (did you mean {close[0]}?)" if close else w for w in unknown[1].split()
                     for close in [difflib.get_close_matches(w.split("=")[0], flags, n=1)]]
            message = f"unrecognized arguments: {' '.join(hints)}"
        self.exit(2, f"error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m pipeengine.train", formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False,
        description="Train a model with pipeline x data parallelism. Launch with launch/pipe.sh N gpus|cpus "
                    "(torchrun) or run it as one process. Logs go to TensorBoard under --log-dir. Settings come "
                    "from the defaults, then --config FILE, then the flags.")
    p.add_argument("--config", metavar="FILE", help="a TOML file of these settings ([section] tables as "
                                                    "--print-config writes them, or flat flag names)")
    p.add_argument("--print-config", action="store_true", help="print the resolved settings as TOML and exit")
    groups: dict[str, Any] = {}
    for s in settings():
        if s.section not in groups:
            doc = (getattr(Config(), s.section).__doc__ or "").strip()
            groups[s.section] = p.add_argument_group(s.section, doc)
        names = [s.flag, *([s.short] if s.short else []), *s.aliases]
        kw: dict[str, Any] = {"dest": f"{s.section}.{s.name}", "default": s.default, "help": s.help}
        if s.section == "model" and s.name == "preset":
            kw["help"] = f"the model's named size: {_presets()}"
        if s.type == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = _converter(s)
            kw["metavar"] = s.metavar or ("{" + ",".join(s.choices) + "}" if s.choices else s.type.upper())
        if s.name == "resume":
            kw.update(nargs="?", const="latest")
        groups[s.section].add_argument(*names, **kw)
    return p


def _lookup() -> tuple[dict[str, Setting], dict[tuple[str, str], Setting]]:
    """Settings by flat key (flag name; old flat TOML files) and by (section, field or flag name)."""
    flat: dict[str, Setting] = {}
    nested: dict[tuple[str, str], Setting] = {}
    for s in settings():
        for name in (s.flag, *s.aliases):
            flat[name[2:].replace("-", "_")] = s
        nested[(s.section, s.name)] = nested[(s.section, s.key)] = s
    return flat, nested


def _toml_value(s: Setting, key: str, value: Any, path: str) -> Any:
    ok = (isinstance(value, bool) if s.type == "bool" else isinstance(value, int) and not isinstance(value, bool)
          if s.type == "int" else isinstance(value, (int, float)) and not isinstance(value, bool)
          if s.type == "float" else isinstance(value, str))
    if not ok:
        raise ValueError(f"--config {path!r}: {key} = {value!r} should be {s.type}")
    value = float(value) if s.type == "float" else value
    try:
        return s.checked(value, f"{key} (in --config {path!r})")
    except ValueError as exc:
        raise ValueError(f"{exc} ({s.flag} takes the same values)") from None


def load_config(path: str) -> dict[str, Any]:
    """The settings of a TOML file as argparse defaults (``section.field`` -> value), each checked as its flag.

    Sections as ``--print-config`` writes them (``[optimizer] lr = 0.001``), or flat flag names
    (``lr = 0.001``, ``micro-batch-size = 4``: the format before sections) both work.
    """
    import tomllib
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except OSError as exc:
        raise ValueError(f"--config {path!r}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"--config {path!r} is not valid TOML: {exc}") from None
    flat, nested = _lookup()
    sections = {s.section for s in settings()}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if isinstance(value, dict) and name in sections:
            for sub, v in value.items():
                s = nested.get((name, sub.replace("-", "_")))
                if s is None:
                    known = [k for (sec, k) in nested if sec == name]
                    raise ValueError(f"--config {path!r}: unknown setting {sub!r} in [{name}]{_hint(sub, known)}")
                out[f"{s.section}.{s.name}"] = _toml_value(s, f"{name}.{sub}", v, path)
        elif name in flat:
            s = flat[name]
            out[f"{s.section}.{s.name}"] = _toml_value(s, key, value, path)
        else:
            raise ValueError(f"--config {path!r}: unknown setting {key!r}{_hint(name, [*flat, *sections])}")
    return out


def _hint(name: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(name.replace("-", "_"), list(known), n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; the settings are {', '.join(sorted(set(known)))}"


def parse_args(argv: Sequence[str] | None = None) -> Config:
    """Defaults, then ``--config FILE``, then the flags; ``--print-config`` prints the result and exits."""
    p = _parser()
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if known.config:
        try:
            p.set_defaults(**load_config(known.config))
        except ValueError as exc:
            p.exit(2, f"error: {exc}\n")
    args = vars(p.parse_args(argv))
    if any(a == "--checkpoint" or a.startswith("--checkpoint=") for a in (sys.argv[1:] if argv is None else argv)):
        log.warning("note: --checkpoint is now --recompute (activation recompute); in pipeengine a checkpoint is a "
                    "saved training state (--save-interval)")
    args.pop("config")
    show = args.pop("print_config")
    cfg = Config()
    for s in settings():
        s.set(cfg, args[f"{s.section}.{s.name}"])
    if show:
        sys.stdout.write(to_toml(cfg))
        p.exit(0)
    return cfg


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """The command line: exit 0 done, 2 bad input, 3 an explained failure (a crash too, once rank 0 has shown its
    traceback), 128+N stopped by signal N, 1 a crash that could not be shown.

    After a failure the process group may hold waits that never end: the process ends without
    tearing it down (see runtime/faults.py), and only rank 0 shows a crash's traceback (other
    ranks' reach rank 0 through the store, see :func:`_crashed`). Every path ends with ``os._exit`` once the output is
    flushed: C++ objects of torch.distributed (store and Gloo threads) destroyed at interpreter
    exit sometimes abort the process ("terminate called without an active exception"), which
    would turn a finished run into a crash.
    """
    from .console import use_console
    use_console()
    cfg = parse_args(argv)
    from .trainer import run
    try:
        run(cfg)
    except SystemExit as exc:
        _end(_explained(exc.code if isinstance(exc.code, int) else 1))
    except BaseException:
        _end(_crashed())
    _end(0)


def _explained(code: int) -> int:
    """Exit ``code``; a rank other than 0 stopping over a failure published through the store (exit 3) first
    gives rank 0, the rank on screen, a few seconds to print it: the launcher stops every rank once one exits."""
    import torch.distributed as dist
    if code == 3 and dist.is_initialized() and dist.get_rank() != 0:
        from ..runtime.faults import SHOW_LIMIT, watch
        watch().wait_shown(SHOW_LIMIT)
    return code


def _crashed() -> int:
    """A crash: its traceback goes to this rank's output (the run folder's ranks/ under launch/pipe.sh), and
    the exit status is 3 when the failure is on screen: rank 0's own, or one published through the store as
    it left the engine (rank 0 prints it with its traceback), else 1."""
    import traceback

    import torch.distributed as dist

    from ..runtime.faults import EXPLAINED, SHOW_LIMIT, watch
    traceback.print_exc()
    if not dist.is_initialized():
        return 1
    if dist.get_rank() == 0:
        watch().mark_shown()
        return EXPLAINED
    return EXPLAINED if watch().wait_shown(SHOW_LIMIT) else 1


def _end(code: int) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
