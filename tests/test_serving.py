"""The OpenAI-compatible server (``hybrid-compile serve``) and the AsyncEngine under it.

One live server per module: ``python -m hybrid_compile serve`` in a subprocess on 127.0.0.1,
serving a tiny random-weight Qwen3-Next checkpoint saved with its tokenizer
(:mod:`checkpoints`), driven by the official ``openai`` client (sync and async). The oracle is
transformers' own greedy ``generate`` on the same checkpoint, decoded with the same tokenizer.
A second, in-process server (uvicorn on a thread, same checkpoint) covers what needs a hand on
the engine: 503 while the model loads, and a failing engine step (500 for its requests, the
others served). Every request is bounded in count and time; the network is 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

# the server's tests need the serve extra (pip install hybrid_compile[serve]; CI installs it) and the
# official client; a machine without them (the GPU machine) skips the module instead of failing collection
openai = pytest.importorskip("openai", reason="the openai client is not installed (pip install hybrid_compile[serve])")
pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install hybrid_compile[serve])")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402 (after the skips above)

import hybrid_compile as hc
from hybrid_compile.serving.async_engine import EngineClosedError, EngineStepError
from checkout_env import checkout_env
from checkpoints import hf_text, load_hf, save_checkpoint
from engine_models import single_threaded
from ports import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAME = "tiny-qwen3-next"
NEW = 8  # new tokens per request
MAX_TOTAL_TOKENS = 4096
PROMPTS = [
    "Hello world! How are", "The quick brown", "Hybrid models mix", "Gated delta networks keep",
    "A small tokenizer for", "numbers 0123", "The lazy dog", "state space layers",
]
TIMEOUT = 120  # seconds any one client call may take


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from single_threaded()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(save_checkpoint(tmp_path_factory.mktemp("serving") / "qwen3_next", "qwen3_next", seed=0))


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _post_raw(url: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class LiveServer:
    """``python -m hybrid_compile serve`` on 127.0.0.1 (logs to a file, never a full pipe);
    ``engine_process``: with ``--engine-process`` (the engine steps in a child process)."""

    def __init__(self, ckpt: str, log: pathlib.Path, engine_process: bool = False, extra: tuple = ()) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = checkout_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", NO_PROXY="127.0.0.1")
        self.log = log
        self.timing_log = log.with_name("timing.jsonl")  # serve --request-timing-log
        self._log_file = open(log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hybrid_compile", "serve", "--model", ckpt, "--served-model-name", NAME,
             "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu", "--threads", "1",
             "--max-total-tokens", str(MAX_TOTAL_TOKENS), "--max-running-requests", "64",
             "--chunked-prefill-size", "256", "--no-progress", "--log-level", "warning", "--no-access-log",
             "--request-timing-log", str(self.timing_log), "--engine-process" if engine_process else "--no-engine-process",
             *extra],
            env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop(ctrl_c=True) signals only the server's processes
        )
        self.health_codes: list[int] = []

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                code, _ = _get(self.base + "/health")
            except OSError:  # not listening yet
                code = None
            if code is not None:
                self.health_codes.append(code)
                if code == 200:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log.read_text()}")

    def children(self) -> dict[int, str]:
        """The server's child processes (Linux /proc): pid -> command line."""
        pids = set()
        for task in pathlib.Path(f"/proc/{self.proc.pid}/task").iterdir():
            pids |= {int(p) for p in (task / "children").read_text().split()}
        return {pid: _cmdline(pid) for pid in pids}

    def engine_pid(self) -> int:
        (pid,) = [pid for pid, cmd in self.children().items() if "spawn_main" in cmd]
        return pid

    def stop(self, ctrl_c: bool = False) -> None:
        """SIGTERM to the server; ``ctrl_c``: SIGINT to its whole process group, as Ctrl-C in a terminal."""
        if ctrl_c and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
        else:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log_file.close()


def _cmdline(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:  # exited meanwhile
        return ""


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def assert_no_process_left(pids, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, {p: _cmdline(p) for p in pids if _alive(p)}
        time.sleep(0.05)


@pytest.fixture(scope="module", params=["thread", "process"])
def server(request, ckpt, tmp_path_factory):
    """The live server with its engine on a driver thread, then (``--engine-process``) in a child
    process: every test taking it runs in both modes. After a stop, no process of it is left."""
    live = LiveServer(ckpt, tmp_path_factory.mktemp("serving_log") / "server.log", request.param == "process")
    children = {}
    try:
        live.wait_ready()
        children = live.children()
        if request.param == "process":
            assert any("spawn_main" in cmd for cmd in children.values()), children
        yield live
    finally:
        live.stop(ctrl_c=request.param == "process")  # the engine process ignores the group's SIGINT
    # (uvicorn re-raises SIGTERM / SIGINT once shut down; 130: the exit status after a SIGINT)
    assert live.proc.returncode in (0, -15, -2, 130), live.log.read_text()
    assert "Traceback" not in live.log.read_text(), live.log.read_text()
    assert_no_process_left(children)


def _client(server, cls=None):
    cls = cls or openai.OpenAI
    return cls(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def metrics(server) -> dict:
    """The /metrics samples, parsed by prometheus_client's own parser: name -> value (labels of a
    request-finish counter folded into the name as name{finish_reason})."""
    code, body = _get(server.base + "/metrics")
    assert code == 200
    values = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            key = s.name + (f"{{{s.labels['finish_reason']}}}" if "finish_reason" in s.labels else "")
            if "le" not in s.labels:
                values[key] = s.value
    return values


def wait_idle_and_pools_full(server, timeout: float = 60) -> dict:
    """Wait until no request runs or waits, then check every slot is free or the prefix cache's
    (and none of the cache's locked)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if m["hybrid_compile_num_requests_running"] == 0 and m["hybrid_compile_num_requests_waiting"] == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.05)
    p = "hybrid_compile_"
    assert m[p + "kv_pool_free_tokens"] + m[p + "prefix_cache_kv_tokens"] == m[p + "kv_pool_capacity_tokens"], m
    assert m[p + "mamba_pool_free_slots"] + m[p + "prefix_cache_mamba_slots"] == m[p + "mamba_pool_capacity_slots"], m
    assert m[p + "request_pool_free_slots"] == m[p + "request_pool_capacity_slots"], m
    assert m[p + "prefix_cache_locked_kv_tokens"] == 0 and m[p + "prefix_cache_locked_mamba_slots"] == 0, m
    return m


@torch.inference_mode()
def hf_ids(ckpt: str, ids: list[int], max_new_tokens: int) -> list[int]:
    model, _ = load_hf(ckpt)
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids):].tolist()


# ---------------------------------------------------------------------------------------------
# text equal to transformers' greedy generate
# ---------------------------------------------------------------------------------------------


def test_completion_and_chat_text_equal_transformers_streaming_and_not(server, ckpt):
    client = _client(server)
    prompt = PROMPTS[0]
    expected = hf_text(ckpt, prompt, NEW)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, temperature=0)
    assert r.choices[0].text == expected
    tok = load_hf(ckpt)[1]
    n_prompt = len(tok(prompt)["input_ids"])
    assert r.usage.prompt_tokens == n_prompt and 1 <= r.usage.completion_tokens <= NEW
    assert r.choices[0].finish_reason in ("stop", "length") and r.model == NAME and r.object == "text_completion"
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    expected_chat = hf_text(ckpt, messages, NEW)
    c = client.chat.completions.create(model=NAME, messages=messages, max_tokens=NEW, temperature=0)
    assert c.choices[0].message.content == expected_chat and c.choices[0].message.role == "assistant"
    assert c.object == "chat.completion"
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=NEW, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == expected_chat
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == c.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == c.usage.prompt_tokens

    # token-id prompts, several in one request, n > 1: choice i * n + j is prompt i's j-th sequence
    ids = [tok(p)["input_ids"] for p in PROMPTS[1:3]]
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=NEW, temperature=0, n=2)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    for ch in r.choices:
        assert ch.text == tok.decode(hf_ids(ckpt, ids[ch.index // 2], NEW), skip_special_tokens=True)


def test_stop_strings_seeds_and_cached_prompt_tokens(server, ckpt):
    client = _client(server)
    tok = load_hf(ckpt)[1]
    prompt = PROMPTS[1]
    full = hf_text(ckpt, prompt, 16)
    assert len(full) >= 4, full
    k = next(k for k in range(1, len(full) - 1) if full.find(full[k : k + 2]) == k)
    stop = full[k : k + 2]  # a 2-character stop string first seen at k
    for stream in (False, True):
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0, stop=[stop],
                                      stream=stream)
        if stream:
            chunks = list(r)
            text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert (text, reason) == (full[:k], "stop"), (stream, stop, full)

    # sampling: the same seed gives the same text, twice and within one request of n = 2
    kw = dict(model=NAME, prompt=prompt, max_tokens=NEW, temperature=1.0, top_p=0.9, seed=7,
              extra_body={"ignore_eos": True, "top_k": 50})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text and a.usage.completion_tokens == NEW

    # a prompt extending a finished request's prompt + output hits the prefix cache: reported as cached
    ids = tok(PROMPTS[2] + " and more words here")["input_ids"]
    out = hf_ids(ckpt, ids, NEW)
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=NEW, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    longer = ids + out + [5, 6, 7]  # (out ends with EOS if it stopped there: the engine keeps it too)
    r2 = client.completions.create(model=NAME, prompt=longer, max_tokens=2, temperature=0)
    assert len(ids) <= r2.usage.prompt_tokens_details.cached_tokens < len(longer)
    assert r2.choices[0].text == tok.decode(hf_ids(ckpt, longer, 2), skip_special_tokens=True)


def test_penalties_min_p_and_logprobs_map_onto_the_engine(server, ckpt):
    client = _client(server)
    model, tok = load_hf(ckpt)
    prompt = PROMPTS[5]
    ids = tok(prompt)["input_ids"]
    x = torch.tensor([ids])
    with torch.inference_mode():  # transformers' own repetition penalty and logits
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False,
                             repetition_penalty=1.5)
        ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=4, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, temperature=0,
                                  extra_body={"repetition_penalty": 1.5})
    assert r.choices[0].text == tok.decode(out[0, len(ids):], skip_special_tokens=True)

    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for i, token in enumerate(ref.sequences[0, len(ids):].tolist()):
        expected = ref.logits[i][0].float().log_softmax(-1)
        assert lp.tokens[i] == tok.decode([token])
        assert abs(lp.token_logprobs[i] - expected[token].item()) < 1e-4
        top = expected.topk(3).values.tolist()
        # (OpenAI's dict is keyed by token text: ids that decode alike share an entry)
        values = sorted(lp.top_logprobs[i].values(), reverse=True)
        assert values[0] == pytest.approx(top[0], abs=1e-4)
        assert all(any(abs(v - t) < 1e-4 for t in top) for v in values)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])

    c = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    chunks = list(client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=3, temperature=0, logprobs=True, top_logprobs=2,
                                                 stream=True))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]

    # OpenAI's penalties and min_p with a seed: the in-process engine's generate() with the same settings
    settings = dict(presence_penalty=0.8, frequency_penalty=0.5, seed=3, temperature=0.9)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, **settings,
                                  extra_body={"min_p": 0.05, "ignore_eos": True})
    engine = hc.from_pretrained(ckpt, device="cpu", max_running_requests=2, max_total_tokens=512)
    try:
        expected = engine.generate(prompt, max_new_tokens=NEW, do_sample=True, min_p=0.05, ignore_eos=True,
                                   **settings)
    finally:
        engine.close()
    assert r.choices[0].text == expected


# ---------------------------------------------------------------------------------------------
# many streams at once, disconnects, bad input
# ---------------------------------------------------------------------------------------------


def test_64_concurrent_streams_complete_with_the_right_text_and_pools_come_back(server, ckpt):
    expected = {p: hf_text(ckpt, p, NEW) for p in PROMPTS}
    before = metrics(server)

    async def one(client, i):
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            stream = await client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, temperature=0,
                                                     stream=True)
            text = "".join([c.choices[0].text async for c in stream])
        else:
            stream = await client.chat.completions.create(model=NAME, max_tokens=NEW, temperature=0, stream=True,
                                                          messages=[{"role": "user", "content": prompt}])
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        return i, prompt, text

    async def run():
        async with _client(server, openai.AsyncOpenAI) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(64))), TIMEOUT)

    results = asyncio.run(run())
    chat_expected = {p: hf_text(ckpt, [{"role": "user", "content": p}], NEW) for p in PROMPTS}
    for i, prompt, text in results:
        assert text == (expected if i % 2 else chat_expected)[prompt], (i, prompt)
    after = wait_idle_and_pools_full(server)
    finished = sum(after.get(f"hybrid_compile_request_finished_total{{{r}}}", 0) for r in ("stop", "length"))
    assert finished - sum(before.get(f"hybrid_compile_request_finished_total{{{r}}}", 0)
                          for r in ("stop", "length")) == 64


def test_client_disconnect_mid_stream_frees_its_request(server, ckpt):
    client = _client(server)
    before = metrics(server)
    stream = client.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=300, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    got = 0
    for _ in stream:
        got += 1
        if got == 3:
            break
    stream.close()  # the connection goes away mid-stream
    after = wait_idle_and_pools_full(server)
    key = "hybrid_compile_request_finished_total{abort}"
    assert after.get(key, 0) == before.get(key, 0) + 1
    generated = after["hybrid_compile_generation_tokens_total"] - before["hybrid_compile_generation_tokens_total"]
    assert 3 <= generated < 300

    # a non-streaming request whose client gives up (times out) mid-generation: aborted too. (Its
    # generation must outlast the client's timeout by a margin: 400 tokens took 0.94 s on an idle CPU,
    # under a timeout of 1 s; 480 tokens (the context is 512) against 0.2 s)
    impatient = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=0.2)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=480, temperature=0,
                                     extra_body={"ignore_eos": True})
    final = wait_idle_and_pools_full(server)
    assert final.get(key, 0) == before.get(key, 0) + 2
    generated = final["hybrid_compile_generation_tokens_total"] - after["hybrid_compile_generation_tokens_total"]
    assert generated < 480


def _timing_lines(server, ids: set[str], timeout: float = 10) -> dict[str, dict]:
    """The server's timing-log lines of these request ids (a line is written as its response ends)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = {}
        for line in server.timing_log.read_text().splitlines():
            record = json.loads(line)
            lines[record["id"]] = record
        if ids <= lines.keys() or time.monotonic() > deadline:
            return {i: lines[i] for i in ids if i in lines}
        time.sleep(0.05)


def test_request_timing_log_orders_each_requests_way_through_the_server(server, ckpt):
    """serve --request-timing-log: one line per request, named by its X-Request-Id header (else the
    response's id), with handler start <= queued <= added to the engine <= first token <= first
    event sent <= end, on the clock this process shares (perf_counter); a client gone mid-stream
    is logged with 499."""
    client = _client(server)
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    sent = time.perf_counter()
    stream = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=NEW, temperature=0, stream=True,
                                       extra_headers={"X-Request-Id": f"s-{tag}"})
    text = "".join(c.choices[0].text for c in stream if c.choices)
    whole = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": PROMPTS[1]}],
                                           max_tokens=NEW, temperature=0, extra_headers={"X-Request-Id": f"j-{tag}"})
    gone = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=200, temperature=0, stream=True,
                                     extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": f"g-{tag}"})
    next(iter(gone))
    gone.close()  # the client goes away mid-stream
    done = time.perf_counter()
    lines = _timing_lines(server, {f"s-{tag}", f"j-{tag}", f"g-{tag}"})
    assert text and whole.choices[0].message.content is not None
    assert set(lines) == {f"s-{tag}", f"j-{tag}", f"g-{tag}"}, lines
    s, j, g = lines[f"s-{tag}"], lines[f"j-{tag}"], lines[f"g-{tag}"]
    assert sent < s["received"] <= s["submitted"] <= s["admitted"] <= s["first_token"] <= s["first_sent"] \
        <= s["finished"] < done, s
    assert s["status"] == 200 and s["prompts"] == 1
    assert j["received"] <= j["submitted"] <= j["admitted"] <= j["first_token"] <= j["finished"], j
    assert j["first_sent"] is None and j["status"] == 200  # (not streamed)
    assert g["status"] == 499 and g["admitted"] is not None, g
    # without the header, the response's own id
    reply = client.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=2, temperature=0)
    assert _timing_lines(server, {reply.id}).keys() == {reply.id}


def test_bad_requests_get_openai_400s_naming_the_field_and_lose_nothing_in_flight(server, ckpt):
    client = _client(server)
    expected = hf_text(ckpt, PROMPTS[4], 24)
    result = {}

    def in_flight():
        s = client.completions.create(model=NAME, prompt=PROMPTS[4], max_tokens=24, temperature=0, stream=True)
        result["text"] = "".join(c.choices[0].text for c in s)

    worker = threading.Thread(target=in_flight)
    worker.start()

    def err(call, **kw):
        with pytest.raises(openai.BadRequestError) as info:
            call(**kw)
        body = info.value.response.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"], body
        return body["error"]

    comp, chat = client.completions.create, client.chat.completions.create
    ok = dict(model=NAME, prompt="hi", max_tokens=4)
    assert err(comp, **{**ok, "model": "no-such-model"})["param"] == "model"
    assert err(comp, **{**ok, "max_tokens": 10_000})["param"] == "max_tokens"
    assert err(comp, **{**ok, "n": 0})["param"] == "n"
    assert err(comp, **{**ok, "prompt": [1, 2, 10_000_000]})["param"] == "prompt"
    assert err(comp, **{**ok, "prompt": []})["param"] == "prompt"
    assert err(comp, **{**ok, "logit_bias": {"5": 1.0}})["param"] == "logit_bias"
    assert err(comp, **ok, extra_body={"no_such_field": 1})["param"] == "no_such_field"
    assert err(comp, **{**ok, "temperature": -1})["param"] == "temperature"
    assert err(comp, **{**ok, "max_tokens": 0})["param"] == "max_tokens"
    assert err(comp, **{**ok, "presence_penalty": 3})["param"] == "presence_penalty"
    assert err(comp, **ok, extra_body={"min_p": 2})["param"] == "min_p"
    assert err(comp, **{**ok, "logprobs": 6})["param"] == "logprobs"
    msgs = [{"role": "user", "content": "hi"}]
    assert err(chat, model=NAME, messages=msgs, max_tokens=10_000)["param"] == "max_tokens"
    assert err(chat, model=NAME, messages=msgs, n=0)["param"] == "n"
    assert err(chat, model=NAME, messages=[{"role": "wizard", "content": "x"}])["param"] == "messages[0].role"
    # malformed JSON, and a body that is not an object
    code, body = _post_raw(server.base + "/v1/completions", b'{"model": "tiny", "prompt": ')
    assert code == 400 and body["error"]["type"] == "invalid_request_error" and "JSON" in body["error"]["message"]
    code, body = _post_raw(server.base + "/v1/chat/completions", b"[1, 2]")
    assert code == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    code, body = _post_raw(server.base + "/v1/no/such/route", b"{}")
    assert code == 404 and "error" in body

    worker.join(TIMEOUT)
    assert result["text"] == expected
    wait_idle_and_pools_full(server)


@pytest.mark.parametrize("mode", [["--no-engine-process"], []], ids=["thread", "process"])
def test_a_model_that_fails_to_load_ends_the_server_with_one_error_line(tmp_path, mode):
    proc = subprocess.run(
        [sys.executable, "-m", "hybrid_compile", "serve", "--model", str(tmp_path / "no" / "such" / "dir"),
         "--port", str(free_port()), "--device", "cpu", "--log-level", "warning", "--no-progress", *mode],
        env=checkout_env(),
        cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TIMEOUT,
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and "no/such/dir" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_models_health_and_metrics_parse_with_prometheus_client(server, ckpt):
    assert server.health_codes[-1] == 200
    client = _client(server)
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    # a miss, then a prompt extending that request's prompt + output: a hit (whatever ran before)
    ids = load_hf(ckpt)[1](PROMPTS[3] + " then some more")["input_ids"]
    client.completions.create(model=NAME, prompt=ids, max_tokens=NEW, temperature=0)
    client.completions.create(model=NAME, prompt=ids + hf_ids(ckpt, ids, NEW) + [5, 6], max_tokens=2, temperature=0)
    m = metrics(server)
    for name in ("num_requests_running", "num_requests_waiting", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count", "prefix_cache_hit_rate",
                 "kv_pool_usage_ratio", "mamba_pool_usage_ratio", "generation_tokens_per_second",
                 "generation_tokens_total", "prompt_tokens_total", "cached_prompt_tokens_total"):
        assert f"hybrid_compile_{name}" in m, name
    assert m["hybrid_compile_time_to_first_token_seconds_count"] > 0
    assert m["hybrid_compile_inter_token_latency_seconds_count"] > 0
    assert 0 < m["hybrid_compile_prefix_cache_hit_rate"] < 1


def test_serve_speculative_config_with_a_draft_model(ckpt, tmp_path):
    """``serve --speculative-config`` with a draft model directory (the checkpoint itself, read in the
    engine process): the completions are transformers' greedy text and /metrics reports the verify
    steps, the drafts verified and those accepted."""
    spec = json.dumps({"method": "draft_model", "draft_model": ckpt, "num_draft_tokens": 3})
    live = LiveServer(ckpt, tmp_path / "server.log", engine_process=True, extra=("--speculative-config", spec))
    try:
        live.wait_ready()
        client = _client(live)
        for prompt in PROMPTS[:2]:
            got = client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, temperature=0)
            assert got.choices[0].text == hf_text(ckpt, prompt, NEW), prompt
        m = metrics(live)
        p = "hybrid_compile_spec_decode_"
        assert m[p + "verify_steps_total"] > 0 and m[p + "draft_tokens_total"] > 0
        assert m[p + "accepted_tokens_total"] > 0 and 0 < m[p + "acceptance_rate"] <= 1
    finally:
        live.stop()
    assert "Traceback" not in live.log.read_text(), live.log.read_text()


# ---------------------------------------------------------------------------------------------
# in process: 503 while loading, a failing step, the AsyncEngine itself
# ---------------------------------------------------------------------------------------------


SMALL = dict(device="cpu", max_running_requests=8, max_total_tokens=1024, chunked_prefill_size=64)


class InProcessServer:
    """build_app(load=...) under uvicorn on a thread: the test holds the engine."""

    def __init__(self, load) -> None:
        import uvicorn

        from hybrid_compile.serving.server import build_app

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.app = build_app(NAME, load=load)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    access_log=False, timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive()
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def test_host_tier_and_elastic_pool_metrics_are_the_engines(ckpt):
    """A server over an engine with the prefix cache's host tier and elastic pools, on pools too small
    for test_prefix_cache_host_tier's workload (three prompt groups with 128-token shared prefixes,
    then the first again): the
    completions are transformers' greedy text, and /metrics exports the host tier's and the elastic
    pools' counters as the engine's stats() has them after the run, the tier written and hit."""
    holder = {}

    def load():
        holder["engine"] = hc.from_pretrained(
            ckpt, device="cpu", max_running_requests=2, max_total_tokens=320, mamba_cache_size=8, chunked_prefill_size=128,
            prefix_cache_host_tier=True, prefix_cache_host_bytes=4 << 20, elastic_pools=True)
        return holder["engine"]

    srv = InProcessServer(load)
    try:
        deadline = time.monotonic() + 60
        while _get(srv.base + "/health")[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
        from test_prefix_cache_host_tier import _waves

        model, tok = load_hf(ckpt)
        for wave in _waves(model.config.vocab_size):
            r = client.completions.create(model=NAME, prompt=wave, max_tokens=4, temperature=0)
            for ch in r.choices:
                assert ch.text == tok.decode(hf_ids(ckpt, wave[ch.index], 4), skip_special_tokens=True)
        m = metrics(srv)
        stats = holder["engine"].stats()
    finally:
        srv.stop()
        if "engine" in holder:
            holder["engine"].close()
    pc, el, p = stats["prefix_cache"], stats["elastic_pools"], "hybrid_compile_"
    assert pc["host_written_tokens"] > 0 and pc["host_hits"] > 0, pc
    for name, key in (("prefix_cache_host_written_tokens_total", "host_written_tokens"),
                      ("prefix_cache_host_loaded_tokens_total", "host_loaded_tokens"),
                      ("prefix_cache_host_hits_total", "host_hits"), ("prefix_cache_host_hit_tokens_total", "host_hit_tokens"),
                      ("prefix_cache_host_kv_tokens", "host_cached_tokens"), ("prefix_cache_host_bytes", "host_bytes_held")):
        assert m[p + name] == pc[key], (name, m[p + name], pc[key])
    assert m[p + "elastic_pool_moves_to_kv_total"] == el["to_kv"]
    assert m[p + "elastic_pool_moves_to_mamba_total"] == el["to_mamba"]


def test_503_while_loading_then_a_failed_step_fails_only_its_requests(ckpt):
    release = threading.Event()
    holder = {}

    def load():
        assert release.wait(60)
        holder["engine"] = hc.from_pretrained(ckpt, **SMALL)
        return holder["engine"]

    srv = InProcessServer(load)
    try:
        code, body = _get(srv.base + "/health")
        assert code == 503 and json.loads(body)["error"]["type"] == "service_unavailable_error"
        code, body = _post_raw(srv.base + "/v1/completions", json.dumps({"model": NAME, "prompt": "hi"}).encode())
        assert code == 503 and set(body["error"]) == {"message", "type", "param", "code"}
        release.set()
        deadline = time.monotonic() + 60
        while _get(srv.base + "/health")[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        engine = holder["engine"]
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)

        # the request's third forward raises: it gets a 500 body, the server keeps serving (the
        # engine rolls the failed step back)
        real_forward = engine.runner.forward
        calls = {"n": 0}

        def failing_forward(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected step failure")
            return real_forward(*args, **kwargs)

        engine.runner.forward = failing_forward
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=NEW, temperature=0,
                                      extra_body={"ignore_eos": True})
        error = info.value.response.json()["error"]
        assert "injected step failure" in error["message"] and error["type"] == "internal_server_error"
        stream = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=NEW, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream) == hf_text(ckpt, PROMPTS[0], NEW)
        assert calls["n"] > 3
        engine.runner.forward = real_forward
    finally:
        release.set()
        srv.stop()
    engine.clear_prefix_cache()
    engine.pools.check_all_free()


def test_async_engine_concurrent_streams_and_early_stop(ckpt):
    engine = hc.from_pretrained(ckpt, **SMALL)
    tok = engine.tokenizer
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:6]]
    params = hc.SamplingParams(max_new_tokens=NEW, eos_token_ids=(tok.eos_token_id,))
    async_engine = hc.AsyncEngine(engine)

    async def collect(ids):
        tokens, updates = [], []
        async for out in async_engine.generate_stream(ids, params):
            tokens.extend(out.new_token_ids)
            updates.append(out)
        assert updates[-1].finished and updates[-1].finish_reason in ("stop", "length")
        assert all(not u.finished for u in updates[:-1]) and updates[-1].num_generated == len(tokens)
        return tokens

    async def stop_early(ids):
        async for out in async_engine.generate_stream(ids, hc.SamplingParams(max_new_tokens=200, ignore_eos=True)):
            if out.num_generated >= 2:
                break  # the consumer stops: the request is aborted at the next step

    async def run():
        results = await asyncio.gather(stop_early(prompts[0]), *(collect(p) for p in prompts))
        # n = 2 sequences of one prompt (prefilled once), greedy: both are transformers' tokens
        pair = await async_engine.generate(prompts[1], dataclasses.replace(params, n=2))
        assert pair == [results[2], results[2]]
        stats = await async_engine.stats()
        return results[1:], stats

    try:
        with pytest.raises(ValueError, match="vocabulary"):
            async_engine.generate_stream([1, 10_000_000], params)
        results, stats = asyncio.run(run())
        for ids, tokens in zip(prompts, results):
            assert tokens == hf_ids(ckpt, ids, NEW)
        assert stats["running"] == 0 and stats["waiting"] == 0
    finally:
        async_engine.shutdown()
    stats = engine.stats()
    assert stats["requests_added"] == len(prompts) + 3
    # (the stopped one ended far before its 200 tokens)
    assert stats["generated_tokens"] < sum(map(len, results)) + 2 * len(results[1]) + 20
    assert not engine.has_unfinished() and not engine._requests  # every request popped
    engine.clear_prefix_cache()
    engine.pools.check_all_free()
    engine.close()



# ---------------------------------------------------------------------------------------------
# the engine in its own process: what only that mode has
# ---------------------------------------------------------------------------------------------


def _fail_forward(call_number: int, engine) -> None:
    """(runs in the engine process, through ``call``) the engine's ``call_number``-th forward from
    now raises."""
    real_forward, calls = engine.runner.forward, {"n": 0}

    def failing_forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call_number:
            raise RuntimeError("injected step failure")
        return real_forward(*args, **kwargs)

    engine.runner.forward = failing_forward


def _frozen_objects(engine) -> int:
    import gc

    return gc.get_freeze_count()


def _pools_free_after_clearing_the_cache(engine) -> bool:
    engine.clear_prefix_cache()
    engine.pools.check_all_free()
    return not engine.has_unfinished()


def test_engine_process_api_streams_a_failed_step_and_shutdown(ckpt):
    async_engine = hc.AsyncEngine.from_pretrained(ckpt, engine_process=True, **SMALL)
    pid = async_engine.process.pid
    tok = async_engine.tokenizer  # the child's tokenizer, in this process
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:4]]
    params = hc.SamplingParams(max_new_tokens=NEW, eos_token_ids=(tok.eos_token_id,))

    async def stop_early(ids):
        async for out in async_engine.generate_stream(ids, hc.SamplingParams(max_new_tokens=200, ignore_eos=True)):
            if out.num_generated >= 2:
                return out.num_generated  # the consumer stops: the child aborts the request at its next step

    async def run():
        first = await asyncio.gather(stop_early(prompts[0]), *(async_engine.generate(p, params) for p in prompts))
        pair = await async_engine.generate(prompts[1], dataclasses.replace(params, n=2))
        # a failing step: its request's stream raises, the engine keeps serving
        await async_engine.call(functools.partial(_fail_forward, 2))
        with pytest.raises(EngineStepError, match="injected step failure"):
            await async_engine.generate(prompts[2], params)
        again = await async_engine.generate(prompts[2], params)
        with pytest.raises(Exception, match="pickle"):  # what cannot travel to the child raises here
            await async_engine.call(lambda engine: 0)
        stats = await async_engine.stats()
        # the loaded engine process froze its long-lived objects (no full collector pass over the model mid-burst)
        assert await async_engine.call(_frozen_objects) > 100_000
        return first, pair, again, stats, await async_engine.call(_pools_free_after_clearing_the_cache)

    try:
        with pytest.raises(ValueError, match="vocabulary"):  # checked in this process, by the front
            async_engine.generate_stream([1, 10_000_000], params)
        first, pair, again, stats, free = asyncio.run(run())
        for ids, tokens in zip(prompts, first[1:]):
            assert tokens == [hf_ids(ckpt, ids, NEW)]
        assert pair == [first[2][0], first[2][0]] and again == first[3]
        assert stats["running"] == 0 and stats["waiting"] == 0 and stats["requests_aborted"] >= 2 and free
        assert stats["generated_tokens"] < 5 * NEW + 2 * NEW + 20  # the early stop ended far before 200
    finally:
        async_engine.shutdown()
    assert async_engine.process.exitcode == 0 and not _alive(pid)

    async def after_shutdown():
        async for _ in async_engine.generate_stream(prompts[0], params):
            pass

    with pytest.raises(EngineClosedError):
        asyncio.run(after_shutdown())


def test_engine_process_killed_fails_streams_and_health_then_the_server_stops_clean(ckpt, tmp_path):
    live = LiveServer(ckpt, tmp_path / "server.log", engine_process=True)
    try:
        live.wait_ready()
        assert 503 in live.health_codes  # the server listened while the child loaded
        children = live.children()
        client = _client(live)
        stream = client.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=400, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        with pytest.raises(openai.APIError, match="exited unexpectedly"):
            for got, _ in enumerate(stream):
                if got == 2:
                    os.kill(live.engine_pid(), signal.SIGKILL)
        code, body = _get(live.base + "/health")
        assert code == 500 and "exited unexpectedly" in json.loads(body)["error"]["message"]
        with pytest.raises(openai.InternalServerError, match="exited unexpectedly"):
            client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4)
        assert _get(live.base + "/metrics")[0] == 200  # the server's own metrics still answer
    finally:
        live.stop()
    assert live.proc.returncode in (0, -15), live.log.read_text()
    assert_no_process_left(children)


def test_engine_process_exits_when_its_server_is_killed(ckpt, tmp_path):
    live = LiveServer(ckpt, tmp_path / "server.log", engine_process=True)
    try:
        live.wait_ready()
        pid = live.engine_pid()
        client = _client(live)
        assert client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=NEW, temperature=0).choices[0].text
        live.proc.kill()  # no shutdown runs: the child finds its parent gone (it idles: within a second or so)
        live.proc.wait()
        assert_no_process_left([pid], timeout=10)
    finally:
        live.stop()


def test_incremental_text_equals_one_decode_and_holds_back_a_stop_string_prefix():
    from checkpoints import build_tokenizer

    from hybrid_compile.serving.detokenize import IncrementalText

    tok = build_tokenizer()
    text = "Hello world! How are you today? numbers 0123 ; é ü"  # multi-byte characters split over tokens
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    inc = IncrementalText(tok)
    pieces = []
    for t in ids:
        inc.add([t])
        pieces.append(inc.take(finished=False))
    inc.finish()
    pieces.append(inc.take(finished=True))
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == inc.text
    assert all("\ufffd" not in p for p in pieces)
    inc = IncrementalText(tok)  # several tokens per update (speculative decoding, overlap)
    for i in range(0, len(ids), 3):
        inc.add(ids[i : i + 3])
    inc.finish()
    assert inc.take(finished=True) == tok.decode(ids, skip_special_tokens=True)

    inc = IncrementalText(tok, stop=["How a", "zzz"])
    streamed = ""
    for t in ids:
        inc.add([t])
        streamed += inc.take(finished=False)
        assert not streamed.endswith("How")  # a possible stop-string start is held back
        if inc.stopped:
            break
    assert inc.stopped and streamed + inc.take(finished=True) == "Hello world! " == inc.text


def test_engine_process_default_and_its_tensor_parallel_refusal():
    """``serve``: the engine in its own process by default, on the driver thread with
    ``--no-engine-process`` and by default under tensor parallelism; ``--engine-process`` with
    ``--tensor-parallel-size`` > 1 is one error naming both (before anything loads)."""
    from hybrid_compile.cli import build_parser, serve_engine_process

    parse = build_parser().parse_args
    assert serve_engine_process(parse(["serve", "--model", "m"])) is True
    assert serve_engine_process(parse(["serve", "--model", "m", "--no-engine-process"])) is False
    assert serve_engine_process(parse(["serve", "--model", "m", "--engine-process"])) is True
    assert serve_engine_process(parse(["serve", "--model", "m", "--tensor-parallel-size", "2"])) is False
    assert serve_engine_process(parse(["serve", "--model", "m", "--tensor-parallel-size", "2",
                                       "--no-engine-process"])) is False
    with pytest.raises(ValueError, match="--engine-process with --tensor-parallel-size"):
        serve_engine_process(parse(["serve", "--model", "m", "--tensor-parallel-size", "2", "--engine-process"]))
