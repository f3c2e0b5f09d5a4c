"""The pins, the Dockerfile, the Makefile and CI agree with each other (no Docker engine here)."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
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
    assert "quack-kernels" not in pins  # nothing imports it
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


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _exact(req: str) -> tuple[str, str]:
    name, sep, version = req.partition("==")
    assert sep and ";" not in version, f"pyproject: '{req}' is not an exact pin"
    return name.strip().lower(), version.strip()


def test_pyproject_declares_the_pins() -> None:
    """pyproject's dependencies and extras carry exactly requirements.txt's versions, and every
    pin is declared somewhere (core or an extra)."""
    proj = _pyproject()["project"]
    pins = _pins()
    core = dict(_exact(r) for r in proj["dependencies"])
    assert set(core) == {"torch", "nvidia-cutlass-dsl", "apache-tvm-ffi", "safetensors"}
    declared = dict(core)
    for extra, reqs in proj["optional-dependencies"].items():
        for name, version in map(_exact, reqs):
            assert declared.setdefault(name, version) == version, (extra, name)
    for name, version in declared.items():
        assert pins.get(name) == version, (
            f"pyproject {name}=={version}, requirements.txt {pins.get(name)}"
        )
    assert set(pins) == set(declared), sorted(set(pins) ^ set(declared))
    assert "vllm" in dict(map(_exact, proj["optional-dependencies"]["serve"]))


def test_package_metadata_scripts_and_license() -> None:
    proj = _pyproject()["project"]
    assert proj["license"] == "Apache-2.0" and proj["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    # The unmodified Apache-2.0 text (as apache.org publishes it).
    assert hashlib.md5((REPO / "LICENSE").read_bytes()).hexdigest() == (
        "86d3f3a95c324c9479bd8986968f4327"
    )
    scripts = proj["scripts"]
    assert set(scripts) == {
        "dsv4-tiny-model",
        "dsv4-quantize",
        "dsv4-golden",
        "dsv4-check-kernels",
        "dsv4-prewarm-mhc",
        "dsv4-prewarm-kernels",
        "dsv4-apply-patches",
    }
    import importlib

    for target in scripts.values():
        module, _, func = target.partition(":")
        assert callable(getattr(importlib.import_module(module), func)), target
    data = _pyproject()["tool"]["setuptools"]["data-files"]
    assert data["share/cutedsl"] == ["apply_patches.sh"]
    assert (REPO / "vllm_patches" / "UPSTREAM").is_file()


def test_make_help_is_the_default_and_lists_every_target() -> None:
    mk = (REPO / "Makefile").read_text()
    targets = re.findall(r"^([a-z][a-z-]*):", mk, re.M)
    r = subprocess.run(["make", "-s", "-C", str(REPO)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    listed = {ln.split()[0] for ln in r.stdout.splitlines()[1:] if ln.strip()}
    assert listed == set(targets), sorted(set(targets) ^ listed)
    assert "pip install" not in r.stdout and "apply_patches" not in r.stdout
    assert re.search(r"^test-gpu:.*\n\t.*--require-gpu-tests", mk, re.M)


def test_test_gpu_fails_when_no_gpu_test_ran(tmp_path: Path) -> None:
    """`make test-gpu`'s pytest option turns "all GPU tests skipped" into a failure, and leaves a
    run in which a GPU-marked test ran alone."""
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (tmp_path / "test_g.py").write_text(
        "import pytest\n"
        "@pytest.mark.gpu\n"
        "def test_on_gpu():\n    pass\n"
        "@pytest.mark.skip(reason='x')\n@pytest.mark.gpu\n"
        "def test_skipped():\n    pass\n"
        "def test_cpu():\n    pass\n"
    )
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu"]
    base += ["--rootdir", str(tmp_path), str(tmp_path)]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU: every gpu test skips
    r = subprocess.run(
        [*base, "--require-gpu-tests"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 1, r.stdout
    assert "no GPU test ran (2 skipped)" in r.stdout
    r = subprocess.run(base, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stdout  # without the option a skip-only run stays green
    # With a (pretended) GPU the gpu-marked test runs, and the option is satisfied.
    (tmp_path / "conftest.py").write_text(
        (REPO / "tests" / "conftest.py").read_text()
        + "\n\ndef _device_capability():\n    return (9, 0)\n"
    )
    r = subprocess.run(
        [*base, "--require-gpu-tests"], capture_output=True, text=True, env=env, cwd=tmp_path,
        timeout=120,
    )  # fmt: skip
    assert r.returncode == 0 and "1 passed, 1 skipped, 1 deselected" in r.stdout, r.stdout


def test_failed_test_reports_its_seed(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (tmp_path / "test_s.py").write_text(
        "import torch\n"
        "def test_fails():\n"
        "    print('first', float(torch.rand(())))\n"
        "    assert False\n"
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)]
    runs = []
    for seed in ("1234", "1234", "99"):
        env = dict(os.environ, CUTEDSL_TEST_SEED=seed)
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
        assert r.returncode == 1
        assert f"seed={seed} (CUTEDSL_TEST_SEED={seed} to reproduce)" in r.stdout, r.stdout
        runs.append(re.search(r"first (\S+)", r.stdout).group(1))
    assert runs[0] == runs[1] != runs[2]  # the seed reproduces the test's random data
    env = {k: v for k, v in os.environ.items() if k != "CUTEDSL_TEST_SEED"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    seed = re.search(r"seed=(\d+) \(CUTEDSL_TEST_SEED=\1 to reproduce\)", r.stdout)
    assert seed, r.stdout
    env["CUTEDSL_TEST_SEED"] = seed.group(1)
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert re.search(r"first (\S+)", again.stdout).group(1) == re.search(
        r"first (\S+)", r.stdout
    ).group(1)


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
