# The two commands of the README. Each sets up .venv from requirements.txt when it is missing
# or older than requirements.txt, so both work on a fresh machine with nothing installed by hand.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: book test test-utils test-notebooks bench clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	touch $(STAMP)

## make book: build the HTML book into _build/html from the stored, nbval-verified outputs
book: $(STAMP)
	$(BIN)/jupyter-book build . --path-output . -W -n --keep-going

## make test: the utils tests, then every notebook re-executed and compared strictly by nbval
test: test-utils test-notebooks

test-utils: $(STAMP)
	$(BIN)/python -m pytest tests -q

test-notebooks: $(STAMP)
	$(BIN)/python -m pytest --nbval --nbval-current-env --nbval-sanitize-with sanitize.cfg notebooks -q -p no:cacheprovider

## make bench: the benchmarks the chapters show from book/results (not timed tests)
bench: $(STAMP)
	$(BIN)/python -m utils.bench sampler --out book/results/sampler_bench_cpu.json
	$(BIN)/python -m utils.bench ddp --out book/results/ddp_step_cpu.json
	$(BIN)/python -m utils.bench restart --repeats 10 --out book/results/torchrun_restart_cpu.json

clean:
	rm -rf _build
