#!/usr/bin/env python3
"""Check the JIT disk caches a server left behind (e.g. after `kill -9`): no entry that a
loader would see is corrupt.

    python bench/cache_integrity.py [--cutedsl DIR] [--tilelang DIR] [--out FILE]

--cutedsl DIR (cutedsl/jit.py's CUTEDSL_CACHE_DIR): every record `<arch>/<digest>.json` must be a
JSON object of the current FORMAT whose key hashes to its file name, naming an object file of the
recorded size and sha256 (what `Entry.load` checks before loading). Leftover temporary files
(`.*.tmp`, `.*.export.o`: a writer killed mid-write) are counted, not corrupt: the entry is written
object first, record last, each renamed into place.
--tilelang DIR (TILELANG_CACHE_DIR): every entry folder `*/kernels/<key>/` must be complete for
one of TileLang's backends (its own `_is_complete_cache_dir`: device and host sources, the
library, params.pkl), hold no empty file, and its params.pkl must unpickle. TileLang writes an
entry into a staging folder renamed into place, so a kill leaves only staging leftovers.
Prints one line per cache and writes --out (JSON: per cache entries, corrupt [{path, why}],
leftovers); exit 1 when any entry is corrupt or a given folder does not exist.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path


def check_cutedsl(root: Path) -> dict:
    from cutedsl.jit import FORMAT, key_digest

    corrupt, entries = [], 0
    leftovers = sorted(
        str(p.relative_to(root))
        for p in root.rglob(".*")
        if p.is_file() and p.name.endswith((".tmp", ".export.o"))
    )
    for rec_path in sorted(root.glob("*/*.json")):
        entries += 1

        def bad(why: str, path: Path = rec_path) -> None:
            corrupt.append({"path": str(path), "why": why})

        try:
            rec = json.loads(rec_path.read_bytes())
            if not isinstance(rec, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            bad(f"unreadable record ({e})")
            continue
        if rec.get("format") != FORMAT:
            bad(f"format {rec.get('format')!r}, expected {FORMAT}")
            continue
        if not isinstance(rec.get("key"), dict) or key_digest(rec["key"]) != rec_path.stem:
            bad("the record's key does not hash to its file name")
            continue
        name = rec.get("object")
        if not isinstance(name, str) or "/" in name or not name.startswith(rec_path.stem):
            bad(f"bad object name {name!r}")
            continue
        obj = rec_path.parent / name
        try:
            data = obj.read_bytes()
        except FileNotFoundError:
            bad("object file missing", obj)
            continue
        if len(data) != rec.get("size") or hashlib.sha256(data).hexdigest() != rec.get("sha256"):
            bad(f"{len(data)} bytes whose sha256 does not match the record", obj)
    return {"root": str(root), "entries": entries, "corrupt": corrupt, "leftovers": leftovers}


def check_tilelang(root: Path) -> dict:
    import cloudpickle
    from tilelang.cache import _dispatch_map

    caches = list({id(c): c for c in _dispatch_map.values()}.values())
    corrupt, entries = [], 0
    folders = sorted(p for p in root.glob("*/kernels/*") if p.is_dir())
    leftovers = sorted(str(p.relative_to(root)) for p in root.glob("*/staging/*"))
    for d in folders:
        entries += 1
        if not any(c._is_complete_cache_dir(str(d)) for c in caches):
            missing = min((c._get_missing_complete_cache_files(str(d)) for c in caches), key=len)
            corrupt.append(
                {"path": str(d), "why": f"incomplete: no {[Path(m).name for m in missing]}"}
            )
            continue
        empty = [p.name for p in d.rglob("*") if p.is_file() and p.stat().st_size == 0]
        if empty:
            corrupt.append({"path": str(d), "why": f"empty file(s) {empty}"})
            continue
        try:
            with open(d / "params.pkl", "rb") as f:
                cloudpickle.load(f)
        except Exception as e:  # any unpickling failure is a corrupt entry
            corrupt.append({"path": str(d), "why": f"params.pkl: {type(e).__name__}: {e}"[:300]})
    return {"root": str(root), "entries": entries, "corrupt": corrupt, "leftovers": leftovers}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cutedsl", default="", help="CUTEDSL_CACHE_DIR to check")
    ap.add_argument("--tilelang", default="", help="TILELANG_CACHE_DIR to check")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    res, ok = {}, True
    for name, root, check in (("cutedsl", a.cutedsl, check_cutedsl),
                              ("tilelang", a.tilelang, check_tilelang)):  # fmt: skip
        if not root:
            continue
        if not Path(root).is_dir():
            res[name] = {"root": root, "error": "no such folder"}
            ok = False
        else:
            res[name] = check(Path(root))
            ok = ok and not res[name]["corrupt"]
        r = res[name]
        print(f"{name}: {r.get('error') or ''}{r.get('entries', 0)} entries, "
              f"{len(r.get('corrupt', []))} corrupt, {len(r.get('leftovers', []))} leftovers "
              f"({root})")  # fmt: skip
        for c in r.get("corrupt", [])[:10]:
            print(f"  corrupt: {c['path']}: {c['why']}")
    res["ok"] = ok
    if a.out:
        tmp = f"{a.out}.{os.getpid()}.tmp"
        Path(tmp).write_text(json.dumps(res, indent=1) + "\n")
        os.replace(tmp, a.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
