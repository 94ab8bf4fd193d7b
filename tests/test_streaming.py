"""generate's streaming printer: text appears as tokens arrive, and no part of a stop string is shown."""

import io

import pytest
from helpers import write_tiny_gguf

from minillm import load_model
from minillm.cli import StopStringPrinter


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_gguf(path)
    return load_model(path)[1]


def stream(tokenizer, text, stop):
    out = io.StringIO()
    printer = StopStringPrinter(tokenizer, stop, out)
    shown = []
    for t in tokenizer.encode(text):
        printer.feed(t)
        shown.append(out.getvalue())
    return printer, shown


def test_a_stop_string_is_never_shown_even_in_part(tiny_tokenizer):
    printer, shown = stream(tiny_tokenizer, "Hello, STOP here", ("STOP",))
    assert shown[-1] == "Hello, "
    assert not any("S" in s for s in shown)  # not even the first letter while it might start the stop
    assert printer.printed == len("Hello, ")


def test_text_is_printed_as_it_arrives_once_no_stop_can_claim_it(tiny_tokenizer):
    _, shown = stream(tiny_tokenizer, "abcab", ("abd",))
    # after "ab" the printer waits ("ab" may start "abd"); after "c" it prints "abc"
    assert shown[1] == "" and shown[2] == "abc" and shown[-1] == "abc"
    _, shown = stream(tiny_tokenizer, "plain text", ())
    assert shown == ["plain text"[:i + 1] for i in range(len("plain text"))]


def test_the_eos_token_prints_nothing(tiny_tokenizer):
    out = io.StringIO()
    printer = StopStringPrinter(tiny_tokenizer, (), out)
    printer.feed(tiny_tokenizer.eos_id)
    assert out.getvalue() == "" and printer.printed == 0
