"""Overlay this package's two DeepSeek V4 files onto the installed vLLM 0.21.0 (or check, revert
or diff them): runs apply_patches.sh with the Python of this command.

    dsv4-apply-patches [--check | --revert | --diff] [--vllm-root DIR]

From a git checkout it runs the checkout's apply_patches.sh; from an installed wheel, the copy
of apply_patches.sh and vllm_patches/ the wheel installed under <prefix>/share/cutedsl (the
package itself is then already importable, so the script's editable install is skipped).
Every argument is passed on; `dsv4-apply-patches --help` shows the script's own help.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["script", "main"]


def script() -> tuple[Path, list[str]]:
    """(apply_patches.sh to run, extra arguments) for this installation."""
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "apply_patches.sh").is_file() and (checkout / "vllm_patches").is_dir():
        return checkout / "apply_patches.sh", []
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        shared = Path(prefix) / "share" / "cutedsl"
        if (shared / "apply_patches.sh").is_file() and (shared / "vllm_patches").is_dir():
            return shared / "apply_patches.sh", ["--no-install"]
    raise FileNotFoundError(
        "apply_patches.sh and vllm_patches/ are neither in a checkout beside this package nor "
        f"under {Path(sys.prefix) / 'share' / 'cutedsl'}; reinstall cutedsl"
    )


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        path, extra = script()
    except FileNotFoundError as e:
        print(f"dsv4-apply-patches: error: {e}", file=sys.stderr)
        return 2
    if any(a in ("-h", "--help", "--check", "--diff") for a in args):
        extra = []  # --no-install only matters when applying
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(["bash", str(path), *args, *extra], env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
