"""The server as vLLM's, for the clients that score and load it (lm-eval's local-completions, guidellm, vLLM's
benchmark): log-probabilities (the model's own, equal to a direct forward within float32 noise), echo, prompt
scoring, lists of prompts, /tokenize, /detokenize, /tokenizer_info, usage in streams, speculation counters,
and a 400 naming the field for each value refused. A tiny random model; the embedded one where marked slow."""

import json

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from test_server import Served, serve, sse_events
from test_server import one_thread, server, tiny, tiny_path  # noqa: F401  (the same fixtures: pytest finds them here)

from minillm.evaluation import reference_logprobs
from minillm.server.logprobs import MAX_LOGPROBS

ATOL = 1e-4  # float32 noise on log-probabilities of magnitude up to ~40 (the tiny random model's)


def direct(model, ids: list[int]) -> torch.Tensor:
    """(T - 1, V): log p(ids[t] | ids[:t]) rows of one plain forward (the library's perplexity oracle)."""
    return reference_logprobs(model, ids, seqlen=len(ids))[0]


def check_against_direct(model, ids, logprobs, top):
    """A legacy-completions ``logprobs`` over ``ids`` (first token null) against a direct forward."""
    rows = direct(model, ids)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    got = torch.tensor(logprobs["token_logprobs"][1:], dtype=torch.float64)
    want = rows.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].double()
    assert torch.allclose(got, want, atol=ATOL), (got - want).abs().max()
    for t, alternatives in enumerate(logprobs["top_logprobs"][1:]):
        best = rows[t].topk(top).values.double()
        values = sorted(alternatives.values(), reverse=True)
        # the dict holds the chosen token and the top alternatives: at most top + 1 entries
        assert top <= len(alternatives) <= top + 1 or len(set(alternatives)) < top
        assert torch.allclose(torch.tensor(values[:top], dtype=torch.float64), best[:len(values[:top])], atol=ATOL)


def post(server, path, body):
    r = server.http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


# ---- completions: what lm-eval's loglikelihood requests read ---------------------------------------------------
def test_echo_with_logprobs_equals_a_direct_forward_of_the_model(server, tiny):
    model, tok = tiny
    prompt = "the cat sat on the mat"
    ids = tok.encode(prompt)
    body = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "logprobs": 3, "echo": True,
                                            "temperature": 0})
    c = body["choices"][0]
    generated = c["logprobs"]["tokens"][len(ids):]
    assert len(generated) == 1 and c["text"].startswith(prompt)
    full = ids + tok.encode(c["text"][len(prompt):])
    check_against_direct(model, full, c["logprobs"], 3)
    assert c["logprobs"]["tokens"] == [tok.decode([i]) for i in full]
    offsets = c["logprobs"]["text_offset"]
    assert offsets == [sum(len(t) for t in c["logprobs"]["tokens"][:i]) for i in range(len(full))]
    # greedy: the generated token's logprob is the best alternative exactly (lm-eval's is_greedy compares them)
    assert c["logprobs"]["token_logprobs"][-1] == max(c["logprobs"]["top_logprobs"][-1].values())
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}


def test_max_tokens_0_with_echo_scores_a_list_of_token_id_prompts(server, tiny):
    model, tok = tiny
    long = [(7 * i) % 250 + 3 for i in range(600)]  # past one scoring chunk (256 tokens)
    prompts = [[5, 6, 7, 8], long, [9, 10]]
    body = post(server, "/v1/completions", {"prompt": prompts, "max_tokens": 0, "logprobs": 0, "echo": True})
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for c, ids in zip(body["choices"], prompts):
        assert c["text"] == tok.decode(ids) and c["finish_reason"] == "length"
        assert len(c["logprobs"]["token_logprobs"]) == len(ids)
        check_against_direct(model, ids, c["logprobs"], 0)
    assert body["usage"] == {"prompt_tokens": 606, "completion_tokens": 0, "total_tokens": 606}
    assert server.wait_all_free()[2] is False  # nothing ran in the engine, nothing is left there


def test_logprobs_without_echo_cover_the_generated_tokens_only(server, tiny):
    model, tok = tiny
    body = post(server, "/v1/completions", {"prompt": [3, 4, 5], "max_tokens": 5, "logprobs": 2, "temperature": 0,
                                            "ignore_eos": True})
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 5 and lp["text_offset"][0] == 0
    generated = [tok.encode(t)[0] for t in lp["tokens"]]  # byte tokens: one id each
    rows = direct(model, [3, 4, 5] + generated)[2:]
    want = rows.gather(1, torch.tensor(generated)[:, None])[:, 0].double()
    assert torch.allclose(torch.tensor(lp["token_logprobs"], dtype=torch.float64), want, atol=ATOL)
    assert all(2 <= len(t) <= 3 for t in lp["top_logprobs"])  # the two best, and the chosen token if not among them


def test_a_list_of_prompts_gives_one_choice_per_prompt_and_sample_with_its_index(server):
    prompts = ["hello there", "the cat sat on", "a b c d e"]
    body = post(server, "/v1/completions", {"prompt": prompts, "max_tokens": 6, "n": 2, "temperature": 0})
    assert [c["index"] for c in body["choices"]] == list(range(6))
    singles = [post(server, "/v1/completions", {"prompt": p, "max_tokens": 6, "temperature": 0}) for p in prompts]
    for p, single in enumerate(singles):
        for i in range(2):
            assert body["choices"][2 * p + i]["text"] == single["choices"][0]["text"]
    assert body["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert body["usage"]["completion_tokens"] == 2 * sum(s["usage"]["completion_tokens"] for s in singles)


def test_streamed_logprobs_and_usage_add_up_to_the_whole_response(server):
    request = {"prompt": ["hello there", "once upon a time"], "max_tokens": 12, "logprobs": 2, "temperature": 0,
               "ignore_eos": True}
    whole = post(server, "/v1/completions", request)
    streamed = {0: [], 1: []}
    usages = []
    with server.http.stream("POST", "/v1/completions", json={
            **request, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
        events = list(sse_events(r))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for chunk in chunks[:-1]:
        usages.append(chunk["usage"])  # every chunk carries its prompt's usage so far
        for c in chunk["choices"]:
            streamed[c["index"]].append(c)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert all(u["completion_tokens"] <= 12 for u in usages)
    for index, parts in streamed.items():
        want = whole["choices"][index]
        assert "".join(p["text"] for p in parts) == want["text"]
        tokens = [t for p in parts if p["logprobs"] for t in p["logprobs"]["tokens"]]
        logprobs = [x for p in parts if p["logprobs"] for x in p["logprobs"]["token_logprobs"]]
        offsets = [x for p in parts if p["logprobs"] for x in p["logprobs"]["text_offset"]]
        assert tokens == want["logprobs"]["tokens"] and offsets == want["logprobs"]["text_offset"]
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(want["logprobs"]["token_logprobs"]), atol=ATOL)


def test_chat_logprobs_equal_a_direct_forward_of_the_templated_conversation(server, tiny):
    model, tok = tiny
    messages = [{"role": "user", "content": "hi there"}]
    body = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 4, "temperature": 0,
                                                 "logprobs": True, "top_logprobs": 2, "ignore_eos": True})
    content = body["choices"][0]["logprobs"]["content"]
    ids = tok.apply_chat_template(messages)
    out = [tok.encode(bytes(item["bytes"]).decode("utf-8", "replace"))[0] for item in content]
    assert "".join(item["token"] for item in content) == body["choices"][0]["message"]["content"]
    rows = direct(model, ids + out)[len(ids) - 1:]
    want = rows.gather(1, torch.tensor(out)[:, None])[:, 0].double()
    assert torch.allclose(torch.tensor([item["logprob"] for item in content], dtype=torch.float64), want, atol=ATOL)
    for item, row in zip(content, rows):
        assert len(item["top_logprobs"]) == 2
        assert abs(item["top_logprobs"][0]["logprob"] - row.max().item()) < ATOL


def test_openais_client_reads_logprobs_and_echo(server, tiny):
    _, tok = tiny
    got = server.client.completions.create(model="tiny", prompt=["hello", "the cat"], max_tokens=2, logprobs=2,
                                           echo=True, temperature=0)
    assert [c.index for c in got.choices] == [0, 1] and got.choices[1].text.startswith("the cat")
    assert got.choices[0].logprobs.token_logprobs[0] is None and len(got.choices[0].logprobs.tokens) == 5 + 2
    chat = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3, logprobs=True, top_logprobs=2, temperature=0)
    content = chat.choices[0].logprobs.content
    assert "".join(item.token for item in content) == chat.choices[0].message.content
    assert all(len(item.top_logprobs) == 2 for item in content)


# ---- refusals: OpenAI's error shape, naming the field ----------------------------------------------------------
REFUSED = [
    ("/v1/completions", {"prompt": "hi", "logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": [], "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": ["hi", ""], "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "stream": True}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": 2}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "hi"}]}, "prompt"),
    ("/detokenize", {"tokens": [1, 10 ** 6]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
]


@pytest.mark.parametrize("path, body, param", REFUSED, ids=[f"{p}-{json.dumps(b)[:60]}" for p, b, _ in REFUSED])
def test_refused_values_get_openais_error_naming_the_field(server, path, body, param):
    r = server.http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and param in error["message"], error


def test_without_a_tokenizer_echo_and_logprobs_are_refused_naming_them(tiny):
    thread, loop = serve(tiny[0], None)
    with thread:
        served = Served(thread, loop)
        for field, body in [("echo", {"echo": True}), ("logprobs", {"logprobs": 1})]:
            r = served.http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert post(served, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2})["usage"]["completion_tokens"] == 2
        served.http.close()


# ---- tokenizer routes, in vLLM's shapes ------------------------------------------------------------------------
def test_tokenize_and_detokenize_give_the_ids_the_completions_run(server, tiny):
    _, tok = tiny
    text = "hello there, you"
    got = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True})
    assert set(got) == {"count", "max_model_len", "tokens", "token_strs"}
    assert got["tokens"] == tok.encode(text) and got["count"] == len(got["tokens"]) and got["max_model_len"] == 4096
    assert "".join(got["token_strs"]) == text
    usage = post(server, "/v1/completions", {"prompt": text, "max_tokens": 1})["usage"]
    assert usage["prompt_tokens"] == got["count"]
    assert post(server, "/detokenize", {"tokens": got["tokens"]}) == {"prompt": text}
    messages = [{"role": "user", "content": "hi"}]
    chat = post(server, "/tokenize", {"messages": messages})
    assert chat["tokens"] == tok.apply_chat_template(messages)
    assert chat["count"] == post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}
                                 )["usage"]["prompt_tokens"]
    assert post(server, "/tokenize", {"prompt": ""})["count"] == 0


def test_tokenizer_info_names_the_special_tokens_and_the_template(server, tiny):
    _, tok = tiny
    info = server.http.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and info["eos_token_id"] == tok.eos_id
    assert info["chat_template"] == tok.chat_template and info["model_max_length"] == 4096
    assert server.http.get("/health").status_code == 200


# ---- metrics ---------------------------------------------------------------------------------------------------
def metric_values(served):
    text = served.http.get("/metrics").text
    return {(s.name, s.labels.get("position")): s.value for f in text_string_to_metric_families(text)
            for s in f.samples}


def test_speculation_counters_in_metrics_equal_the_engines(tiny):
    thread, loop = serve(*tiny, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    with thread:
        served = Served(thread, loop)
        prompt = "a b c a b c a b c a b c a b c"  # prompt lookup finds drafts here
        post(served, "/v1/completions", {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True})
        got = metric_values(served)
        spec = served.engine(lambda e: e.stats.spec_decoding)
        assert spec.num_drafts > 0
        assert got[("vllm:spec_decode_num_drafts_total", None)] == spec.num_drafts
        assert got[("vllm:spec_decode_num_draft_tokens_total", None)] == spec.num_draft_tokens
        assert got[("vllm:spec_decode_num_accepted_tokens_total", None)] == spec.num_accepted_tokens
        for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
            assert got[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(pos))] == n
        served.http.close()


def test_a_server_that_does_not_speculate_exports_no_speculation_counters(server):
    assert not any("spec_decode" in name for name, _ in metric_values(server))


# ---- the embedded model ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_embedded_model_scores_as_a_direct_forward(model_and_tokenizer):
    model, tok = model_and_tokenizer
    thread, loop = serve(model, tok, name="smollm2", num_blocks=64)
    with thread:
        served = Served(thread, loop)
        context, continuation = "The capital of France is", " Paris"
        ids = tok.encode(context + continuation)
        body = post(served, "/v1/completions", {"prompt": [ids], "max_tokens": 1, "logprobs": 1, "echo": True,
                                                "temperature": 0})
        logprobs = body["choices"][0]["logprobs"]
        assert len(logprobs["tokens"]) == len(ids) + 1
        check_against_direct(model, ids, {k: v[:len(ids)] for k, v in logprobs.items()}, 1)
        served.http.close()


# ---- lm-evaluation-harness' own readers ----------------------------------------------------------------------
def test_lm_evals_local_completions_parser_reads_the_scores_of_a_direct_forward(server, tiny):
    """lm-eval's loglikelihood request (its payload: max_tokens 1, logprobs 1, echo, a batch of token-id prompts)
    parsed by its own ``parse_logprobs``: the sum and is_greedy of each continuation, from a direct forward."""
    completions = pytest.importorskip("lm_eval.models.openai_completions")
    model, _ = tiny
    requests = [([5, 6, 7, 8], [9, 10]), ([20, 21], [22]), ([30, 31, 32], [33, 34, 35])]
    prompts = [context + continuation for context, continuation in requests]
    out = post(server, "/v1/completions", {"model": "tiny", "prompt": prompts, "temperature": 0, "max_tokens": 1,
                                           "logprobs": 1, "seed": 1234, "echo": True})
    parsed = completions.LocalCompletionsAPI.parse_logprobs(out, tokens=prompts,
                                                             ctxlens=[len(c) for c, _ in requests])
    for (context, continuation), (total, greedy) in zip(requests, parsed):
        rows = direct(model, context + continuation)[len(context) - 1:]
        want = rows.gather(1, torch.tensor(continuation)[:, None]).sum().item()
        assert abs(total - want) < ATOL * len(continuation)
        assert greedy == bool((rows.argmax(-1) == torch.tensor(continuation)).all())


def test_lm_evals_remote_tokenizer_works_through_the_server(server, tiny):
    utils = pytest.importorskip("lm_eval.utils")
    _, tok = tiny
    assert utils.check_remote_tokenizer_support(server.url + "/v1/completions")
    remote = utils.RemoteTokenizer(server.url + "/v1/completions")
    assert remote.encode("hello there") == tok.encode("hello there")
    assert remote.decode(tok.encode("hello there")) == "hello there"
    assert remote.eos_token == "<|endoftext|>"
    assert remote.eos_token_id == tok.eos_id  # lm-eval's stop string for generation: the EOS text is one token


def test_special_token_text_in_a_completions_prompt_is_the_special_token(server, tiny):
    _, tok = tiny
    eos = "<|endoftext|>"
    got = post(server, "/tokenize", {"prompt": "hi" + eos})["tokens"]
    assert got == tok.encode("hi") + [tok.eos_id]
    usage = post(server, "/v1/completions", {"prompt": "hi" + eos, "max_tokens": 1})["usage"]
    assert usage["prompt_tokens"] == len(got)
    messages = [{"role": "user", "content": eos}]  # chat content is text, never a control token
    chat = post(server, "/tokenize", {"messages": messages})["tokens"]
    assert chat == tok.apply_chat_template(messages) and tok.eos_id not in chat
