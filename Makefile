# Everything a new user needs, from a machine with only python3, make and git.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
OUT    ?= runs/demo

.PHONY: demo test test-fast lint install doctor bench clean pyc

# The install is redone only when the dependency list or the pins change. pip compiles every installed module
# to bytecode on one core (where PYTHONDONTWRITEBYTECODE is set, as on CI's machines, nothing else ever
# will: each process would compile torch from source); compileall does it on every core, and skips the trees
# no run imports (transformers' other 400 models, test suites): 49 s -> ~35 s of a fresh install (Zen 4).
NOT_IMPORTED := transformers/models/(?!auto/|llama/|gpt2/)|/tests?/
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --no-compile -c constraints.txt -e ".[dev]"
	$(BIN)/python -m compileall -q -j 0 -x '$(NOT_IMPORTED)' $(VENV)/lib >/dev/null || true  # as pip: a file
	# for another Python (a template, a Python 2 example) does not compile, and is never imported
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/dpcompare compare --config demo --frameworks mlx,torch --nproc 1,2 --out $(OUT) --overwrite

# Everything, in one pytest session on TEST_WORKERS processes (pytest-xdist): the unit lane's tests are handed out
# first, so a broken edit still fails early; the integration lane's shared runs build in a process of their own
# from the session's start (tests/conftest.py), beside the unit tests, so neither core waits on the other lane.
# tests/conftest.py sends the readers of a shared run to one worker. One worker more than a 2-core machine's cores:
# the integration lane's tests wait (a collective's timeout, a shaped link, a stopped rank) for 30 % of a 2-worker
# session's core-seconds, which a third fills (AMD EPYC Zen 3: 604 -> 566 s). Safe since runs made at different
# moments compute with the same MLX kernels (tests/conftest.py pins them); the unit lane keeps 2 (no waits).
TEST_WORKERS ?= 2
SUITE_WORKERS ?= 3
test: $(STAMP) pyc
	$(BIN)/python -m pytest -n $(SUITE_WORKERS) tests/unit tests/integration

# The unit lane: tests that start no training process, to run after each edit, on TEST_WORKERS processes.
test-fast: $(STAMP) pyc
	$(BIN)/python -m pytest -n $(TEST_WORKERS) tests/unit

# The project's own modules byte-compiled (pip compiles only the installed packages): where PYTHONDONTWRITEBYTECODE
# is set, as on CI's machines, Python otherwise compiles them from source in every process it starts: 0.16 s for
# a process that imports them all, 0.04 s with these files (AMD EPYC Zen 4), over hundreds of ranks in a test run.
# A stale file is only ignored (Python checks the source's time), so this is redone before each test run.
pyc: $(STAMP)
	$(BIN)/python -m compileall -q common compare mlx_impl torch_impl tests benchmarks >/dev/null

# ruff, then mypy over common/, mlx_impl/ and torch_impl/ ([tool.mypy] in pyproject.toml): the backends against
# common/train/protocols.py. A few seconds once .mypy_cache is warm, about 19 s cold (torch is not read: pyproject.toml).
lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/mypy

doctor: $(STAMP)
	$(BIN)/dpcompare doctor

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) runs
