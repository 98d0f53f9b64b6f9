# Set-up and the two README commands. Everything a fresh machine needs is installed here, into .venv.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: venv demo test lint clean mutants mutants-e2e

venv: $(VENV)/.installed

# torch: the wheel that `pip install torch==2.13.0` picks with this machine's pip configuration (the CPU wheel on
# disk; asked for through another package's requirements pip could pick a multi-GB CUDA build), found by a pip dry
# run and installed with everything else by uv, which unpacks and byte-compiles in parallel: ~53 s on a clean clone
# where pip took ~67 s (torch alone 23 s), and each `make test` on a clean clone pays it. By pip where uv cannot be had.
UV := uv==0.13.9
TORCH := torch==2.13.0
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install --quiet --dry-run --ignore-installed --report $(VENV)/torch.json $(TORCH)
	torch="$$($(BIN)/python -c 'import json, sys; print(next(i["download_info"]["url"] for i in \
		json.load(open(sys.argv[1]))["install"] if i["metadata"]["name"] == "torch"))' $(VENV)/torch.json)" \
	&& $(BIN)/pip install --quiet $(UV) \
	&& $(BIN)/uv pip install --quiet --python $(BIN)/python --compile-bytecode "torch @ $$torch" -e ".[dev]" \
	|| ($(BIN)/pip install --quiet $(TORCH) && $(BIN)/pip install --quiet -e ".[dev]")
	touch $@

demo: venv
	./launch.sh
	$(BIN)/python tools/status.py outputs/tiny

# Two pytest workers on the 2-core CI machine: the suite is CPU-bound (mostly the imports of ~90 launches), and each
# launch costs more CPU the more run beside it (one tiny job alone 9.2 CPU-s, 10.0 with 2 at once, 11.2 with 4, 12.2
# with 6), so 4 workers spent 22-23 CPU-minutes where 2 spend 19 and finish sooner despite a core idle while a
# test waits on a stopped job.
# compileall first: where PYTHONDONTWRITEBYTECODE is set (as on these machines) no process writes the project's
# bytecode, so each of the suite's ~500 interpreters compiled every module it imported: 0.9 of a tiny job's
# 9.8 CPU-s (`python -m tools.bench.jobcost --repeats 4`: 8.9 with the bytecode written once here).
test: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/ty check --python $(VENV) launcher jobs
	$(BIN)/python -m compileall -q launcher jobs tools
	$(BIN)/pytest -q -n 2 --dist loadscope --no-loadscope-reorder

# Mutation checks of each room (sources, plan, ids, ledger, checks, sizing, host, publish, worker, writer, jobs; pyproject's
# [tool.mutmut] and tools/mutants.py): every surviving mutant is a change of the product that the fast tests do not
# notice. Each mutant runs only the fast tests that call its function (mutmut's stats run), two at a time, unless ty
# refuses it first. Not part of `make test`.
# `make mutants ROOM=worker` runs one room (ROOM=all or none: every room, one after another), then prints each
# room's killed / type error / survived / no-test / timeout counts. `make mutants ROOM=ledger ARGS=--again` runs
# only the room's mutants that the last run did not kill (after new tests); `ARGS="--sample 20"` shows a seeded
# draw of its survivors, each with its change, to judge by hand (docs/mutation-audit.md); `ARGS=--unjudged` prints
# those docs/survivors/ROOM.txt does not judge yet, each as a block to judge there.
ROOM ?= all
ARGS ?=
mutants: venv
	$(BIN)/python tools/mutants.py $(ROOM) --max-children 2 $(ARGS)

# `make mutants-e2e ROOM=host` (after `make mutants ROOM=host`): a sample of the room's mutants that no fast test
# reaches, each run against the launched tests that reach its module (tools/mutants_e2e.py).
mutants-e2e: venv
	$(BIN)/python tools/mutants_e2e.py $(ROOM) $(ARGS)

lint: venv
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf outputs models .pytest_cache mutants
