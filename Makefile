# Quick start: `make demo`, `make test`; `make docs` builds the documentation. Everything runs in .venv (scripts/bootstrap.sh).
PY := .venv/bin/python
ARGS ?=
PYTEST_FLAGS ?= -q -p no:cacheprovider --durations=15

.PHONY: bootstrap demo test bench bench-matrix lint docs clean

bootstrap:
	@bash scripts/bootstrap.sh test

demo: bootstrap
	$(PY) -m shardkit.dev.demo

# pytest's exit 5 means "no tests collected": a failure here, said out loud.
test: bootstrap
	@rc=0; $(PY) -m pytest $(PYTEST_FLAGS) $(ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: FAILED: pytest collected no tests (exit 5)" >&2; fi; \
	exit $$rc

bench:
	@bash scripts/bootstrap.sh bench
	$(PY) -m benchmarks.run $(ARGS)

# shard size x sample size x loader mode x cold/warm, peers in every cell (about 1 h on a busy 2-core box)
bench-matrix:
	@bash scripts/bootstrap.sh bench
	$(PY) -m benchmarks.matrix $(ARGS)

lint: bootstrap
	@if $(PY) -c 'import mypy' 2>/dev/null; then \
		$(PY) -m mypy shardkit; \
	else \
		echo "lint: mypy is not installed in .venv (.venv/bin/pip install mypy); skipped"; \
	fi

# The documentation site (docs/, mkdocs.yml) into build/site; --strict fails on any warning.
docs: bootstrap
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict -d build/site

clean:
	rm -rf .venv build dist *.egg-info .pytest_cache .mypy_cache .hypothesis
