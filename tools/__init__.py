"""Repository tooling: what rewrites this repository's files (``python -m tools.tables``: the README's and
docs' result tables). Not part of the ``minillm`` package: the wheel holds only ``minillm``."""
