# The two commands on a fresh machine:  `make serve`  and  `make test`.
.PHONY: serve test lint

# The repository's folder `operator/` would shadow the standard library's `operator`
# module for any Python that puts the current directory first on sys.path (`python -m`,
# `python -c`); PYTHONSAFEPATH (Python >= 3.11) stops that for every process we start.
export PYTHONSAFEPATH = 1

serve:
	@scripts/bootstrap.sh
	.venv/bin/kvpilot serve $(ARGS)

# Two pytest workers, a test file each at a time (its module fixtures built once): much of
# the suite waits on servers and emulators, so two files share two cores well. Each worker,
# and what its tests start, gets its share of the CPUs as threads (tests/conftest.py).
# `make test JOBS=0` runs it in one process.
JOBS ?= 2

test:
	@scripts/bootstrap.sh test
	.venv/bin/python -m pytest -q -n $(JOBS) --dist loadfile $(ARGS)

lint:
	@scripts/bootstrap.sh test
	.venv/bin/ruff check .
