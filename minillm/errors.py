"""The errors minillm raises for files it cannot use.

Input that is out of range raises ``ValueError`` naming the argument; a model file or folder that
cannot be read raises ``ModelFileError`` (a ``ValueError`` too, so one ``except ValueError`` catches
both), whose message names the path and what to do.
"""


class ModelFileError(ValueError):
    """A model file or folder minillm cannot use; the message names the path and the problem."""
