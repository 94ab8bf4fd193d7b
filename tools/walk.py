"""How far a reader walks: the files and calls between an entry point and the function that does the work.

``python -m tools.walk forward`` and ``python -m tools.walk generate-plain`` trace by execution what a student reads:
every package function called during one forward of the plain model (``load_model(fast=False)``) on a 5-token prompt,
or during one greedy ``LLM.generate`` request of 4 tokens on it; they print each package file called, its lines, the
total, and whether anything of the speed layer (``minillm/fast/``) ran.

``python -m tools.walk generate`` follows ``LLM().generate`` down to the first attention over the KV blocks
(``paged/attention.py``, the speed layer's grouped read in ``fast/paged.py``, or ``fast.kernels.paged_attention``,
the fused kernel's entry, which short rows take); ``python
-m tools.walk quantize`` follows ``python -m minillm quantize --recipe paper`` down to GPTQ's column loop
(``gptq_quantize``). It prints the call stack at the first such call, keeping the frames in the package (the frames
a student reads), and counts their files and calls.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "minillm"


class Found(Exception):
    pass


def stack_at(targets: dict[str, set[str]], run) -> list[tuple[str, str]]:
    """Run ``run()`` until a function named in ``targets[file]`` of one of its files is called; return the
    (file, function) frames from the outermost package frame down to it."""
    seen: list[tuple[str, str]] = []

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and any(code.co_filename.endswith(file) and code.co_name in names
                                   for file, names in targets.items()):
            f = frame
            while f is not None:
                path = Path(f.f_code.co_filename)
                if PACKAGE in path.parents and not f.f_code.co_name.startswith("<"):  # not comprehensions
                    seen.append((str(path.relative_to(PACKAGE.parent)), f.f_code.co_name))
                f = f.f_back
            raise Found

    sys.setprofile(profile)
    try:
        run()
    except Found:
        pass
    finally:
        sys.setprofile(None)
    return seen[::-1]


def files_called(run) -> dict[str, int]:
    """Run ``run()`` under a profile hook; return {package file: its lines} for every package file one of whose
    functions was called (comprehensions and lambdas count for their file)."""
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            path = frame.f_code.co_filename
            if path.startswith(str(PACKAGE)):
                seen.add(path)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return {str(Path(p).relative_to(PACKAGE.parent)): len(Path(p).read_text().splitlines()) for p in sorted(seen)}


def _plain_model():
    from minillm import load_model

    return load_model(fast=False)


def walk_forward() -> dict[str, int]:
    """One forward of the plain model on a 5-token prompt."""
    import torch

    model, tokenizer = _plain_model()
    ids = torch.tensor([tokenizer.encode("The history of the")[:5]])
    with torch.inference_mode():
        return files_called(lambda: model(ids, torch.arange(ids.shape[1])))


def walk_generate_plain() -> dict[str, int]:
    """One greedy ``LLM.generate`` request of 4 tokens on the plain model (the engine made beforehand)."""
    from minillm import LLM, SamplingParams

    model, tokenizer = _plain_model()
    llm = LLM(model, tokenizer=tokenizer)
    return files_called(lambda: llm.generate(["The history of"], SamplingParams(max_tokens=4, temperature=0.0),
                                             use_tqdm=False))


def report(files: dict[str, int]) -> str:
    fast = [f for f in files if f.startswith("minillm/fast/")]
    lines = [f"  {path}: {n} lines" for path, n in files.items()]
    lines.append(f"{len(files)} files, {sum(files.values())} lines; speed layer: {', '.join(fast) or 'none'}")
    return "\n".join(lines)


def walk_generate():
    from minillm import LLM, SamplingParams

    llm = LLM(max_num_seqs=2)
    return stack_at({"paged/attention.py": {"paged_attention", "attend_blockwise", "gather_padded"},
                     "fast/paged.py": {"attend_groups"},
                     "fast/kernels/__init__.py": {"paged_attention", "paged_attention_naive"}},
                    lambda: llm.generate(["The history of"], SamplingParams(max_tokens=2), use_tqdm=False))


def walk_quantize():
    import tempfile

    from minillm.cli import main

    out = Path(tempfile.mkdtemp()) / "paper.safetensors"
    return stack_at({"quant/gptq.py": {"gptq_quantize"}},
                    lambda: main(["quantize", "--quant", "gptq", "--recipe", "paper", "--out", str(out)]))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.walk", description=__doc__.split("\n")[0])
    p.add_argument("walk", choices=["generate", "quantize", "forward", "generate-plain"])
    args = p.parse_args(argv)
    if args.walk in ("forward", "generate-plain"):
        print(report(walk_forward() if args.walk == "forward" else walk_generate_plain()))
        return
    frames = walk_generate() if args.walk == "generate" else walk_quantize()
    for path, name in frames:
        print(f"  {path}: {name}")
    files = list(dict.fromkeys(path for path, _ in frames))
    print(f"{len(files)} files, {len(frames) - 1} calls")


if __name__ == "__main__":
    main()
