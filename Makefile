# Two commands on a fresh machine: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install bench protos clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Reinstall only when the declared dependencies change.
# CPU install set (torch + fbgemm-gpu-cpu); a GPU machine uses requirements/gpu.txt instead
# in a fresh venv (docs/operations.md, "GPU install"): never both fbgemm packages.
$(STAMP): $(BIN)/python setup.cfg pyproject.toml requirements/cpu.txt
	$(BIN)/pip install -q -r requirements/cpu.txt
	$(BIN)/pip install -q -e '.[cpu,test]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH bash scripts/main_job.sh runs/main

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadscope tests

protos: $(STAMP)
	$(BIN)/python -m protos.build

clean:
	rm -rf runs .pytest_cache
