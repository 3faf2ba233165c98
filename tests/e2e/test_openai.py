"""The OpenAI routes (/v1/*) with the official `openai` client against a real
server: vLLM's own serving layer behind our version gate and API token.

One float32 server (`fp32_server`, which test_peft_push.py, after this module,
shares), so logprobs from the /v1 routes and from /generate's scoring of the
same tokens agree to float32 rounding. Tests run in file order: the push comes
after the tests that read the checkpoint's weights.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import torch

from tests.polling import metric, until, until_decoding

# Same tokens, same weights, float32: prefill (scoring) and decode agree to rounding.
LOGPROB_TOL = 1e-5
# Lower-case ASCII and EOS: replies are valid text, so a later turn that replays
# one re-tokenizes it to the very same tokens.
ASCII = {"allowed_token_ids": list(range(97, 123)) + [257]}


@pytest.fixture(scope="module")
def srv(fp32_server):
    return fp32_server  # shared with the other float32 modules (tests/conftest.py)


def oai(server, api_key=None) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key or server.api_token,
                         max_retries=0, timeout=120)


def model_id(server) -> str:
    return oai(server).models.list().data[0].id


def chat(server, messages, **kw):
    """A chat completion with token ids and logprobs; also its version header."""
    raw = oai(server).chat.completions.with_raw_response.create(
        model=model_id(server), messages=messages, max_tokens=kw.pop("max_tokens", 8),
        logprobs=True, seed=kw.pop("seed", 1),
        extra_body={"return_token_ids": True, **ASCII, **kw.pop("extra_body", {})}, **kw)
    return raw.parse(), int(raw.headers["x-weight-version"])


def mean_delta(server, prompt_ids, token_ids, logprobs) -> float:
    """Mean |logprob difference| between a /v1 answer and /generate's scoring
    of the same tokens."""
    assert len(token_ids) == len(logprobs) > 0
    with server.client() as c:
        scored = c.score([list(prompt_ids) + list(token_ids)]).results[0].prompt_logprobs
    ref = scored[len(prompt_ids):]
    return sum(abs(a - b) for a, b in zip(ref, logprobs, strict=True)) / len(ref)


def test_models_lists_the_served_model(srv):
    r = httpx.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {srv.api_token}"})
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == [str(srv.model_path)]
    assert r.json()["weight_version"] == int(r.headers["x-weight-version"])
    assert model_id(srv) == str(srv.model_path)


def test_two_turn_chat_matches_generate_token_for_token(srv):
    with srv.client() as c:
        v = c.info().weight_version
    first, header = chat(srv, [{"role": "user", "content": "hi"}])
    ids1, p1 = first.choices[0].token_ids, first.prompt_token_ids
    lps1 = [t.logprob for t in first.choices[0].logprobs.content]
    assert first.weight_version == header == v and first.versions_used == [v]
    assert first.weight_suspect is False
    # One name, one meaning: the response's versions are versions_used, never weight_versions.
    assert not hasattr(first, "weight_versions")
    # The choice's per-token spans, in vLLM's and SGLang's shape: every token from v.
    assert first.choices[0].weight_versions == [{"version": v, "start": 0, "end": len(ids1),
                                                 "resumed": False}]
    assert mean_delta(srv, p1, ids1, lps1) < LOGPROB_TOL

    answer = first.choices[0].message.content
    second, _ = chat(srv, [{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": answer},
                           {"role": "user", "content": "and?"}], seed=2)
    p2, ids2 = second.prompt_token_ids, second.choices[0].token_ids
    # The second prompt replays the first turn exactly: its prompt, then the reply.
    reply = [t for t in ids1 if t != 257]
    assert p2[:len(p1)] == p1 and p2[len(p1):len(p1) + len(reply)] == reply
    assert second.weight_version == v
    assert mean_delta(srv, p2, ids2, [t.logprob for t in second.choices[0].logprobs.content]
                      ) < LOGPROB_TOL


def test_completion_matches_generate(srv):
    raw = oai(srv).completions.with_raw_response.create(
        model=model_id(srv), prompt="abc", max_tokens=8, logprobs=0, seed=5,
        extra_body={"return_token_ids": True})
    r = raw.parse()
    choice = r.choices[0]
    assert choice.prompt_token_ids == [97, 98, 99]
    assert mean_delta(srv, choice.prompt_token_ids, choice.token_ids,
                      choice.logprobs.token_logprobs) < LOGPROB_TOL
    assert r.weight_version == int(raw.headers["x-weight-version"])
    with srv.client() as c:  # the same seed through /generate samples the same tokens
        g = c.generate(prompt_token_ids=[[97, 98, 99]], sampling=dict(max_tokens=8, seed=5))
    sample = g.results[0].samples[0]
    assert sample.token_ids == choice.token_ids
    # Both routes give the same spans; return_weight_versions=false leaves them out.
    spans = [{"version": r.weight_version, "start": 0, "end": len(choice.token_ids),
              "resumed": False}]
    assert choice.weight_versions == spans
    assert [s.model_dump() for s in sample.weight_versions] == spans
    assert g.versions_used == [r.weight_version]
    bare = oai(srv).completions.create(model=model_id(srv), prompt="abc", max_tokens=2,
                                       extra_body={"return_weight_versions": False})
    assert not hasattr(bare.choices[0], "weight_versions") and bare.versions_used


def test_every_stream_chunk_carries_the_version(srv):
    stream = oai(srv).chat.completions.create(
        model=model_id(srv), messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        stream=True, stream_options={"include_usage": True}, seed=1, logprobs=True,
        extra_body={"return_token_ids": True, **ASCII})
    chunks = list(stream)
    assert len(chunks) >= 3
    versions = {c.weight_version for c in chunks}
    assert len(versions) == 1 and all(c.versions_used == [*versions] for c in chunks)
    # Streamed and non-streamed: the same tokens for the same seed.
    whole, _ = chat(srv, [{"role": "user", "content": "hi"}], max_tokens=6)
    streamed = [t for c in chunks if c.choices
                for t in (getattr(c.choices[0], "token_ids", None) or [])]
    assert streamed == whole.choices[0].token_ids
    # The choice's last chunk (the one with its finish_reason) carries its spans.
    spanned = [c.choices[0] for c in chunks if c.choices
               and getattr(c.choices[0], "weight_versions", None) is not None]
    assert len(spanned) == 1 and spanned[0].finish_reason is not None
    assert spanned[0].weight_versions == [{"version": versions.pop(), "start": 0,
                                           "end": len(streamed), "resumed": False}]


def test_token_is_required(srv):
    with pytest.raises(openai.AuthenticationError):
        oai(srv, api_key="wrong").chat.completions.create(
            model=model_id(srv), messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    for path in ("/v1/models", "/v1/completions", "/v1/chat/completions"):
        r = httpx.request("GET" if path == "/v1/models" else "POST", srv.url + path,
                          json={"prompt": "a"})
        assert r.status_code == 401, path


@pytest.mark.parametrize("body, status, field", [
    ({"prompt": "a", "max_tokens": 1, "min_weight_version": "soon"}, 400, "min_weight_version"),
    ({"prompt": "a", "max_tokens": 1, "use_beam_search": True}, 400, "use_beam_search"),
    ({"prompt": "a", "max_tokens": 1, "max_version_lag": 0}, 400, "max_version_lag"),
    ({"prompt": "a", "max_tokens": "many"}, 422, "max_tokens"),
])
def test_our_checks_answer_in_our_shape(srv, body, status, field):
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30,
                   headers={"Authorization": f"Bearer {srv.api_token}"})
    assert r.status_code == status and r.json()["field"] == field, r.text


def test_future_min_weight_version_is_409_not_a_hang(srv):
    with srv.client() as c:
        future = c.info().weight_version + 5
    for stream in (False, True):
        t0 = time.monotonic()
        with pytest.raises(openai.ConflictError):
            oai(srv).chat.completions.create(
                model=model_id(srv), messages=[{"role": "user", "content": "hi"}],
                max_tokens=2, stream=stream, extra_body={"min_weight_version": future})
        # The fixture's ROLLOUT_SIDECAR_MIN_VERSION_WAIT_S is 3 s.
        assert time.monotonic() - t0 < 15


@pytest.mark.parametrize("stream", [False, True])
def test_work_of_a_client_that_left_is_aborted(srv, stream):
    """The client leaves once the engine has sampled for its request; the
    engine then samples far fewer tokens than the request asked for (counted
    by the engine itself, so a fast machine cannot finish the work before we
    leave and pass by luck). Leaving only after the first sampled token keeps
    the count's lower bound from racing the prefill: leaving earlier, the
    abort may land before any token and the count cannot show it works."""
    n, max_tokens = 8, 400
    body = json.dumps({"model": "", "messages": [{"role": "user", "content": "hi"}], "n": n,
                       "max_tokens": max_tokens, "ignore_eos": True, "stream": stream})
    before = metric(srv, "rollout_sidecar_engine_generation_tokens_total")
    host, port = srv.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/chat/completions", body=body,
                 headers={"Authorization": f"Bearer {srv.api_token}",
                          "Content-Type": "application/json"})
    until_decoding(srv, before, "the engine sampling for the request")
    conn.sock.shutdown(socket.SHUT_RDWR)  # the client leaves mid-request
    conn.close()
    until(lambda: metric(srv, "rollout_sidecar_engine_unfinished_requests") == 0
          and metric(srv, "rollout_sidecar_requests_in_flight") == 0,
          "the request ending once its client left")
    sampled = metric(srv, "rollout_sidecar_engine_generation_tokens_total") - before
    assert 0 < sampled < n * max_tokens / 2, f"{sampled} of {n * max_tokens} tokens sampled"


def stream_in_background(server, body: dict) -> tuple[threading.Thread, list, threading.Event]:
    """A /v1 stream read on a thread; `started` is set at its first chunk."""
    chunks, started = [], threading.Event()

    def read() -> None:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=300,
                          headers={"Authorization": f"Bearer {server.api_token}"}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[len("data: "):]))
                    started.set()
        started.set()

    t = threading.Thread(target=read)
    t.start()
    return t, chunks, started


def test_a_push_aborts_a_stream_and_the_version_advances(srv):
    from transformers import AutoModelForCausalLM

    from rollout_sidecar.trainer import WeightPusher

    messages = [{"role": "user", "content": "hi"}]
    before, v = chat(srv, messages)
    model = AutoModelForCausalLM.from_pretrained(srv.model_path, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    # Long enough to be running when the commit comes (seconds of decoding).
    t, chunks, started = stream_in_background(srv, {
        "model": "", "messages": messages, "n": 32, "max_tokens": 480, "ignore_eos": True,
        "stream": True, "return_token_ids": True})
    assert started.wait(120) and chunks
    pusher = WeightPusher(srv.url, admin_token=srv.admin_token, transport="http",
                          commit_policy="abort")
    assert pusher.push(model, version=v + 1).version == v + 1
    t.join(300)
    finish = {c["index"]: c["finish_reason"] for ch in chunks for c in ch["choices"]
              if c.get("finish_reason")}
    assert "abort" in finish.values()  # the commit ended it ...
    # ... and every chunk names only the version that produced it.
    assert {(ch["weight_version"], tuple(ch["versions_used"])) for ch in chunks} == {
        (v, (v,))}
    # Aborted choices carry their spans too: every token they got, from v.
    streamed: dict[int, int] = {}
    for ch in chunks:
        for c in ch["choices"]:
            streamed[c["index"]] = streamed.get(c["index"], 0) + len(c.get("token_ids") or [])
            if c.get("finish_reason"):
                assert c["weight_versions"] == ([{"version": v, "start": 0, "resumed": False,
                                                  "end": streamed[c["index"]]}]
                                                if streamed[c["index"]] else []), c

    after, header = chat(srv, messages, extra_body={"min_weight_version": v + 1})
    assert after.weight_version == header == v + 1 and after.versions_used == [v + 1]
    lps = [t.logprob for t in after.choices[0].logprobs.content]
    assert lps != [t.logprob for t in before.choices[0].logprobs.content]
    # And they are the pushed weights' logprobs, as /generate scores them now.
    assert mean_delta(srv, after.prompt_token_ids, after.choices[0].token_ids, lps
                      ) < LOGPROB_TOL
    r = oai(srv).completions.create(model=model_id(srv), prompt="abc", max_tokens=2)
    assert r.weight_version == v + 1
