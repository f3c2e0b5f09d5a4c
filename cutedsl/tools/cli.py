"""What every command-line tool of this package shares.

- Errors a user can fix (a bad argument, a missing or malformed input, an output that would
  destroy something) print one line `PROG: error: ...` naming the argument, file or tensor and
  exit 2; anything else prints one line and exits 1. `--debug` adds the traceback.
- `--version` prints the package version and the versions it is pinned to.
- SIGTERM and SIGINT raise `Interrupted` (a BaseException), so the tools' `finally`/`except
  BaseException` blocks remove their temporary folders before the process exits (128 + signal).
- `output_mode()`: the permissions a new file or folder gets under the user's umask.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as md
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = [
    "EXIT_USAGE",
    "UsageError",
    "Interrupted",
    "Parser",
    "make_parser",
    "run",
    "pins",
    "version_text",
    "umask",
    "output_mode",
    "is_within",
]

EXIT_USAGE = 2
DIST = "cutedsl"


class UsageError(ValueError):
    """An error the user can fix: bad argument, input or output. Printed as one line, exit 2."""


class Interrupted(BaseException):
    """SIGTERM/SIGINT arrived; raised in the main thread so cleanup code runs."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# --------------------------------------------------------------------------------------------
# Versions


def _requirements_file() -> Path | None:
    """requirements.txt of the checkout this package runs from, if it runs from one."""
    p = Path(__file__).resolve().parents[2] / "requirements.txt"
    return p if p.is_file() else None


def pins() -> dict[str, str]:
    """{distribution: pinned version}: the checkout's requirements.txt, else the installed
    package's declared requirements (its extras included)."""
    lines: list[str] = []
    req = _requirements_file()
    if req is not None:
        lines = [ln.split("#")[0].strip() for ln in req.read_text().splitlines()]
    else:
        with contextlib.suppress(md.PackageNotFoundError):
            lines = [r.split(";")[0].strip() for r in md.requires(DIST) or []]
    out: dict[str, str] = {}
    for ln in lines:
        name, sep, ver = ln.partition("==")
        if sep:
            out.setdefault(name.strip().lower(), ver.strip())
    return out


def version_text() -> str:
    """`cutedsl X (pinned: a==1, b==2 [installed 3], ...)`."""
    try:
        ver = md.version(DIST)
    except md.PackageNotFoundError:
        from cutedsl import __version__ as ver
    parts = []
    for name, want in pins().items():
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            have = None
        if have is None:
            note = " [not installed]"
        else:
            note = "" if have.split("+")[0] == want else f" [installed {have}]"
        parts.append(f"{name}=={want}{note}")
    return f"{DIST} {ver} (pinned: {', '.join(parts) or 'unknown'})"


# --------------------------------------------------------------------------------------------
# Parsing


class Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (`PROG: error: MSG (see --help)`, exit 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {_one_line(message)} (see --help)\n")


def make_parser(module: str, script: str, doc: str | None) -> Parser:
    """The parser of tool `module` (console script `script`), with --debug and --version."""
    prog = script if os.path.basename(sys.argv[0] or "") == script else f"python -m {module}"
    ap = Parser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--debug", action="store_true", help="on an error, also print the Python traceback"
    )
    ap.add_argument(
        "--version",
        action="version",
        version=version_text(),
        help="print the package version and the pinned versions, then exit",
    )
    return ap


# --------------------------------------------------------------------------------------------
# Running


def _one_line(msg: str) -> str:
    return "; ".join(x.strip() for x in str(msg).splitlines() if x.strip()) or "(no message)"


_USER_ERRORS = (
    UsageError,
    FileExistsError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
)


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM and SIGINT raise Interrupted in the main thread while the block runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run(prog: str, body: Callable[[], int], debug: bool = False) -> int:
    """Run `body`; turn exceptions into one line on stderr and an exit status."""
    try:
        with _signals_raise():
            return body()
    except (Interrupted, KeyboardInterrupt) as e:
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        if debug:
            traceback.print_exc()
        name = signal.Signals(signum).name
        print(f"{prog}: interrupted by {name}; temporary files removed", file=sys.stderr)
        return 128 + int(signum)
    except _USER_ERRORS as e:
        if debug:
            traceback.print_exc()
        print(f"{prog}: error: {_one_line(str(e))}", file=sys.stderr)
        return EXIT_USAGE
    except ModuleNotFoundError as e:
        if debug:
            traceback.print_exc()
        print(
            f"{prog}: error: Python module {e.name!r} is not installed "
            f"(pip install 'cutedsl[tools]' installs what the tools need)",
            file=sys.stderr,
        )
        return 1
    except Exception as e:
        if debug:
            traceback.print_exc()
        hint = "" if debug else " (--debug shows the traceback)"
        print(f"{prog}: error: {type(e).__name__}: {_one_line(str(e))}{hint}", file=sys.stderr)
        return 1


# --------------------------------------------------------------------------------------------
# Files


def umask() -> int:
    """The process umask (read without changing it where /proc allows)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def output_mode(directory: bool) -> int:
    """The mode open()/mkdir() would give a new file/folder under the current umask."""
    return (0o777 if directory else 0o666) & ~umask()


def is_within(path: str | os.PathLike, root: str | os.PathLike) -> bool:
    """True when `path` is `root` or lies below it (both resolved through symlinks)."""
    p, r = os.path.realpath(path), os.path.realpath(root)
    return p == r or p.startswith(r.rstrip(os.sep) + os.sep)
