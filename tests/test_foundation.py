"""The pins, the Dockerfile, the Makefile and CI agree with each other (no Docker engine here)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"requirements.txt: '{line}' is not an exact pin"
            pins[name.lower()] = version
    return pins


def test_pins_are_the_projects() -> None:
    pins = _pins()
    assert pins["vllm"] == "0.21.0"
    assert pins["torch"] == "2.11.0"
    assert pins["nvidia-cutlass-dsl"] == "4.4.2"
    assert pins["apache-tvm-ffi"] == "0.1.9"
    assert pins["quack-kernels"] == "0.3.3"
    assert pins["xgrammar"] == "0.2.0"
    assert pins["transformers"] == "5.17.0"
    assert {"safetensors", "pytest", "ruff"} <= pins.keys()


def test_installed_versions_equal_the_pins() -> None:
    import importlib.metadata as md

    for name, version in _pins().items():
        assert md.version(name).split("+")[0] == version, name


def test_dockerfile_matches_pins_and_apply_step() -> None:
    text = (REPO / "Dockerfile").read_text()
    base = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert base == [f"vllm/vllm-openai:v{_pins()['vllm']}"]
    assert "requirements.txt" in text and "pip install" in text
    assert re.search(r"^RUN .*bash apply_patches\.sh", text, re.M)
    assert "ENTRYPOINT" in text and "scripts/serve.sh" in text


def test_makefile_and_ci_use_the_same_commands() -> None:
    mk = (REPO / "Makefile").read_text()
    for target in (
        "setup",
        "test",
        "diff",
        "serve",
        "build",
        "run",
        "bench",
        "check-kernels",
        "lint",
    ):
        assert re.search(rf"^{re.escape(target)}:", mk, re.M), f"Makefile lacks '{target}'"
    assert "-r requirements.txt" in mk and "apply_patches.sh" in mk
    ci = (REPO / ".ci" / "run").read_text()
    assert "make test" in ci
    readme = (REPO / "README.md").read_text()
    assert "make test" in readme and "make serve" in readme


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU"
)
def test_serve_script_refuses_without_gpu(tmp_path: Path) -> None:
    r = subprocess.run(
        ["bash", str(REPO / "scripts" / "serve.sh"), str(tmp_path)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHON=sys.executable),
        timeout=120,
    )
    assert r.returncode == 1
    assert "no CUDA GPU" in r.stderr
