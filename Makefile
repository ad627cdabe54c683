# The two commands on a fresh machine:  `make serve`  and  `make test`.
.PHONY: serve test lint

# The repository's folder `operator/` would shadow the standard library's `operator`
# module for any Python that puts the current directory first on sys.path (`python -m`,
# `python -c`); PYTHONSAFEPATH (Python >= 3.11) stops that for every process we start.
export PYTHONSAFEPATH = 1

serve:
	@scripts/bootstrap.sh
	.venv/bin/kvpilot serve $(ARGS)

test:
	@scripts/bootstrap.sh test
	.venv/bin/python -m pytest -q $(ARGS)

lint:
	@scripts/bootstrap.sh test
	.venv/bin/ruff check .
