"""The engine on the embedded SmolLM2-135M (slow: the model fixtures): greedy requests of mixed lengths
through a small pool (chunked prefill, preemption) equal generate_cached alone, with the logits within
1e-4 of a recompute; chat through the template; the tour's row."""

import torch

from minillm import LLM, SamplingParams, generate_cached
from minillm.data import play_text
from minillm.lab.tour import engine_row


def test_greedy_requests_equal_generate_cached_on_the_real_model(model, tokenizer):
    text = tokenizer.encode(play_text("hamlet"))
    lengths = [(90, 12), (7, 20), (40, 9), (130, 6)]
    prompts = [text[700 * i:700 * i + p] for i, (p, _) in enumerate(lengths)]
    params = [SamplingParams(max_tokens=o, ignore_eos=True) for _, o in lengths]
    llm = LLM(model, tokenizer=tokenizer, num_blocks=12, max_num_batched_tokens=32, record_logits=True,
              disable_log_stats=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.llm_engine.stats.preemptions > 0
    for i, (out, p, sp) in enumerate(zip(outs, prompts, params)):
        tokens = out.outputs[0].token_ids
        with torch.inference_mode():
            ref = model(torch.tensor([p + tokens]), torch.arange(len(p) + len(tokens)))[0, len(p) - 1:-1]
        torch.testing.assert_close(torch.stack(llm.llm_engine.logits[(out.request_id, 0)]), ref, atol=1e-4, rtol=0)
        assert tokens == generate_cached(model, p, sp).tokens
    assert llm.llm_engine.manager.num_free_blocks == 12


def test_chat_and_text_prompts(model, tokenizer):
    llm = LLM(model, tokenizer=tokenizer, num_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=16)
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}], params, use_tqdm=False)[0]
    ids = tokenizer.encode_chat("What is the capital of France?")
    alone = generate_cached(model, ids, params, tokenizer=tokenizer)
    assert chat.prompt_token_ids == ids and chat.outputs[0].token_ids == alone.tokens
    assert chat.outputs[0].text == alone.text
    text = llm.generate("The history of the printing press begins", params, use_tqdm=False)[0]
    assert text.outputs[0].token_ids == generate_cached(model, tokenizer.encode(text.prompt), params,
                                                        tokenizer=tokenizer).tokens


def test_tour_engine_row(model, tokenizer):
    row = engine_row(model, tokenizer, new_tokens=4, num_requests=2)
    assert set(row) == {"technique", "baseline", "baseline_tokens_per_s", "tokens_per_s", "speedup", "check"}
    assert row["check"] == "greedy tokens identical"
