"""How far a reader walks: the files and calls between an entry point and the function that does the work.

``python -m tools.walk generate`` follows ``LLM().generate`` down to the first attention over the KV blocks
(``paged/attention.py``, or ``kernels.paged_attention``, the fused kernel's entry, which short rows take); ``python
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


def walk_generate():
    from minillm import LLM, SamplingParams

    llm = LLM(max_num_seqs=2)
    return stack_at({"paged/attention.py": {"paged_attention", "attend_groups", "attend_blockwise", "gather_padded"},
                     "kernels/__init__.py": {"paged_attention", "paged_attention_naive"}},
                    lambda: llm.generate(["The history of"], SamplingParams(max_tokens=2), use_tqdm=False))


def walk_quantize():
    import tempfile

    from minillm.cli import main

    out = Path(tempfile.mkdtemp()) / "paper.safetensors"
    return stack_at({"quant/gptq.py": {"gptq_quantize"}},
                    lambda: main(["quantize", "--quant", "gptq", "--recipe", "paper", "--out", str(out)]))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.walk", description=__doc__.split("\n")[0])
    p.add_argument("walk", choices=["generate", "quantize"])
    args = p.parse_args(argv)
    frames = walk_generate() if args.walk == "generate" else walk_quantize()
    for path, name in frames:
        print(f"  {path}: {name}")
    files = list(dict.fromkeys(path for path, _ in frames))
    print(f"{len(files)} files, {len(frames) - 1} calls")


if __name__ == "__main__":
    main()
