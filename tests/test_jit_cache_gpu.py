"""The disk cache on a Hopper GPU, across processes: kernels one process compiled and stored are
loaded (not compiled) by the next and give bit-identical outputs; kernels the compile pool built
without a GPU (`jit.prefetch`, no JIT engine) give the same bits as kernels compiled in process
with one. Each process runs the same launches on the same seeded inputs (the seed is fresh per
test run) and saves its outputs; the test compares them."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import json, sys, torch
from cutedsl import jit
from cutedsl.sm90 import gemm, swiglu
from cutedsl.sm90.tactics import Tactic
from cutedsl.sm90.weight import prepare_weight

seed, mode, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
VARIANTS = [(Tactic(128, 16), False), (Tactic(64, 32, 2), False), (Tactic(128, 64), True)]
if mode == "prefetch":
    jit.prefetch(gemm.jobs(VARIANTS) + [swiglu.job(10.0)], workers=2)
g = torch.Generator(device="cuda").manual_seed(seed)
n, k, e = 512, 1024, 4
def weight(groups):
    packed = torch.randint(0, 256, (groups * n, k // 2), generator=g, device="cuda", dtype=torch.uint8)
    sf = (torch.rand(groups * n, k // 16, generator=g, device="cuda") * 2 + 0.25).to(torch.float8_e4m3fn)
    return prepare_weight(packed, sf, torch.full((groups,), 0.01, device="cuda"), groups=groups)
res = {}
a = torch.randn(48, k, generator=g, device="cuda").to(torch.bfloat16)
wp = weight(1)
for t, moe in VARIANTS[:2]:
    res[str(t)] = gemm.linear(a, wp, tactic=t)
we = weight(e)
offs = torch.tensor([0, 10, 10, 40, 48], dtype=torch.int32, device="cuda")
res["moe"] = gemm.moe(a, offs, we, tactic=VARIANTS[2][0])
h = torch.randn(48, 2 * 256, generator=g, device="cuda").to(torch.bfloat16) * 8
res["swiglu"] = swiglu.swiglu_clamp(h, 10.0, torch.empty(48, 256, dtype=torch.bfloat16, device="cuda"))
torch.cuda.synchronize()
torch.save({k: v.cpu() for k, v in res.items()}, out)
print(json.dumps({"compiles": jit.compile_count(), "loads": jit.load_count()}))
"""


def _run(tmp_path: Path, seed: int, mode: str, cache: Path, name: str) -> tuple[dict, dict]:
    out = tmp_path / f"{name}.pt"
    env = dict(os.environ, CUTEDSL_CACHE_DIR=str(cache))
    env.pop("CUTE_DSL_ARCH", None)
    if mode == "nocache":
        env["CUTEDSL_CACHE"] = "0"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(seed), mode, str(out)], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    return counts, torch.load(out)


def _same_bits(x: dict, y: dict) -> None:
    assert x.keys() == y.keys()
    for k in x:
        assert torch.equal(x[k].view(torch.int16), y[k].view(torch.int16)), k
        assert torch.isfinite(x[k].float()).all(), k


@pytest.mark.sm90
def test_stored_kernels_load_in_a_second_process_with_identical_outputs(tmp_path: Path) -> None:
    seed = random.getrandbits(31)
    cache = tmp_path / "cache"
    first, out1 = _run(tmp_path, seed, "plain", cache, "first")
    assert first == {"compiles": 4, "loads": 0}
    assert len(list((cache / "sm_90a").glob("*.json"))) == 4
    second, out2 = _run(tmp_path, seed, "plain", cache, "second")
    assert second == {"compiles": 0, "loads": 4}
    _same_bits(out1, out2)
    _, ref = _run(tmp_path, seed, "nocache", tmp_path / "unused", "nocache")
    _same_bits(out1, ref)


@pytest.mark.sm90
def test_pool_built_kernels_match_in_process_compiles(tmp_path: Path) -> None:
    seed = random.getrandbits(31)
    pooled, out_pool = _run(tmp_path, seed, "prefetch", tmp_path / "pool-cache", "pool")
    assert pooled == {"compiles": 0, "loads": 4}  # every kernel came from a worker
    _, ref = _run(tmp_path, seed, "nocache", tmp_path / "unused", "nocache")
    _same_bits(out_pool, ref)


@pytest.mark.sm90
def test_a_corrupt_entry_is_recompiled_on_the_gpu(tmp_path: Path) -> None:
    seed = random.getrandbits(31)
    cache = tmp_path / "cache"
    _, out1 = _run(tmp_path, seed, "plain", cache, "first")
    for obj in (cache / "sm_90a").glob("*.o"):
        data = bytearray(obj.read_bytes())
        data[len(data) // 2] ^= 0x01
        obj.write_bytes(bytes(data))
    again, out2 = _run(tmp_path, seed, "plain", cache, "again")
    assert again == {"compiles": 4, "loads": 0}
    _same_bits(out1, out2)
