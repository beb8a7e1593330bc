# Two commands on a fresh machine: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The pip that resolved requirements/lock*.txt (scripts/lock.py); the lock installs with it.
PIP_VERSION := 26.3

.PHONY: run test install bench protos clean mutation

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q pip==$(PIP_VERSION)

# Reinstall only when the locked dependencies change (requirements/lock*.txt, written on purpose
# by `python scripts/lock.py` from setup.cfg and requirements/cpu.txt). scripts/install.sh is the one install
# procedure, shared with the images (docker/Dockerfile*), so an image holds what `make` installs.
# CPU install set (torch + fbgemm-gpu-cpu); a GPU machine uses requirements/gpu.txt instead
# in a fresh venv (docs/operations.md, "GPU install"): never both fbgemm packages.
$(STAMP): $(BIN)/python setup.cfg pyproject.toml requirements/lock.txt requirements/lock-cpu.txt requirements/lock-test.txt scripts/install.sh
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

# Mutation testing of the guard modules (docs/testing.md): mutmut 3 mutates a copy of the
# source in mutants/ (git-ignored), never the working tree; [mutmut] in setup.cfg lists the
# modules and the focused tests that guard them. MUTANTS narrows the run (fnmatch patterns of
# mutant names), e.g. make mutation MUTANTS='controller.ledger.* common.atomic_write.*'.
# The default covers every guard module; in ps/checkpoint.py and ps/servicer.py only their
# guard functions (verify, chain and restore checks; the owner/frozen check, vshard checks,
# awaiting recovery); in controller/ps_recovery.py all but the RecoveryHost Protocol's stubs
# (their bodies never run: its one mutant, a default argument, is reached by no test). mutmut 3
# does not mutate decorated functions (the @_rpc handlers, @contextmanager gates):
# tests/ps/test_freeze_drains.py pins the freeze's drain instead.
MUTATION_STAMP := $(VENV)/.mutation-installed
MUTATION_JOBS ?= 2
MUTANTS ?= 'controller.ledger.*' 'controller.dds.*' 'controller.ps_recovery.x*PsRecovery*' \
	'controller.ps_recovery.x*_Restored*' 'controller.ps_recovery.x_*' 'delivery.gate.*' \
	'common.atomic_write.*' 'ps.gate.*' 'ps.migration.*' \
	'ps.checkpoint.x_*verify*' 'ps.checkpoint.x_checkpoint_chain*' 'ps.checkpoint.x__checked*' \
	'ps.checkpoint.x__sha256*' 'ps.checkpoint.x__read_meta*' 'ps.checkpoint.x_read_manifest*' \
	'ps.checkpoint.x__expected_counts*' 'ps.servicer.*_check_owner*' 'ps.servicer.*_vshards__*' \
	'ps.servicer.*awaiting*' 'ps.servicer.*mark_recovered*' 'ps.servicer.*adopt_map*'

$(MUTATION_STAMP): $(STAMP) requirements/lock-mutation.txt
	$(BIN)/pip install -q --require-hashes --no-deps -r requirements/lock-mutation.txt
	touch $@

mutation: $(MUTATION_STAMP)
	nice -n 10 $(BIN)/mutmut run --max-children $(MUTATION_JOBS) $(MUTANTS)
	$(BIN)/mutmut results
