"""apply_patches.sh on the real pinned vLLM 0.21.0 files.

Most tests work on a copy of the installed vLLM's files (the overlaid files and _version.py)
in a temporary `vllm/` tree, so they can tamper with it; `test_real_install_is_applied` checks the
venv's own install, which `make setup` patched.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _manifest() -> tuple[str, list[tuple[str, str, str]]]:
    version, entries = "", []
    for line in (REPO / "vllm_patches" / "UPSTREAM").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        a, b, *c = line.split()
        if a == "vllm_version":
            version = b
        else:
            entries.append((a, b, c[0]))
    return version, entries


VERSION, ENTRIES = _manifest()


def _installed_vllm() -> Path:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vllm is not installed"
    return Path(spec.submodule_search_locations[0])


def _pristine(rel: str) -> Path:
    """The installed pristine file: the backup while the overlay is applied."""
    root = _installed_vllm()
    backup = root / ".cutedsl_pristine" / rel
    return backup if backup.exists() else root / rel


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture
def fake_vllm(tmp_path: Path) -> Path:
    root = tmp_path / "site" / "vllm"
    for _, rel, _ in ENTRIES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(_pristine(rel), root / rel)
    shutil.copy2(_installed_vllm() / "_version.py", root / "_version.py")
    return root


@pytest.fixture
def repo_copy(tmp_path: Path) -> Path:
    """apply_patches.sh + vllm_patches/ in a scratch dir, so a test may edit overlays. Each
    overlay gets one extra line, so it differs from upstream even before our hooks exist."""
    dst = tmp_path / "repo"
    dst.mkdir()
    shutil.copy2(REPO / "apply_patches.sh", dst)
    shutil.copytree(REPO / "vllm_patches", dst / "vllm_patches")
    for name, _, _ in ENTRIES:
        ov = dst / "vllm_patches" / name
        ov.write_text(ov.read_text() + "# cutedsl test marker\n")
    return dst


def _run(script_dir: Path, root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(
        [
            "bash",
            str(script_dir / "apply_patches.sh"),
            "--vllm-root",
            str(root),
            "--no-install",
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
    )


def test_manifest_pins_the_installed_vllm() -> None:
    import importlib.metadata as md

    assert md.version("vllm") == VERSION == "0.21.0"
    names = sorted(n for n, _, _ in ENTRIES)
    assert names == [
        "deepseek_compressor.py",
        "deepseek_v4.py",
        "deepseek_v4_attention.py",
        "sparse_swa.py",
    ]
    for _, rel, sha in ENTRIES:
        assert _sha(_pristine(rel)) == sha, f"pristine {rel} differs from the manifest"


def test_apply_check_revert_roundtrip(fake_vllm: Path, repo_copy: Path) -> None:
    before = _snapshot(fake_vllm)
    r = _run(repo_copy, fake_vllm, "--check")
    assert r.returncode == 1 and "not applied" in r.stdout, r.stdout + r.stderr

    r = _run(repo_copy, fake_vllm)
    assert r.returncode == 0, r.stderr
    r = _run(repo_copy, fake_vllm, "--check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("applied") == len(ENTRIES) and "not applied" not in r.stdout
    for name, rel, _ in ENTRIES:
        assert (fake_vllm / rel).read_bytes() == (repo_copy / "vllm_patches" / name).read_bytes()

    applied = _snapshot(fake_vllm)
    r = _run(repo_copy, fake_vllm)  # idempotent
    assert r.returncode == 0, r.stderr
    assert _snapshot(fake_vllm) == applied

    r = _run(repo_copy, fake_vllm, "--revert")
    assert r.returncode == 0, r.stderr
    assert _snapshot(fake_vllm) == before, "revert is not byte-identical to upstream"
    assert not (fake_vllm / ".cutedsl_pristine").exists()


def test_apply_then_revert_with_a_changed_overlay(fake_vllm: Path, repo_copy: Path) -> None:
    before = _snapshot(fake_vllm)
    ov = repo_copy / "vllm_patches" / ENTRIES[0][0]
    ov.write_text(ov.read_text() + "\n# local change\n")
    assert _run(repo_copy, fake_vllm).returncode == 0
    assert (fake_vllm / ENTRIES[0][1]).read_bytes() == ov.read_bytes()
    r = _run(repo_copy, fake_vllm, "--check")
    assert r.returncode == 0, r.stdout
    # Edit the overlay again: the install is now stale, apply brings it up to date.
    ov.write_text(ov.read_text() + "# second change\n")
    r = _run(repo_copy, fake_vllm, "--check")
    assert r.returncode == 2 and "drifted" in r.stdout, r.stdout
    assert _run(repo_copy, fake_vllm).returncode == 0
    assert (fake_vllm / ENTRIES[0][1]).read_bytes() == ov.read_bytes()
    assert _run(repo_copy, fake_vllm, "--revert").returncode == 0
    assert _snapshot(fake_vllm) == before


def test_wrong_vllm_version_is_refused_and_nothing_changes(fake_vllm: Path) -> None:
    v = fake_vllm / "_version.py"
    v.write_text(v.read_text().replace(f"'{VERSION}'", "'0.21.1'"))
    before = _snapshot(fake_vllm)
    r = _run(REPO, fake_vllm)
    assert r.returncode != 0
    assert "expected 0.21.0, found 0.21.1" in r.stderr, r.stderr
    assert _snapshot(fake_vllm) == before


def test_tampered_pristine_file_is_refused_and_nothing_changes(fake_vllm: Path) -> None:
    # Tamper the second file: the first must not be applied either (all or nothing).
    target = fake_vllm / ENTRIES[1][1]
    target.write_bytes(target.read_bytes() + b"\n# tampered\n")
    before = _snapshot(fake_vllm)
    r = _run(REPO, fake_vllm)
    assert r.returncode != 0
    assert ENTRIES[1][2] in r.stderr and "found" in r.stderr, r.stderr
    assert _snapshot(fake_vllm) == before
    r = _run(REPO, fake_vllm, "--check")
    assert r.returncode == 2 and "drifted" in r.stdout


def test_tampered_backup_is_refused_on_revert(fake_vllm: Path, repo_copy: Path) -> None:
    assert _run(repo_copy, fake_vllm).returncode == 0
    backup = fake_vllm / ".cutedsl_pristine" / ENTRIES[0][1]
    backup.write_bytes(backup.read_bytes() + b"# x\n")
    before = _snapshot(fake_vllm)
    r = _run(repo_copy, fake_vllm, "--revert")
    assert r.returncode != 0 and "modified" in r.stderr, r.stderr
    assert _snapshot(fake_vllm) == before


def test_failure_midway_rolls_back(fake_vllm: Path, repo_copy: Path) -> None:
    """A failure on the second file leaves the first as it was (no half-applied install): the
    second file's temporary name is occupied by a directory, so its rename fails after the first
    file was already replaced (works as root, unlike a permission trick)."""
    before = _snapshot(fake_vllm)
    # Make the destination of the second replace unwritable by turning its tmp name into a dir.
    blocker = fake_vllm / (ENTRIES[1][1] + ".cutedsl-tmp")
    blocker.mkdir()
    (blocker / "x").write_text("x")
    r = _run(repo_copy, fake_vllm)
    shutil.rmtree(blocker)
    assert r.returncode != 0
    assert "rolled back 1 file" in r.stderr, r.stderr
    after = {k: v for k, v in _snapshot(fake_vllm).items() if not k.startswith(".cutedsl_pristine")}
    assert after == before


def test_diff_is_empty_for_unchanged_overlays_and_shows_an_edit(
    fake_vllm: Path, repo_copy: Path
) -> None:
    for name, rel, _ in ENTRIES:
        shutil.copy2(fake_vllm / rel, repo_copy / "vllm_patches" / name)
    r = _run(repo_copy, fake_vllm, "--diff")
    assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr

    name, rel, _ = ENTRIES[1]
    ov = repo_copy / "vllm_patches" / name
    lines = ov.read_text().splitlines(keepends=True)
    i = next(k for k, line in enumerate(lines) if line.startswith("class "))
    lines.insert(i, "# cutedsl: hook here\n")
    ov.write_text("".join(lines))
    r = _run(repo_copy, fake_vllm, "--diff")
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0] == f"--- a/vllm/{rel}" and out[1] == f"+++ b/vllm_patches/{name}"
    added = [x for x in out if x.startswith("+") and not x.startswith("+++")]
    removed = [x for x in out if x.startswith("-") and not x.startswith("---")]
    assert added == ["+# cutedsl: hook here"] and removed == []
    # Applying the edited overlay does not change what the diff shows.
    assert _run(repo_copy, fake_vllm).returncode == 0
    assert _run(repo_copy, fake_vllm, "--diff").stdout == r.stdout


def test_real_install_is_applied() -> None:
    """`make setup` applied the overlay to the venv's vLLM; the files there are ours."""
    r = subprocess.run(
        ["bash", str(REPO / "apply_patches.sh"), "--check"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHON=sys.executable),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    root = _installed_vllm()
    for name, rel, _ in ENTRIES:
        assert (root / rel).read_bytes() == (REPO / "vllm_patches" / name).read_bytes()


def test_cutedsl_imports_from_this_checkout_without_a_gpu() -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import cutedsl, torch; print(cutedsl.__file__, torch.cuda.is_available())",
        ],
        capture_output=True,
        text=True,
        cwd="/",
    )
    assert r.returncode == 0, r.stderr
    path, cuda = r.stdout.split()
    assert Path(path).resolve().is_relative_to(REPO / "cutedsl")
    assert cuda == "False"
