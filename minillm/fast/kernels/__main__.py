"""``python -m minillm.fast.kernels``: build the kernels now (``make setup`` does) and say whether they loaded.
Exits 0 either way: without them the speed layer keeps torch's kernels."""

from . import available, why_unavailable

print("minillm kernels:", "built and loaded" if available() else f"off ({why_unavailable() or 'the build failed'})")
