"""Writers of small model files for tests: GGUF files through the gguf package's GGUFWriter and
Hugging Face checkpoint folders through transformers; the grids of parametrized sweeps."""

import contextlib
import io
import itertools
import os
import subprocess
import warnings

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, quants

from minillm.formats.tokenizer_files import bytes_to_unicode


def sweep(*axes, fast):
    """A grid for ``pytest.mark.parametrize``: the product of ``axes`` (lists of values, or of tuples that fill
    several names). The combinations ``fast(*values)`` accepts run in ``make test-fast``, a corner of the grid;
    the others are marked slow and run in ``make test`` with them."""
    grid = []
    for combo in itertools.product(*axes):
        values = tuple(v for part in combo for v in (part if isinstance(part, tuple) else (part,)))
        one = values if len(values) > 1 else values[0]
        grid.append(one if fast(*values) else pytest.param(*values, marks=pytest.mark.slow))
    return grid


def run_cli(*args, cwd=None) -> subprocess.CompletedProcess:
    """``python -m minillm ARGS`` inside this process: its exit status, standard output and standard error as
    ``subprocess.run`` gives them, without a new interpreter's two seconds of importing torch. For commands that
    refuse or do a little work on a tiny model; what needs a process of its own (signals, a server, imports
    counted from nothing) starts one."""
    from minillm.cli import main
    from minillm.fast.threads import GOVERNOR

    out, err, threads, env = io.StringIO(), io.StringIO(), torch.get_num_threads(), dict(os.environ)
    governor = dict(vars(GOVERNOR))  # what the thread governor last saw: a command's run must not switch it off
    os.environ.pop("MINILLM_FIGURES", None)  # as a user's shell would have it
    try:
        with contextlib.chdir(cwd or "."), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                warnings.catch_warnings():
            warnings.simplefilter("default")  # a warning is printed once per command, as in a new process
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            # printed where the command's stderr goes, not recorded by pytest (catch_warnings restores this)
            warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: err.write(
                warnings.formatwarning(message, category, filename, lineno, line))
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:  # argparse's refusals exit 2; SystemExit(None) is 0
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        os.environ.clear()
        os.environ.update(env)
        torch.set_num_threads(threads)  # a command may size torch's pool for its own measurement
        vars(GOVERNOR).update(governor)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


TINY = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, vocab=300, ctx=128)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in float32 on the CPU (a and b may sit on different devices)."""
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return float((a - b).norm() / b.norm())


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows (pairs interleaved per head)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_llama_weights(seed=0, cfg=TINY):
    rng = np.random.default_rng(seed)
    C, D, F, V = cfg["dim"], cfg["head_dim"], cfg["ffn_dim"], cfg["vocab"]
    w = {"token_embd.weight": rng.standard_normal((V, C)), "output_norm.weight": 1 + 0.1 * rng.standard_normal(C)}
    for i in range(cfg["n_layers"]):
        w.update({
            f"blk.{i}.attn_norm.weight": 1 + 0.1 * rng.standard_normal(C),
            f"blk.{i}.ffn_norm.weight": 1 + 0.1 * rng.standard_normal(C),
            f"blk.{i}.attn_q.weight": rng.standard_normal((cfg["n_heads"] * D, C)) / 8,
            f"blk.{i}.attn_k.weight": rng.standard_normal((cfg["n_kv_heads"] * D, C)) / 8,
            f"blk.{i}.attn_v.weight": rng.standard_normal((cfg["n_kv_heads"] * D, C)) / 8,
            f"blk.{i}.attn_output.weight": rng.standard_normal((C, cfg["n_heads"] * D)) / 8,
            f"blk.{i}.ffn_gate.weight": rng.standard_normal((F, C)) / 8,
            f"blk.{i}.ffn_up.weight": rng.standard_normal((F, C)) / 8,
            f"blk.{i}.ffn_down.weight": rng.standard_normal((C, F)) / 8,
        })
    return {k: v.astype(np.float32) for k, v in w.items()}


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def write_tiny_gguf(path, weights=None, arch="llama", qtypes=None, drop=(), metadata_overrides=None, cfg=TINY,
                    raw=None, chat_template=None):
    """Write a tiny llama GGUF. ``weights`` are in HF row order; Q/K are permuted as llama.cpp does.

    qtypes: {tensor name: GGMLQuantizationType} (default F32); drop: tensor names to leave out;
    raw: {tensor name: (uint8 bytes (rows, bytes per row), GGMLQuantizationType)} written as they are.
    chat_template: a Jinja chat template to store (``CHATML``: ChatML, as SmolLM2's), or None.
    Returns the weights written (float32, before quantization and permutation).
    """
    weights = tiny_llama_weights() if weights is None else weights
    meta = {"block_count": cfg["n_layers"], "ctx": cfg["ctx"], "dim": cfg["dim"], "ffn": cfg["ffn_dim"],
            "heads": cfg["n_heads"], "kv_heads": cfg["n_kv_heads"]}
    meta.update(metadata_overrides or {})
    wr = GGUFWriter(str(path), arch)
    wr.add_block_count(meta["block_count"])
    wr.add_context_length(meta["ctx"])
    wr.add_embedding_length(meta["dim"])
    wr.add_feed_forward_length(meta["ffn"])
    wr.add_head_count(meta["heads"])
    wr.add_head_count_kv(meta["kv_heads"])
    wr.add_rope_freq_base(10000.0)
    wr.add_layer_norm_rms_eps(1e-5)
    b2u = bytes_to_unicode()
    tokens = ["<|endoftext|>"] + [b2u[b] for b in range(256)]
    tokens += [f"{b2u[ord('a')]}{i}" for i in range(cfg["vocab"] - len(tokens))]
    wr.add_tokenizer_model("gpt2")
    wr.add_token_list(tokens)
    wr.add_token_types([3] + [1] * (len(tokens) - 1))
    wr.add_eos_token_id(0)
    if chat_template:
        wr.add_chat_template(chat_template)
    for name, w in weights.items():
        if name in drop:
            continue
        if name in (raw or {}):
            wr.add_tensor(name, raw[name][0], raw_dtype=raw[name][1])
            continue
        if name.endswith("attn_q.weight"):
            w = llama_cpp_permute(w, cfg["n_heads"])
        elif name.endswith("attn_k.weight"):
            w = llama_cpp_permute(w, cfg["n_kv_heads"])
        qtype = (qtypes or {}).get(name, Q.F32)
        if qtype == Q.F32:
            wr.add_tensor(name, w)
        elif qtype == Q.F16:
            wr.add_tensor(name, w.astype(np.float16))
        else:
            wr.add_tensor(name, quants.quantize(w, qtype), raw_dtype=qtype)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return weights


def write_hf_checkpoint(folder, arch="llama", tie=False, seed=0):
    """A tiny random LlamaForCausalLM (GQA) or GPT2LMHeadModel saved with safetensors; returns the model."""
    import transformers

    torch.manual_seed(seed)
    if arch == "llama":
        config = transformers.LlamaConfig(
            vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rope_theta=5000.0, tie_word_embeddings=tie,
        )
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(vocab_size=320, n_embd=64, n_layer=2, n_head=4, n_positions=128)
        model = transformers.GPT2LMHeadModel(config)
    model.eval().save_pretrained(folder, safe_serialization=True)
    return model


def random_decoder(vocab_size: int, scale: float = 1.0, max_seq_len: int = 512, head_dim: int = 16):
    """A 2-layer Llama ``Decoder`` (GQA: 4 heads, 2 KV heads, width 4 * head_dim) with seeded random weights."""
    from minillm.config import ModelConfig
    from minillm.model import Decoder

    torch.manual_seed(0)
    C, Ckv = 4 * head_dim, 2 * head_dim
    cfg = ModelConfig(n_layers=2, dim=C, n_heads=4, n_kv_heads=2, head_dim=head_dim, ffn_dim=128,
                      vocab_size=vocab_size, max_seq_len=max_seq_len)
    state = {"tok_embeddings.weight": scale * torch.randn(vocab_size, C), "norm.weight": torch.ones(C)}
    for i in range(2):
        p = f"layers.{i}"
        state.update({f"{p}.attn_norm.weight": torch.ones(C), f"{p}.ffn_norm.weight": torch.ones(C),
                      f"{p}.attn.wq.weight": torch.randn(C, C) / 8, f"{p}.attn.wk.weight": torch.randn(Ckv, C) / 8,
                      f"{p}.attn.wv.weight": torch.randn(Ckv, C) / 8, f"{p}.attn.wo.weight": torch.randn(C, C) / 8,
                      f"{p}.mlp.w_gate.weight": torch.randn(128, C) / 8, f"{p}.mlp.w_up.weight": torch.randn(128, C) / 8,
                      f"{p}.mlp.w_down.weight": torch.randn(C, 128) / 8})
    return Decoder(cfg, state).eval()


def paged_cache(config, *args, attention="blockwise", **kwargs):
    """A paged KV cache with any read: the library's ("blockwise", "gather") or the speed layer's ("bucketed",
    "indexed", "fused", which importing minillm.fast registers)."""
    import minillm.fast  # noqa: F401
    from minillm.paged.cache import backend

    return backend(attention)(config, *args, attention=attention, **kwargs)
