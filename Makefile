# Everything a fresh machine needs is installed here: `make test` and `make demo` work on a clean clone.
PYTHON ?= python3
VENV ?= .venv
# CPU build by default (it lies on the dev machines' disk); CUDA users: make TORCH="torch==2.13.0 --index-url ..."
TORCH ?= torch==2.13.0
EXTRAS ?= dev,report,kernels,tune,serve,quant,peers,hf
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell echo '$(TORCH) $(EXTRAS)' | md5sum | cut -c1-8)

.PHONY: install test lint demo clean doctor

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	rm -f $(VENV)/.installed-*
	touch $@

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

# The tune tests start a throwaway PostgreSQL server: install its binaries when missing (as root).
.PHONY: postgres
postgres:
	bash scripts/postgres.sh ensure

test: $(STAMP) lint postgres
	$(PY) -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/slipstream bench --workload gpt-stdlib --size small --recipes demo --peers diy,accelerate,lightning \
		--rounds 3 --parity-steps 0 --max-round-s 60 --json demo.json --report demo.html

doctor: $(STAMP)
	$(VENV)/bin/slipstream doctor

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
