# The two commands of the README. Each sets up .venv from requirements-dev.txt (the reader's
# requirements.txt and the contributors' tools) when it is missing or older than one of the
# files it is made from, so both work on a fresh machine with nothing installed by hand.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: book test test-utils test-utils-spawn test-notebooks test-notebooks-portable \
        test-browser test-lane-fork test-lane-portable check-browser gpu-check bench clean

$(STAMP): requirements.txt requirements-dev.txt constraints.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -r requirements-dev.txt
	touch $(STAMP)

## make book: build the HTML book into _build/html from the stored, nbval-verified outputs
book: $(STAMP)
	$(BOOK)

# the book's source as a zip that "How to run this book" offers as a download
SOURCE_ZIP := _build/source/ddl-book-source.zip
BOOK := $(BIN)/python -m utils.source_archive $(SOURCE_ZIP) && \
        $(BIN)/jupyter-book build . --all --path-output . -W -n --keep-going

## make test: first a browser for the last step is found (or installed); then two lanes side by
## side: (1) the utils tests, then the notebooks re-executed and compared strictly by nbval;
## (2) the portability pass (the chapters that start worker processes or ranks again, with the
## pickling rules of macOS and Windows), the rest of the notebooks (LANE2_NOTEBOOKS), then the
## book built and checked page by page in a real browser. Each lane's report is printed when it ends. The lanes and the
## pytest-xdist processes in each (JOBS) follow the machine's cores (CORES); LANES=1: one lane
## after the other.
CORES ?= $(shell nproc 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 2)
LANES ?= $(if $(filter 1,$(CORES)),1,2)
# each lane's share of the cores, at least 1
JOBS_PER_LANE := $(shell echo $$(( $(CORES) / $(LANES) > 1 ? $(CORES) / $(LANES) : 1 )))
# GNU make 4 prints each lane's output in one piece (macOS's make 3.81 mixes them)
SYNC := $(if $(filter 3.%,$(MAKE_VERSION)),,--output-sync=target)

test: check-browser $(STAMP)
	@echo "make test: $(CORES) cores, $(LANES) lanes of tests side by side with $(JOBS_PER_LANE) test process(es) each; each lane prints its report when it ends (about 50 minutes on 2 cores)"
	$(MAKE) --no-print-directory -j$(LANES) $(SYNC) JOBS=$(JOBS_PER_LANE) test-lane-fork test-lane-portable

# Lane 2 also takes the utils tests that run the training script as SLURM and GPU-check jobs,
# five chapters of the fork pass, and the browser test at its end, so that the lanes take about
# as long (a fresh-clone run with them all in lane 1 had lane 1 at twice lane 2's time)
LANE2_UTILS := tests/test_slurm_recipe.py tests/test_gpu_check.py
LANE2_NOTEBOOKS := 07_seeding 09_distributed_evaluation 10_ddp_from_scratch 12_exact_resume 13_restarts_and_slurm 16_streams_of_shards

test-lane-fork: $(STAMP)
	$(UTILS_TESTS) $(LANE2_UTILS:%=--ignore=%)
	$(BIN)/python $(NBVAL) notebooks $(LANE2_NOTEBOOKS:%=--ignore=notebooks/%.ipynb)

test-lane-portable: $(STAMP)
	$(PORTABLE_TESTS)
	$(SPAWN_TESTS)
	$(BIN)/python $(NBVAL) $(LANE2_NOTEBOOKS:%=notebooks/%.ipynb)
	$(BIN)/python -m pytest $(LANE2_UTILS) -q $(call xdist,loadgroup)
	$(BOOK)
	$(BROWSER_TESTS)

# Playwright alone, so that a machine without a browser hears so in seconds, before the
# full set-up; $(STAMP) installs the rest into the same .venv
PLAYWRIGHT := $(VENV)/.playwright
$(PLAYWRIGHT): requirements-dev.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$$(grep '^playwright' requirements-dev.txt)"
	touch $(PLAYWRIGHT)

## make check-browser: BOOK_CHROMIUM, else Chromium/Chrome on PATH or in the usual macOS and
## Windows places, else Playwright's own; none: `playwright install chromium` is tried, and
## if that fails it stops, saying what to install (tests/browser/find_browser.py)
check-browser: $(PLAYWRIGHT)
	$(BIN)/python tests/browser/find_browser.py --install

# The targets below run alone with JOBS pytest-xdist processes side by side (JOBS=1: one at a
# time, as in make test's lanes). The utils tests that start several ranks at once run one after
# the other (tests/conftest.py); each notebook runs whole in one process, in its own kernel.
JOBS ?= $(CORES)
xdist = $(if $(filter-out 0 1,$(JOBS)),-n $(JOBS) --dist $(1))

UTILS_TESTS = $(BIN)/python -m pytest tests -q --ignore=tests/browser $(call xdist,loadgroup)
test-utils: $(STAMP)
	$(UTILS_TESTS)

## make test-browser: build the book, then check every page of it in headless Chromium (the
## one check-browser finds): tests/browser/book_check.py, which also runs alone;
## full-page screenshots of the pages go to _build/screenshots/ (not in make test, where
## they would double the check's CPU time for pictures no one looks at)
BROWSER_TESTS = $(BIN)/python -m pytest tests/browser -q -rP $(call xdist,load)
test-browser: check-browser book
	BOOK_SCREENSHOTS=1 $(BROWSER_TESTS)

NBVAL = -m pytest --nbval --nbval-current-env --nbval-sanitize-with sanitize.cfg -q \
        -p no:cacheprovider $(call xdist,loadfile)

NOTEBOOK_TESTS = $(BIN)/python $(NBVAL) notebooks
test-notebooks: $(STAMP)
	$(NOTEBOOK_TESTS)

# The portability pass: tests/start_method/sitecustomize.py sets the start method in every Python
# process started with it on PYTHONPATH: the kernel, its DataLoader workers, the ranks' workers,
# torchrun's workers; test_start_method.py checks that it took effect. With forkserver (and
# torch, torch.distributed, cloudpickle and utils preloaded in each fork server) a worker has
# only what it imports and unpickles, as under spawn, at the cost of a fork: a notebook that
# relies on state a worker inherits fails it as it fails under spawn (tests/test_portability.py).
# It runs the chapters that start workers or ranks, but two: chapter 6, which teaches the start
# methods, runs under spawn itself, as macOS and Windows run it (SPAWN_NOTEBOOKS); and chapters 11 to 13,
# whose workers start from the training scripts' own fork servers under any start method, runs in
# the fork pass only. tests/test_notebooks.py fails if a chapter that starts workers is in neither
# list. make test-utils-spawn runs the utils tests under spawn, as a Mac runs them.
PORTABLE_NOTEBOOKS := 00_the_picture 03_set_epoch 07_seeding 08_iterable_datasets 10_ddp_from_scratch 14_loader_throughput 15_permutation_sampler 16_streams_of_shards appendix_ddp_internals appendix_streams_in_production
SPAWN_NOTEBOOKS := 06_workers
# chapters that start workers only through scripts that choose their own start method
OWN_START_NOTEBOOKS := 11_cifar10_ddp 12_exact_resume 13_restarts_and_slurm

FORCED = PYTHONPATH=$(CURDIR)/tests/start_method BOOK_START_METHOD=$(1)
PORTABLE_TESTS = $(call FORCED,forkserver) $(BIN)/python $(NBVAL) \
  $(PORTABLE_NOTEBOOKS:%=notebooks/%.ipynb) tests/test_start_method.py
SPAWN_TESTS = $(call FORCED,spawn) $(BIN)/python $(NBVAL) \
  $(SPAWN_NOTEBOOKS:%=notebooks/%.ipynb) tests/test_start_method.py
test-notebooks-portable: $(STAMP)
	$(PORTABLE_TESTS)
	$(SPAWN_TESTS)
test-utils-spawn: $(STAMP)
	$(call FORCED,spawn) $(UTILS_TESTS)

## make gpu-check: on a CUDA machine, the full profile of utils.gpu_check on all local GPUs (--quick's checks, then
## SyncBN, workers, --compile, fp16, fewer GPUs, 2 nodes), then `make test`; writes book/results/gpu_check_<gpu>.json.
## Without .venv, with the torch already there: python -m utils.gpu_check --quick
gpu-check: $(STAMP)
	$(BIN)/python -m utils.gpu_check --make-test

## make bench: the benchmarks the chapters show from book/results (not timed tests)
bench: $(STAMP)
	$(BIN)/python -m utils.bench sampler --out book/results/sampler_bench_cpu.json
	$(BIN)/python -m utils.bench ddp --repeats 9 --out book/results/ddp_step_cpu.json
	$(BIN)/python -m utils.bench restart --repeats 10 --out book/results/torchrun_restart_cpu.json
	$(BIN)/python -m utils.bench loader --out book/results/loader_bench_cpu.json
	$(BIN)/python -m utils.bench samplers --out book/results/permutation_sampler_bench_cpu.json
	$(BIN)/python -m torch.distributed.run --standalone --nproc_per_node=2 -m utils.step_bench --device cpu \
		--synthetic --synthetic-size 512 256 --global-batch 8 --workers 0 --loader gpu --rounds 9 \
		--data runs/step_bench/data --out runs/step_bench/out --result book/results/step_overhead_cpu.json
	$(BIN)/python -m utils.stream_bench --out book/results/stream_throughput_cpu.json
	$(BIN)/python -m utils.stream_faults --out book/results/stream_faults_cpu.json
	$(BIN)/python -m utils.shard_index --out book/results/shard_index_cpu.json

clean:
	rm -rf _build
