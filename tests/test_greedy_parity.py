"""bench/greedy_parity.py: the server side against a stub OpenAI server, the comparison, the offline
side with a stand-in for `vllm.LLM` (the real one needs a GPU), and the server's own flags
(scripts/dsv4_flags.sh) through vLLM 0.21.0's EngineArgs parser on CPU."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import random
import subprocess
import sys
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
_spec = importlib.util.spec_from_file_location("greedy_parity", ROOT / "bench" / "greedy_parity.py")
gp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gp)


def _continuation(prompt: list[int], n: int) -> list[int]:
    """A deterministic stand-in for a model's greedy continuation of `prompt`."""
    rng = random.Random(hash(tuple(prompt)))
    return [rng.randrange(4096) for _ in range(n)]


def _gaps(prompt: list[int], n: int) -> list[float]:
    """A deterministic stand-in for the top-2 logprob gap at each generated position."""
    rng = random.Random(hash(tuple(prompt)) + 1)
    return [round(rng.uniform(0.0, 3.0), 5) for _ in range(n)]


def _top2(gap: float) -> dict:
    """Two candidates whose logprobs are `gap` apart, keyed as `return_tokens_as_token_ids` keys."""
    return {"token_id:7": -0.5, "token_id:9": -0.5 - gap}


def _stub(with_ids: bool = True):
    seen: list[dict] = []
    busy = threading.Lock()

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            assert busy.acquire(blocking=False), "two requests at once"
            try:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                seen.append(body)
                choice = {"text": "x"}
                if with_ids:
                    choice["token_ids"] = _continuation(body["prompt"], body["max_tokens"])
                if body.get("logprobs"):
                    gaps = _gaps(body["prompt"], body["max_tokens"])
                    choice["logprobs"] = {"top_logprobs": [_top2(g) for g in gaps]}
                data = json.dumps({"choices": [choice]}).encode()
            finally:
                # released before the answer goes out: once the client has it, it may send the
                # next request, which this handler thread could otherwise still be holding off
                busy.release()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}", seen


def test_prompts_are_seeded_and_in_range() -> None:
    a, b = gp.make_prompts(3, 50, 7), gp.make_prompts(3, 50, 7)
    assert a == b and a != gp.make_prompts(3, 50, 8)
    assert all(len(p) == 50 and all(10 <= t < 1000 for t in p) for p in a)


def test_first_difference_and_compare() -> None:
    assert gp.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert gp.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert gp.first_difference([1, 2], [1, 2, 3]) == 2
    res = gp.compare([[1, 2], [3, 4], [5]], [[1, 2], [3, 9], [5, 6]])
    assert (res["prompts"], res["equal"], res["differ"]) == (3, 1, 2)
    assert [r["first_diff"] for r in res["rows"]] == [None, 1, 1]
    with pytest.raises(ValueError, match="2 server outputs vs 1"):
        gp.compare([[1], [2]], [[1]])


def test_server_side_sends_each_prompt_alone_and_keeps_the_token_ids(tmp_path: Path) -> None:
    srv, url, seen = _stub()
    out = tmp_path / "s.json"
    try:
        rc = gp.main(["server", "--base-url", url, "--model", "flash", "--prompts", "4",
                      "--prompt-len", "32", "--max-tokens", "9", "--seed", "3", "--out", str(out)])  # fmt: skip
    finally:
        srv.shutdown()
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["prompts"] == gp.make_prompts(4, 32, 3)
    assert doc["outputs"] == [_continuation(p, 9) for p in doc["prompts"]]
    assert doc["outputs_again"] == doc["outputs"] and doc["self_equal"] == 4
    assert doc["top2_gaps"] == [_gaps(p, 9) for p in doc["prompts"]]
    assert [b["prompt"] for b in seen] == doc["prompts"] * 2  # every prompt, then again
    for b in seen:
        assert b["temperature"] == 0.0 and b["ignore_eos"] and b["return_token_ids"]
        assert (b["model"], b["max_tokens"], b["logprobs"]) == ("flash", 9, 2)
        assert b["return_tokens_as_token_ids"]  # logprob keys stay distinct per token id


def test_top2_gap() -> None:
    assert gp.top2_gap({"a": -0.25, "b": -3.0, "c": -1.0}) == 0.75
    assert gp.top2_gap({"a": -0.25}) is None and gp.top2_gap(None) is None


def test_server_without_token_ids_is_refused(tmp_path: Path, capsys) -> None:
    srv, url, _ = _stub(with_ids=False)
    out = tmp_path / "s.json"
    try:
        rc = gp.main(
            ["server", "--base-url", url, "--model", "m", "--prompts", "1", "--out", str(out)]
        )
    finally:
        srv.shutdown()
    assert rc == 2 and not out.exists()
    assert "no token_ids" in capsys.readouterr().err


def _fake_vllm(monkeypatch, llm_cls: type, engine_args) -> None:
    """`vllm.LLM` (llm_cls), `SamplingParams` (its keywords as a dict) and `TokensPrompt` stand-ins,
    and greedy_parity's engine-args parser replaced by `engine_args`."""
    fake = types.ModuleType("vllm")
    fake.LLM, fake.SamplingParams, fake.__version__ = llm_cls, lambda **kw: kw, "0.21.0"
    fake_inputs = types.ModuleType("vllm.inputs")
    fake_inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.inputs", fake_inputs)
    monkeypatch.setattr(gp, "engine_args", engine_args)
    monkeypatch.setattr("torch.cuda.get_device_name", lambda i: "a GPU")


@pytest.mark.parametrize("diverge_at", [None, 5])
def test_offline_side_compares_and_says_so(tmp_path: Path, monkeypatch, diverge_at) -> None:
    prompts = gp.make_prompts(3, 16, 1)
    server = tmp_path / "s.json"
    server.write_text(json.dumps({"prompts": prompts, "max_tokens": 8, "command": "x",
                                  "outputs": [_continuation(p, 8) for p in prompts],
                                  "top2_gaps": [_gaps(p, 8) for p in prompts], "self_equal": 3}))  # fmt: skip
    calls: list[tuple] = []

    class FakeLLM:
        @classmethod
        def from_engine_args(cls, ea):
            calls.append(("engine", ea))
            return cls()

        def generate(self, batch, sp, use_tqdm=False):
            if len(batch) > 1:  # the load between the passes
                calls.append(("load", [len(b["prompt_token_ids"]) for b in batch], sp))
                return [None] * len(batch)
            calls.append(("generate", sp))
            p = batch[0]["prompt_token_ids"]
            ids = _continuation(p, sp["max_tokens"])
            n = len([c for c in calls if c[0] == "generate"])
            if diverge_at is not None and n in (2, 5):  # prompt 1, in both passes
                ids[diverge_at] += 1
            gaps = [g / 2 for g in _gaps(p, sp["max_tokens"])]
            lps = [{7: types.SimpleNamespace(logprob=-0.5), 9: types.SimpleNamespace(logprob=-0.5 - g)}
                   for g in gaps]  # fmt: skip
            return [
                types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=ids, logprobs=lps)])
            ]

    @dataclasses.dataclass
    class FakeEA:
        model: str = "ckpt"

    _fake_vllm(monkeypatch, FakeLLM, lambda flags: (FakeEA(flags[0]), ["--port", "1"]))
    monkeypatch.setenv("VLLM_CUSTOM_SCOPES_FOR_PROFILING", "1")  # part of the compile cache key
    out = tmp_path / "p.json"
    rc = gp.main(["offline", "--server", str(server), "--out", str(out), "--load-prompts", "5",
                  "--load-len", "33", "--", "ckpt", "--port", "1"])  # fmt: skip
    doc = json.loads(out.read_text())
    assert calls[0] == ("engine", FakeEA("ckpt"))
    # every prompt alone, then the load in one batch, then every prompt again
    assert [c[0] for c in calls[1:]] == ["generate"] * 3 + ["load"] + ["generate"] * 3
    assert calls[4][1] == [33] * 5 and calls[4][2]["max_tokens"] == 16
    assert doc["load_between_offline_passes"]["prompts"] == 5
    assert doc["server_equal_offline_after_load"] == (3 if diverge_at is None else 2)
    sps = [c[1] for c in calls[1:] if c[0] == "generate"]
    assert len(sps) == 6 and all(  # every prompt, twice
        sp == {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, "logprobs": 2} for sp in sps
    )
    assert doc["ignored_flags"] == ["--port", "1"] and doc["device"] == "a GPU"
    assert doc["vllm_env"]["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] == "1"
    assert all(k.startswith("VLLM_") for k in doc["vllm_env"])
    assert (doc["server_self_equal"], doc["offline_self_equal"]) == (3, 3)
    want = [[g / 2 for g in _gaps(p, 8)] for p in prompts]
    assert doc["offline_top2_gaps"] == [pytest.approx(w, abs=1e-5) for w in want]
    if diverge_at is None:
        assert rc == 0 and doc["verdict"] == "pass" and doc["equal"] == 3
        assert not any("server_gap_at_diff" in r for r in doc["rows"])
    else:
        assert rc == 1 and doc["verdict"] == "fail" and doc["differ"] == 1
        assert [r["first_diff"] for r in doc["rows"]] == [None, diverge_at, None]
        row = doc["rows"][1]
        assert row["server_gap_at_diff"] == _gaps(prompts[1], 8)[diverge_at]
        assert row["offline_gap_at_diff"] == pytest.approx(want[1][diverge_at], abs=1e-5)


def test_offline_counts_a_pass_that_does_not_repeat_itself(tmp_path: Path, monkeypatch) -> None:
    prompts = gp.make_prompts(2, 8, 4)
    server = tmp_path / "s.json"
    server.write_text(json.dumps({"prompts": prompts, "max_tokens": 4, "command": "x",
                                  "outputs": [_continuation(p, 4) for p in prompts]}))  # fmt: skip
    n = [0]

    class FakeLLM:
        @classmethod
        def from_engine_args(cls, ea):
            return cls()

        def generate(self, batch, sp, use_tqdm=False):
            assert len(batch) == 1, "--load-prompts 0: no load between the passes"
            n[0] += 1
            ids = _continuation(batch[0]["prompt_token_ids"], sp["max_tokens"])
            if n[0] == 4:  # prompt 1's second pass
                ids[0] += 1
            return [
                types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=ids, logprobs=None)])
            ]

    _fake_vllm(monkeypatch, FakeLLM, lambda flags: (types.SimpleNamespace(), []))
    out = tmp_path / "p.json"
    rc = gp.main(
        ["offline", "--server", str(server), "--out", str(out), "--load-prompts", "0", "--", "ckpt"]
    )
    doc = json.loads(out.read_text())
    assert rc == 0 and doc["equal"] == 2  # the first pass is the one compared
    assert doc["offline_self_equal"] == 1 and doc["server_self_equal"] is None
    assert doc["offline_outputs_again"][0] == doc["offline_outputs"][0]
    assert doc["offline_outputs_again"][1] != doc["offline_outputs"][1]
    assert doc["server_equal_offline_after_load"] == 1


def test_offline_compares_with_other_runs(tmp_path: Path, monkeypatch, capsys) -> None:
    """--compare NAME=JSON: this process's first pass against another offline process's first
    pass and against another server run, prompt by prompt with both gaps at the first
    difference; a file from other prompts, a repeated name or a bad spec is refused before any
    engine is built."""
    prompts = gp.make_prompts(3, 8, 2)
    server = tmp_path / "s.json"
    server.write_text(json.dumps({"prompts": prompts, "max_tokens": 6, "command": "x",
                                  "outputs": [_continuation(p, 6) for p in prompts]}))  # fmt: skip
    fresh = tmp_path / "fresh.json"  # a server run that parts from the others at prompt 0, token 1
    outs = [_continuation(p, 6) for p in prompts]
    outs[0][1] += 1
    fresh.write_text(json.dumps({"prompts": prompts, "outputs": outs,
                                 "top2_gaps": [[0.5] * 6 for _ in prompts]}))  # fmt: skip
    process = [0]

    class FakeLLM:
        @classmethod
        def from_engine_args(cls, ea):
            process[0] += 1
            return cls()

        def generate(self, batch, sp, use_tqdm=False):
            ids = _continuation(batch[0]["prompt_token_ids"], sp["max_tokens"])
            if process[0] == 2 and batch[0]["prompt_token_ids"] == prompts[2]:
                ids[3] += 1  # the second process parts from the first at prompt 2, token 3
            lps = [{7: types.SimpleNamespace(logprob=-0.5), 9: types.SimpleNamespace(logprob=-0.75)}
                   for _ in ids]  # fmt: skip
            return [
                types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=ids, logprobs=lps)])
            ]

    _fake_vllm(monkeypatch, FakeLLM, lambda flags: (types.SimpleNamespace(), []))
    first, second = tmp_path / "p1.json", tmp_path / "p2.json"
    base = ["offline", "--server", str(server), "--load-prompts", "0"]
    assert gp.main([*base, "--out", str(first), "--", "ckpt"]) == 0
    assert json.loads(first.read_text())["compared"] == {}
    rc = gp.main([*base, "--out", str(second), "--compare", f"offline_1={first}",
                  "--compare", f"server_fresh={fresh}", "--", "ckpt"])  # fmt: skip
    doc = json.loads(second.read_text())
    assert rc == 1 and doc["equal"] == 2  # the server's outputs are the first process's
    other = doc["compared"]["offline_1"]
    assert other["file"] == str(first) and (other["equal"], other["differ"]) == (2, 1)
    assert [r["first_diff"] for r in other["rows"]] == [None, None, 3]
    assert other["rows"][2]["other_gap_at_diff"] == 0.25
    assert other["rows"][2]["offline_gap_at_diff"] == 0.25
    srv = doc["compared"]["server_fresh"]
    assert (srv["equal"], srv["differ"]) == (1, 2)
    assert [r["first_diff"] for r in srv["rows"]] == [1, None, 3]
    assert srv["rows"][0]["other_gap_at_diff"] == 0.5
    out = capsys.readouterr().out
    assert "equal to offline_1: 2/3" in out and "equal to server_fresh: 1/3" in out

    elsewhere = tmp_path / "other_prompts.json"
    elsewhere.write_text(json.dumps({"prompts": prompts[:2] + [prompts[0]], "outputs": outs}))
    bad = tmp_path / "p3.json"
    for spec, why in ((f"x={elsewhere}", "prompts are not"), (str(first), "want a new NAME=JSON"),
                      (f"x={tmp_path / 'missing.json'}", "FileNotFoundError")):  # fmt: skip
        rc = gp.main([*base, "--out", str(bad), "--compare", spec, "--", "ckpt"])
        assert rc == 2 and not bad.exists() and process[0] == 2
        assert why in capsys.readouterr().err
    rc = gp.main([*base, "--out", str(bad), "--compare", f"a={first}", "--compare", f"a={fresh}",
                  "--", "ckpt"])  # fmt: skip
    assert rc == 2 and not bad.exists() and "want a new NAME=JSON" in capsys.readouterr().err


def test_offline_refuses_a_missing_server_file(tmp_path: Path, capsys) -> None:
    rc = gp.main(["offline", "--server", str(tmp_path / "none.json"), "--out", str(tmp_path / "p.json"),
                  "--", "ckpt"])  # fmt: skip
    assert rc == 2 and not (tmp_path / "p.json").exists()
    assert "none.json" in capsys.readouterr().err


_ENGINE_ARGS_ON_CPU = r"""
import json, subprocess, sys
from vllm import platforms
from vllm.platforms.cpu import CpuPlatform
platforms._current_platform = CpuPlatform()  # the venv's vLLM is a CUDA build; no GPU here
sys.path.insert(0, sys.argv[1] + "/bench")
import greedy_parity as gp
flags = subprocess.run(["bash", "-c", '. scripts/dsv4_flags.sh; printf "%s\n" "${DSV4_ENGINE_FLAGS[@]}" '
                        '"${DSV4_CKPT_FLAGS[@]}"'], cwd=sys.argv[1], capture_output=True, text=True,
                       check=True).stdout.splitlines()
flags += ["--served-model-name", "flash", "--max-model-len", "10240", "--max-num-seqs", "128",
          "--kv-cache-memory-bytes", "16000000000", "--cudagraph-capture-sizes", "1", "2", "4",
          "--enable-prompt-tokens-details"]
ea, ignored = gp.engine_args([sys.argv[2], *flags])  # an existing directory: a local model
cc = ea.compilation_config
print(json.dumps({"ignored": ignored, "model": ea.model, "kv": ea.kv_cache_dtype, "block": ea.block_size,
                  "mode": str(cc["cudagraph_mode"] if isinstance(cc, dict) else cc.cudagraph_mode),
                  "tok": ea.tokenizer_mode, "len": ea.max_model_len, "seqs": ea.max_num_seqs,
                  "kvb": ea.kv_cache_memory_bytes, "sizes": ea.cudagraph_capture_sizes,
                  "reasoning": ea.reasoning_parser,
                  "inductor": cc["inductor_compile_config"] if isinstance(cc, dict) else cc.inductor_compile_config}))
"""


def test_the_servers_flags_build_the_same_engine_args(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-c", _ENGINE_ARGS_ON_CPU, str(ROOT), str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["ignored"] == ["--tool-call-parser", "deepseek_v4", "--enable-auto-tool-choice",
                              "--enable-prompt-tokens-details"]  # fmt: skip
    assert (got["model"], got["kv"], got["block"], got["tok"]) == (
        str(tmp_path),
        "fp8",
        256,
        "deepseek_v4",
    )
    assert "FULL_AND_PIECEWISE" in got["mode"] and got["reasoning"] == "deepseek_v4"
    assert (got["len"], got["seqs"], got["kvb"], got["sizes"]) == (
        10240,
        128,
        16000000000,
        [1, 2, 4],
    )
    # one Triton config per Inductor reduction (the same kernels in a compiling and a loading process)
    want = {"test_configs.force_filter_reduction_configs": True, "dynamic_scale_rblock": False}
    assert {k: got["inductor"].get(k) for k in want} == want


def _engine_flags(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", '. scripts/dsv4_flags.sh && printf "%s\\n" "${DSV4_ENGINE_FLAGS[@]}"'],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, **env})  # fmt: skip


def test_fixed_reductions_can_be_turned_off_and_nothing_else_changes() -> None:
    on, off = _engine_flags({}), _engine_flags({"DSV4_FIXED_REDUCTIONS": "0"})
    assert on.returncode == 0 and off.returncode == 0, on.stderr + off.stderr
    assert on.stdout == _engine_flags({"DSV4_FIXED_REDUCTIONS": "1"}).stdout
    on_cc, off_cc = (json.loads(r.stdout.splitlines()[-1]) for r in (on, off))
    assert on_cc.pop("inductor_compile_config") and on_cc == off_cc
    assert on.stdout.splitlines()[:-1] == off.stdout.splitlines()[:-1]
    bad = _engine_flags({"DSV4_FIXED_REDUCTIONS": "yes"})
    assert bad.returncode == 2 and "DSV4_FIXED_REDUCTIONS=yes: 1 (the default) or 0" in bad.stderr


def test_the_inductor_settings_of_the_flags_exist_in_torch() -> None:
    """A misspelt key would only fail inside the server's first compile: each one patches
    Inductor's config and changes the setting it names."""
    import torch._inductor.config as ic

    want = {"test_configs.force_filter_reduction_configs": True, "dynamic_scale_rblock": False}
    before = {k: ic.get_config_copy()[k] for k in want}
    assert before != want  # the flags change Inductor's defaults
    with ic.patch(want):
        assert {k: ic.get_config_copy()[k] for k in want} == want


def test_server_down_is_one_line_and_writes_nothing(tmp_path: Path, capsys) -> None:
    srv, url, _ = _stub()
    srv.shutdown()
    srv.server_close()
    out = tmp_path / "s.json"
    rc = gp.main(["server", "--base-url", url, "--model", "m", "--prompts", "1", "--timeout", "5",
                  "--out", str(out)])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert rc == 2 and not out.exists() and len(err.splitlines()) == 1 and "prompt 0" in err
