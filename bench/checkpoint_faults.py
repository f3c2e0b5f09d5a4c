#!/usr/bin/env python3
"""Serve corrupted copies of a checkpoint: each must stop the server with a non-zero exit, one
line naming the file and the tensor, and nothing left running.

    python bench/checkpoint_faults.py --src CKPT --work DIR --out faults.json \\
        [--faults truncated,missing_scale,...] [--timeout 300] [--port 8100] -- CMD...

CMD starts a server on `{ckpt}` at port `{port}` (placeholders), e.g.
    -- env TINY_DIR={ckpt} PORT={port} PREWARM_MHC=0 bash scripts/serve.sh
FAULTS (each a copy of --src under --work, then `make_fault`):
  truncated      the last shard loses its last 1000 bytes (a download that stopped short);
  missing_scale  layers.1.attn.wq_b.weight_scale removed (shard and index);
  scale_dtype    that scale stored as F32;
  scale_shape    that scale one block column short;
  experts        config.json n_routed_experts doubled;
  missing_shard  the last shard deleted (the index still names it).
Every server runs at once, each in its own process group, its GPU memory (process tree, from
nvidia-smi) sampled every second. A case passes when the server exits non-zero within
--timeout, its log's last `CheckpointFault: ` line equals what `cutedsl.vllm.preflight`
says about the same files here, and no process of its group is left (any left is killed and
named). Writes --out (JSON: command, date, device, commit, one record per fault) and exits 1
unless every case passed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import soak  # noqa: E402
import startup  # noqa: E402

from cutedsl.vllm.preflight import INDEX, CheckpointFault, check_checkpoint  # noqa: E402

FAULTS = ("truncated", "missing_scale", "scale_dtype", "scale_shape", "experts", "missing_shard")
SCALE = "layers.1.attn.wq_b.weight_scale"


def _index(ck: Path) -> dict:
    return json.loads((ck / INDEX).read_text())


def rewrite(ck: Path, tensor: str, change) -> Path:
    """Apply change(dict of the shard's tensors) to the shard holding `tensor`, and keep the index
    in step (a tensor the change removes leaves the index too). Returns the shard."""
    from safetensors.torch import load_file, save_file

    idx = _index(ck)
    shard = ck / idx["weight_map"][tensor]
    ts = load_file(shard)
    change(ts)
    save_file(ts, shard, metadata={"format": "pt"})
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if k in ts or v != shard.name}
    (ck / INDEX).write_text(json.dumps(idx))
    return shard


def make_fault(src: Path, dst: Path, fault: str) -> Path:
    """A copy of the checkpoint `src` at `dst` with `fault` (module docstring)."""
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; expected one of {', '.join(FAULTS)}")
    shutil.copytree(src, dst)
    last = dst / sorted(set(_index(dst)["weight_map"].values()))[-1]
    if fault == "truncated":
        with open(last, "r+b") as f:
            f.truncate(last.stat().st_size - 1000)
    elif fault == "missing_scale":
        rewrite(dst, SCALE, lambda ts: ts.pop(SCALE))
    elif fault == "scale_dtype":
        rewrite(dst, SCALE, lambda ts: ts.update({SCALE: ts[SCALE].float()}))
    elif fault == "scale_shape":
        rewrite(dst, SCALE, lambda ts: ts.update({SCALE: ts[SCALE][:, :-1].contiguous()}))
    elif fault == "experts":
        cfg = json.loads((dst / "config.json").read_text())
        cfg["n_routed_experts"] *= 2
        (dst / "config.json").write_text(json.dumps(cfg))
    elif fault == "missing_shard":
        last.unlink()
    return dst


def expected_fault(ck: Path) -> str | None:
    """What the pre-check says about `ck` (None: it passes)."""
    cfg = json.loads((ck / "config.json").read_text())
    try:
        check_checkpoint(str(ck), cfg.get("n_routed_experts"), cfg.get("quantization_config"))
    except CheckpointFault as e:
        return str(e)
    return None


def _group(pgid: int) -> list[int]:
    """Pids whose process group is `pgid` (from /proc; Linux)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                out.append(int(d))
    return out


def run_case(cmd: list[str], ck: Path, port: int, log: Path, timeout: float, expected: str | None):
    argv = [a.replace("{ckpt}", str(ck)).replace("{port}", str(port)) for a in cmd]
    t0 = time.monotonic()
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)  # fmt: skip
    peak = None
    while proc.poll() is None and time.monotonic() - t0 < timeout:
        m = soak.server_memory_mib(proc.pid)
        if m is not None:
            peak = max(peak or 0, m)
        time.sleep(1.0)
    timed_out = proc.poll() is None
    if timed_out:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    took = time.monotonic() - t0
    time.sleep(2.0)  # children of a dying parent exit on their own first
    left = _group(proc.pid)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    text = log.read_text(errors="replace")
    lines = re.findall(r"CheckpointFault: (.*)", text)
    msg = lines[-1].strip() if lines else None
    ok = not timed_out and proc.returncode != 0 and msg is not None and msg == expected and not left
    return {"exit_code": None if timed_out else proc.returncode, "timed_out": timed_out,
            "seconds_to_exit": round(took, 1), "message": msg, "expected": expected,
            "message_matches": msg == expected, "left_running": left, "gpu_mib_peak": peak,
            "log": str(log), "ok": ok}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("checkpoint_faults.py: give the server command after --")
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--port", type=int, default=8100, help="first port; one per fault")
    a = ap.parse_args(argv[:cut])
    cmd = argv[cut + 1 :]
    work = Path(a.work)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    faults = a.faults.split(",")
    cases = {f: make_fault(Path(a.src), work / f, f) for f in faults}
    expected = {f: expected_fault(ck) for f, ck in cases.items()}
    res: dict = {}

    def one(i: int, f: str) -> None:
        res[f] = run_case(cmd, cases[f], a.port + i, work / f"{f}.log", a.timeout, expected[f])

    threads = [threading.Thread(target=one, args=(i, f)) for i, f in enumerate(faults)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    doc = {
        "command": " ".join(shlex.quote(x) for x in [sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": startup._device(),
        "commit": startup._commit(),
        "server_command": cmd,
        "faults": {f: res[f] for f in faults},
        "ok": all(r["ok"] for r in res.values()),
    }
    tmp = f"{a.out}.{os.getpid()}.tmp"
    Path(tmp).write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, a.out)
    for f in faults:
        r = res[f]
        print(f"{f}: {'ok' if r['ok'] else 'FAIL'} exit={r['exit_code']} "
              f"{r['seconds_to_exit']} s, gpu peak {r['gpu_mib_peak']} MiB, "
              f"left {r['left_running']}: {r['message']}")  # fmt: skip
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
