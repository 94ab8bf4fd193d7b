"""What every subcommand of ``python -m minillm`` shares: argument types, the model options and
loading a model from them, checks that run before a model is loaded, and strict JSON output.

Each command module (``minillm.cli``, the ``cli.py`` of a technique folder, the lab's benchmarks, the
server's and the exercises' ``cli.py``) registers its subcommands with ``parser.set_defaults(func=...)``;
``minillm.cli.main`` calls ``args.func(args)``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .files import dumps_strict
from .loading import load_model


def at_least(n: int):
    """argparse type: an integer >= n."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < n:
            raise argparse.ArgumentTypeError(f"must be >= {n}, got {value}")
        return value
    return parse


def int_list(n: int, allow_empty: bool = True):
    """argparse type: comma-separated integers, each >= n ('' is an empty tuple if allowed)."""
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        if any(v < n for v in values):
            raise argparse.ArgumentTypeError(f"each value must be >= {n}, got {text!r}")
        if not values and not allow_empty:
            raise argparse.ArgumentTypeError("give at least one value")
        return values
    return parse


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model, --dtype, --device, --shards, --json: the options of every command that loads a model."""
    p.add_argument("--model", default=None, help="a .gguf file, a Hugging Face checkpoint folder, or a "
                   ".safetensors file written by `quantize` (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                   help="weights and activations (default float32)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--shards", type=at_least(1), default=None,
                   help="weight column blocks per matmul (default: one per CPU thread; use 1 on a busy machine)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def check_model_path(path: str | None, option: str = "--model") -> None:
    """Refuse, before anything is loaded, a model path that cannot be a model: one that does not
    exist, or a file that is neither .gguf nor .safetensors (a folder is read as a Hugging Face
    checkpoint and checked when loaded)."""
    if path is None:
        return
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{path}: no such file or folder ({option}); give a .gguf file, a .safetensors file "
                         "written by `python -m minillm quantize`, or a Hugging Face checkpoint folder")
    if p.is_file() and p.suffix not in (".gguf", ".safetensors"):
        raise ValueError(f"{option}: {path!r} is neither a .gguf nor a .safetensors file; give a model file or a "
                         "Hugging Face checkpoint folder")


def device_of(args) -> torch.device:
    """``--device``, checked: a CPU or an available CUDA device."""
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ValueError(f"device: {args.device!r} is not a device name; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device: {args.device!r} is not supported; use cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {args.device!r} is not available on this machine (torch sees no CUDA GPU); "
                         "use --device cpu")
    return device


def load(args):
    """(model, tokenizer) from the model options, with a progress bar unless ``--json``."""
    check_model_path(args.model)
    return load_model(args.model, dtype=args.dtype, device=device_of(args), progress=not args.json,
                      n_shards=args.shards)


def is_quantized_file(path: str | None) -> bool:
    """A ``.safetensors`` written by ``quantize``: its linear layers are already quantized."""
    return path is not None and Path(path).suffix == ".safetensors" and Path(path).is_file()


def print_json(obj) -> None:
    """One line of strict JSON on stdout (NaN and infinity as null; see ``files.dumps_strict``)."""
    print(dumps_strict(obj))
    sys.stdout.flush()
