# Everything a fresh machine with python3 needs: `make lab` to learn, `make test` to check.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
NOTEBOOKS := $(sort $(wildcard notebooks/[0-9][0-9]_*.ipynb))

.PHONY: setup lab test test-python lint notebooks figures benchmark clean

setup: $(INSTALLED)

$(INSTALLED): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt -e .
	touch $@

# JupyterLab refuses to run as root (containers, cloud VMs) unless told it may.
lab: setup
	$(VENV)/bin/jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root)

# The linter, then the unit tests, then every notebook re-executed and compared with its committed
# outputs (nbval) with the real-browser test. Two pytest workers (pytest-xdist): much of a test's
# time is ranks waiting for each other or for a timeout, which the other worker fills. Each
# notebook's cells stay on one worker, in order (--dist loadfile).
#
# Then the same notebooks, and the tests whose results are numbers, again on other CPU kernels:
# ATEN_CPU_CAPABILITY=default makes PyTorch run its kernels without vector instructions, which sum
# and round in other orders, as another CPU would. The outputs and tolerances must not care
# (helpers/tolerance.py). That pass leaves out the timing cells whose output nbval ignores and whose
# names no later cell needs (conftest.py): they compare nothing there.
NBVAL := --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg
# The tests whose results are numbers declare `pytestmark = pytest.mark.numerical` (a whole file)
# or `@pytest.mark.numerical` (one test: exact counts of bytes or FLOPs need no second run); the
# checkers' tests among them (their messages, not numbers) run once, and so do the tests a whole-file
# mark would take but that no rounding can change (`@pytest.mark.once`). A whole training run
# compared in float64 (reference.in_float64) is not marked: its tolerance, assert_close's 1e-7, is
# a million times what its rounding reaches (helpers/tolerance.py), on any kernels.
OTHER_CPU := ATEN_CPU_CAPABILITY=default
# Four notebooks are left out of that second pass, as no rounding can change what they print:
# lessons 01 and 02 print ranks, groups, messages and tensors of small whole numbers (exact in
# float32); lesson 04, timings (which nbval_sanitize.cfg replaces) and formulas in Python floats;
# lesson 12, counts of bytes and pieces, messages, comparisons of two runs on the same kernels (bit
# for bit), and float64 comparisons with one process (the reason float64 training runs are not
# marked numerical).
ROUNDING_FREE := notebooks/01_processes_and_groups.ipynb notebooks/02_point_to_point.ipynb \
	notebooks/04_measuring_communication.ipynb notebooks/12_checkpoints_and_failures.ipynb
OTHER_CPU_NOTEBOOKS := $(filter-out $(ROUNDING_FREE),$(NOTEBOOKS))
# The slowest notebook first, so that the two workers' shares end together (the browser test and
# lesson 12 start at once; short notebooks fill in behind them).
NBVAL_ORDER := notebooks/12_checkpoints_and_failures.ipynb \
	$(filter-out notebooks/12_checkpoints_and_failures.ipynb,$(NOTEBOOKS))

test: setup lint
	$(PY) -m pytest -n 2 --durations=12 tests --ignore=tests/test_browser.py
	$(PY) -m pytest -n 2 --durations=12 --dist loadfile $(NBVAL) tests/test_browser.py \
		$(NBVAL_ORDER)
	$(OTHER_CPU) $(PY) -m pytest -n 2 -m "numerical and not once" -k "not checker" tests \
		--ignore=tests/test_browser.py
	$(OTHER_CPU) $(PY) -m pytest -n 2 --dist loadfile $(NBVAL) --nbval-skip-timings \
		$(OTHER_CPU_NOTEBOOKS)

# Another Python (CI runs the newest that pyproject.toml allows): its own environment, the
# launcher's tests and one notebook. `make test-python PYTHON=python3.13`
OTHER_VENV := .venv-$(notdir $(PYTHON))
test-python:
	$(MAKE) setup VENV=$(OTHER_VENV)
	$(OTHER_VENV)/bin/python -m pytest -n 2 tests/test_launcher.py tests/test_spawn.py
	$(OTHER_VENV)/bin/python -m pytest $(NBVAL) notebooks/01_processes_and_groups.ipynb

lint: setup
	$(VENV)/bin/ruff check .

# Re-execute every notebook in place: the committed outputs are nbval's reference.
notebooks: setup
	$(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace \
		--ExecutePreprocessor.timeout=600 $(NOTEBOOKS)
	$(PY) -m helpers.slides $(NOTEBOOKS)

# Every lesson's key figure, for the README's gallery (the same bytes on every run).
figures: setup
	$(PY) -m helpers.drawing figures

benchmark: setup
	$(PY) benchmarks/launch.py
	$(PY) benchmarks/ring.py
	$(PY) benchmarks/ddp.py
	$(PY) benchmarks/zero.py
	$(PY) benchmarks/pipeline.py
	$(PY) benchmarks/weights.py

clean:
	rm -rf $(VENV) .venv-* .pytest_cache
