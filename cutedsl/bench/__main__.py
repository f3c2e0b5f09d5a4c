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
        rc = importlib.import_module(f"cutedsl.bench.{name}").main(argv)
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
