"""Compile every CuTeDSL kernel for its arch on a machine without a GPU and check the instructions.

    dsv4-check-kernels [--arch sm_90a|sm_100a] [--only SUBSTR] [--list] [--json F]
    (or python -m cutedsl.tools.check_kernels ...)

Each target (`cutedsl.kernels.checks.KernelTarget`) compiles in a fresh subprocess with
`CUTE_DSL_ARCH=<arch>` and the PTX/cubin dumped to a temporary directory; the PTX must match every
`ptx_patterns` regex and none of its `absent_patterns`, and the SASS (cuobjdump of the cubin) every
`sass_patterns` regex.
Exit status 0 only when every selected target compiled and matched.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from cutedsl.kernels.checks import KERNEL_MODULES, KernelTarget
from cutedsl.tools import cli
from cutedsl.tools.cli import UsageError


@dataclass
class Result:
    name: str
    arch: str
    ok: bool
    seconds: float
    missing: list[str] = field(default_factory=list)
    error: str = ""


def collect(modules: tuple[str, ...] = KERNEL_MODULES) -> list[tuple[str, KernelTarget]]:
    """(module, target) for every target of every kernel module; a module that fails to import
    is an error, not a silent omission."""
    out = []
    for mod in modules:
        targets = importlib.import_module(mod).check_targets()
        if not targets:
            raise RuntimeError(f"{mod}.check_targets() returned no targets")
        out += [(mod, t) for t in targets]
    names = [t.name for _, t in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise RuntimeError(f"duplicate kernel target names: {sorted(dup)}")
    return out


def _cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton  # ships cuobjdump/nvdisasm for its own use

        cand = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        return str(cand) if cand.exists() else None
    except ImportError:
        return None


def _cuobjdump_out(cubins: list[Path], flag: str) -> str:
    """`cuobjdump FLAG` of every cubin, concatenated."""
    tool = _cuobjdump()
    if tool is None:
        raise RuntimeError("cuobjdump not found (install triton or the CUDA toolkit)")
    return "\n".join(
        subprocess.run([tool, flag, str(c)], capture_output=True, text=True, check=True).stdout
        for c in cubins
    )


def _registers(cubins: list[Path]) -> int:
    """The most registers per thread of any kernel in the cubins (cuobjdump resource usage)."""
    regs = [
        int(x) for x in re.findall(r"REG:(\d+)", _cuobjdump_out(cubins, "--dump-resource-usage"))
    ]
    if not regs:
        raise RuntimeError(f"no REG: count in the resource usage of {[c.name for c in cubins]}")
    return max(regs)


def run_target(module: str, target: KernelTarget, timeout_s: float = 600.0) -> Result:
    with tempfile.TemporaryDirectory(prefix="cutedsl-check-") as dump:
        env = dict(
            os.environ,
            CUTE_DSL_ARCH=target.arch,
            CUTE_DSL_KEEP_PTX="1",
            CUTE_DSL_KEEP_CUBIN="1",
            CUTE_DSL_DUMP_DIR=dump,
        )
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "cutedsl.tools.check_kernels", "--_child", module, target.name],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        secs = time.perf_counter() - t0
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
            return Result(target.name, target.arch, False, secs, error="\n".join(tail))
        ptx_files = sorted(Path(dump).rglob("*.ptx"))
        cubins = sorted(Path(dump).rglob("*.cubin"))
        if not ptx_files:
            return Result(target.name, target.arch, False, secs, error="no PTX was dumped")
        ptx = "\n".join(p.read_text(errors="replace") for p in ptx_files)
        arch_num = target.arch.removeprefix("sm_")
        missing = [p for p in target.ptx_patterns if not re.search(p, ptx)]
        missing += [f"no PTX {p}" for p in target.absent_patterns if re.search(p, ptx)]
        if not re.search(rf"\.target\s+sm_{arch_num}\b", ptx):
            missing.append(f"PTX .target sm_{arch_num}")
        if target.sass_patterns:
            if not cubins:
                return Result(target.name, target.arch, False, secs, error="no cubin was dumped")
            sass = _cuobjdump_out(cubins, "-sass")
            missing += [f"SASS {p}" for p in target.sass_patterns if not re.search(p, sass)]
        if target.max_registers is not None:
            if not cubins:
                return Result(target.name, target.arch, False, secs, error="no cubin was dumped")
            regs = _registers(cubins)
            if regs > target.max_registers:
                missing.append(f"<= {target.max_registers} registers per thread (uses {regs})")
        return Result(target.name, target.arch, not missing, secs, missing=missing)


def _child(module: str, name: str) -> None:
    for t in importlib.import_module(module).check_targets():
        if t.name == name:
            t.compile()
            return
    raise SystemExit(f"no target {name!r} in {module}")


def main(argv: list[str] | None = None) -> int:
    ap = cli.make_parser("cutedsl.tools.check_kernels", "dsv4-check-kernels", __doc__)
    ap.add_argument("--arch", choices=["sm_90a", "sm_100a"], help="only the targets of this arch")
    ap.add_argument("--only", metavar="SUBSTR", help="only targets whose name contains SUBSTR")
    ap.add_argument("--list", action="store_true", help="list the targets and exit")
    ap.add_argument("--json", type=Path, help="write the results to this file")
    ap.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._child:
        _child(*args._child)
        return 0
    return cli.run(ap.prog, lambda: _main(args), args.debug)


def _main(args: argparse.Namespace) -> int:
    if args.json is not None:
        parent = args.json.resolve().parent
        if args.json.is_dir():
            raise UsageError(f"--json {args.json} is a folder; give a file name")
        if not parent.is_dir():
            raise UsageError(f"--json {args.json}: folder {parent} does not exist")
    targets = [
        (m, t)
        for m, t in collect()
        if (args.arch is None or t.arch == args.arch) and (args.only is None or args.only in t.name)
    ]
    if args.list:
        for m, t in targets:
            print(f"{t.arch:8s} {t.name:48s} {m}")
        return 0
    if not targets:
        sel = " ".join(f"--{k} {v}" for k, v in (("arch", args.arch), ("only", args.only)) if v)
        raise UsageError(f"{sel or 'the selection'}: no kernel target matches (--list shows them)")
    results = []
    print(f"{'target':48s} {'arch':8s} {'compile s':>9s}  result")
    for m, t in targets:
        r = run_target(m, t)
        results.append(r)
        verdict = "ok" if r.ok else "FAIL " + (r.error or "missing: " + ", ".join(r.missing))
        print(f"{r.name:48s} {r.arch:8s} {r.seconds:9.1f}  {verdict}", flush=True)
    n_bad = sum(not r.ok for r in results)
    print(f"{len(results) - n_bad} passed, {n_bad} failed")
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in results], indent=2))
    return 0 if n_bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
