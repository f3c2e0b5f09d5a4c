"""`python -m cutedsl.bench`: run every kernel benchmark that exists (GPU), or list them.

python -m cutedsl.bench [--list] [ARGS passed to each benchmark]
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import cutedsl.bench as pkg


def benchmarks() -> list[str]:
    return sorted(
        m.name
        for m in pkgutil.iter_modules(pkg.__path__)
        if not m.name.startswith("_") and m.name != "common"
    )


OUTPUT_FLAGS = ("--json", "--md")


def per_bench_outputs(argv: list[str], name: str) -> list[str]:
    """argv with every --json / --md path made per benchmark (F.json -> F.NAME.json), so that the
    benchmarks of one run do not overwrite each other's files."""
    out = []
    for i, a in enumerate(argv):
        flag, eq, val = a.partition("=")
        if eq and flag in OUTPUT_FLAGS:
            out.append(f"{flag}={_tag(val, name)}")
        elif i > 0 and argv[i - 1] in OUTPUT_FLAGS:
            out.append(_tag(a, name))
        else:
            out.append(a)
    return out


def _tag(path: str, name: str) -> str:
    stem, dot, ext = path.rpartition(".")
    return f"{stem}.{name}.{ext}" if dot and "/" not in ext else f"{path}.{name}"


def main(argv: list[str]) -> int:
    names = benchmarks()
    if "--list" in argv:
        print("\n".join(names) or "(none)")
        return 0
    if not names:
        print(
            "cutedsl.bench: no kernel benchmark has landed yet (issue 5 brings the SM90 GEMM bench)",
            file=sys.stderr,
        )
        return 1
    for name in names:
        print(f"== cutedsl.bench.{name}", flush=True)
        args = per_bench_outputs(argv, name) if len(names) > 1 else argv
        rc = importlib.import_module(f"cutedsl.bench.{name}").main(args)
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
