# Set-up and the two README commands. Everything a fresh machine needs is installed here, into .venv.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: venv demo test lint clean mutants

venv: $(VENV)/.installed

# torch first and alone, by pip: `pip install torch==2.13.0` takes the CPU wheel on disk (pip's configuration
# points at it); asked for through another package's requirements pip could pick a multi-GB CUDA build. The rest
# by uv, which installs and byte-compiles the same pinned versions from the public registry in ~30 s where pip took
# ~55 s (each `make test` on a clean clone pays it); by pip, with its own configuration, where uv cannot be had.
UV := uv==0.13.9
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	($(BIN)/pip install --quiet $(UV) \
		&& $(BIN)/uv pip install --quiet --python $(BIN)/python --compile-bytecode -e ".[dev]") \
		|| $(BIN)/pip install --quiet -e ".[dev]"
	touch $@

demo: venv
	./launch.sh
	$(BIN)/python tools/status.py outputs/tiny

# Two pytest workers on the 2-core CI machine: the suite is CPU-bound (mostly the imports of ~90 launches), and each
# launch costs more CPU the more run beside it (one tiny job alone 9.2 CPU-s, 10.0 with 2 at once, 11.2 with 4, 12.2
# with 6), so 4 workers spent 22-23 CPU-minutes where 2 spend 19 and finish sooner despite a core idle while a
# test waits on a stopped job.
test: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pytest -q -n 2 --dist loadscope --no-loadscope-reorder

# Mutation checks of launcher/ledger/ and the exit-code decision (pyproject's [tool.mutmut]): every surviving
# mutant is a change of the product that the fast known-answer tests do not notice. Not part of `make test`.
# `make mutants MUTANTS='launcher.ledger.shards*'` runs one module's mutants.
MUTANTS ?=
mutants: venv
	$(BIN)/mutmut run --max-children 2 $(MUTANTS)
	$(BIN)/mutmut results

lint: venv
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf outputs models .pytest_cache mutants
