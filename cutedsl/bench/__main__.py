"""`python -m cutedsl.bench` (`make bench`): run the kernel benchmarks, in order, on a Hopper GPU.

The benchmarks are BENCHMARKS, each also runnable alone as `python -m cutedsl.bench.NAME` (see its
--help). --json / --md PATH are forwarded to every benchmark run, with the benchmark's name put
before the extension when several run (r.json -> r.gemm_sm90.json, r.swiglu.json), so that they
do not overwrite each other's files. Arguments after `--` go to every benchmark run as they are
(with --only, the options of that benchmark); each benchmark checks them before any of them runs.
The table tools `merge_gemm` and `tune_sm90` are not benchmarks: run them alone on JSON files.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from cutedsl.bench.common import gpu_problem, make_parser

BENCHMARKS = ("gemm_sm90", "swiglu")
TOOLS = ("merge_gemm", "tune_sm90")  # table tools: `python -m cutedsl.bench.NAME FILES ...`
OUTPUT_FLAGS = ("--json", "--md")
EXAMPLES = [
    "python -m cutedsl.bench --list",
    "python -m cutedsl.bench --json r/bench.json --md r/bench.md   # r/bench.gemm_sm90.json, ...",
    "python -m cutedsl.bench --only swiglu",
    "python -m cutedsl.bench --only gemm_sm90 --json r/gemm.json -- --model flash --ms 1,16",
    "python -m cutedsl.bench.gemm_sm90 --help   # one benchmark's own options",
]


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


def _only(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    bad = [x for x in names if x not in BENCHMARKS]
    if bad or not names:
        hint = (
            " (a table tool: run it as python -m cutedsl.bench.NAME)"
            if set(bad) & set(TOOLS)
            else ""
        )
        raise argparse.ArgumentTypeError(
            f"{text!r}: unknown benchmark {bad}, expected of {list(BENCHMARKS)}{hint}"
        )
    return names


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(the runner's options, the arguments after `--`)."""
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1 :]
    p = make_parser("cutedsl.bench", __doc__, EXAMPLES)
    p.add_argument("--list", action="store_true", help="print the benchmarks and exit")
    p.add_argument(
        "--only",
        type=_only,
        action="extend",
        default=[],
        metavar="NAME[,NAME]",
        help=f"run only these benchmarks (repeatable; of {', '.join(BENCHMARKS)})",
    )
    p.add_argument("--json", metavar="PATH", help="each benchmark's JSON (tagged with its name)")
    p.add_argument("--md", metavar="PATH", help="each benchmark's Markdown (tagged with its name)")
    return p.parse_args(argv), rest


def main(argv: list[str] | None = None) -> int:
    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    if args.list:
        print("\n".join(BENCHMARKS))
        return 0
    names = [n for n in BENCHMARKS if n in args.only] if args.only else list(BENCHMARKS)
    common = [x for flag in OUTPUT_FLAGS if (v := getattr(args, flag[2:])) for x in (flag, v)]
    forwarded = {}
    for name in names:  # every benchmark's arguments are checked before any runs (exit 2)
        forwarded[name] = (
            per_bench_outputs(common + rest, name) if len(names) > 1 else common + rest
        )
        importlib.import_module(f"cutedsl.bench.{name}").parse_args(forwarded[name])
    problem = gpu_problem()
    if problem:
        print(f"cutedsl.bench: {problem}", file=sys.stderr)
        return 1
    failed = []
    for name in names:
        print(f"== python -m cutedsl.bench.{name} {' '.join(forwarded[name])}".rstrip(), flush=True)
        if importlib.import_module(f"cutedsl.bench.{name}").main(forwarded[name]):
            failed.append(name)
    if failed:
        print(f"cutedsl.bench: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
