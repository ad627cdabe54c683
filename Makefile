# The two commands on a fresh machine:  `make serve`  and  `make test`.
.PHONY: serve test lint bench-offline

serve:
	@scripts/bootstrap.sh
	.venv/bin/kvpilot serve $(ARGS)

test:
	@scripts/bootstrap.sh test
	.venv/bin/python -m pytest -q $(ARGS)

lint:
	@scripts/bootstrap.sh test
	.venv/bin/ruff check .
