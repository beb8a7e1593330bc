# Two commands on a fresh machine: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install bench protos clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Reinstall only when the declared dependencies change. scripts/install.sh is the one install
# procedure, shared with the images (docker/Dockerfile*), so an image holds what `make` installs.
# CPU install set (torch + fbgemm-gpu-cpu); a GPU machine uses requirements/gpu.txt instead
# in a fresh venv (docs/operations.md, "GPU install"): never both fbgemm packages.
$(STAMP): $(BIN)/python setup.cfg pyproject.toml requirements/cpu.txt scripts/install.sh
	bash scripts/install.sh --python $(BIN)/python --variant cpu --extras test --editable
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
