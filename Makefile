# Everything a fresh machine with python3 needs: `make lab` to learn, `make test` to check.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
NOTEBOOKS := $(sort $(wildcard notebooks/[0-9][0-9]_*.ipynb))

.PHONY: setup lab present train cluster test long soak other-cpu slides cluster-tests ci test-python test-gpu lint notebooks figures benchmark clean

setup: $(INSTALLED)

$(INSTALLED): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt -e .
	touch $@

# JupyterLab refuses to run as root (containers, cloud VMs) unless told it may.
lab: setup
	$(VENV)/bin/jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root)

# A lesson as slides, from a fresh copy in presenting/ (docs/presenting.md): `make present LESSON=06`
ifneq ($(filter present,$(MAKECMDGOALS)),)
ifeq ($(LESSON),)
$(error say which lesson: make present LESSON=06)
endif
endif
present: setup
	$(PY) -m helpers.present $(LESSON)

# The capstone's longer run (lesson 14): 600 steps under torchrun on 4 ranks (10 minutes on the 2
# cores of its committed record, trained.json), with a progress line, in runs/capstone/. Ctrl-C saves a checkpoint and stops; `make train`
# again goes on from it. `make train ARGS=--fresh` starts over.
train: setup
	$(PY) -m helpers.capstone $(ARGS)

# A real Slurm of two nodes on this machine (lesson 15), until Ctrl-C: munge, slurmctld, two slurmd.
# As root: installs Debian's slurm-wlm and munge first where they are missing.
cluster: setup
	$(PY) -m helpers.on_a_cluster.cluster up

# The tiers: each is one pytest run on two workers (pytest-xdist; much of a test's time is ranks
# waiting for each other or for a timeout, which the other worker fills). Each file, a notebook's
# cells above all, runs on one worker in order (--dist loadfile). Slowest first, in the order
# given: the longest files start at once, short ones fill in behind them.
PYTEST := $(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=25
NBVAL := --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg
SLOWEST_FIRST := notebooks/12_checkpoints_and_failures.ipynb notebooks/13_at_scale.ipynb \
	tests/test_exercises.py tests/test_launcher.py notebooks/09_pipeline_parallelism.ipynb \
	notebooks/07_zero_and_fsdp.ipynb notebooks/04_measuring_communication.ipynb
# Lesson 15 runs against a real Slurm cluster, in a tier of its own (cluster-tests).
ON_A_CLUSTER := notebooks/15_on_a_cluster.ipynb tests/test_on_a_cluster.py \
	tests/test_on_a_cluster_exercises.py
# Every file named once, in that order (pytest drops a file also covered by a folder given).
ALL := $(SLOWEST_FIRST) $(filter-out $(SLOWEST_FIRST) $(ON_A_CLUSTER),$(NOTEBOOKS) \
	$(wildcard tests/test_*.py)) tests/test_on_a_cluster.py
# Notebooks no rounding can change (whole numbers, timings nbval ignores, counts, messages,
# bit-for-bit and float64 comparisons): the other-CPU tier leaves them out.
ROUNDING_FREE := notebooks/01_processes_and_groups.ipynb notebooks/02_point_to_point.ipynb \
	notebooks/04_measuring_communication.ipynb notebooks/12_checkpoints_and_failures.ipynb \
	notebooks/13_at_scale.ipynb
# The capstone's notebook, a minute of training (two under make test's load): a tier of its own
# (long), so that make test keeps its 8 minutes. Left out of the other-CPU tier too: its
# rounding-dependent outputs are verdicts with wide margins (half a bit per byte below the
# baseline; 0.1 between the 4 ranks' and one process's validation losses); its float64 equalities
# run there as tests (tests/test_capstone.py, marked numerical). Checked once by hand under the
# tier's setting.
LONG_RUNS := notebooks/14_capstone.ipynb

# Does the course work? The linter, every test but the soaks and the browser's, every notebook
# against its committed outputs (nbval) but the capstone's and the cluster's (tiers of their own).
test: setup lint
	$(PYTEST) -m "not soak and not gpu and not slides and not cluster" $(NBVAL) \
		$(filter-out $(LONG_RUNS),$(ALL))

# The capstone's notebook (lesson 14) under nbval: a minute of training.
long: setup
	$(PY) -m pytest $(NBVAL) --durations=5 $(LONG_RUNS)

# Rare faults, slow by design: repetition, races between processes, real torchrun jobs. Test by
# test over both workers (no notebooks here): a file's slow tests, lesson 13's and 14's above
# all, need not wait for each other on one worker.
soak: setup
	$(PYTEST) --dist load -m soak tests

# Every lesson in a real browser (tests/test_browser.py): as an instructor presents it, RISE's
# slides in Chromium at 1280 x 720, each lesson's first widget run live and moved, one lesson a
# test, spread over both workers, each printing what it measured (-rA shows it); and two lessons
# in JupyterLab's notebook view, as a student runs them.
slides: setup
	$(PYTEST) --dist load -rA -m slides tests/test_browser.py

# Lesson 15 against a real Slurm of two nodes that each test starts (as root; Debian's slurm-wlm
# and munge, installed here where missing): its notebook under nbval, the requeued job equal to
# plain torchrun, the exercises' checkers submitting for real. Three files over both workers.
# Where no cluster can start, its tests are skipped (the notebook's first cell fails, saying why);
# REQUIRE_CLUSTER=1 (CI) makes that an error.
cluster-tests: setup
	$(PY) -m helpers.on_a_cluster.cluster install
	$(PYTEST) -m "cluster or notebook" $(NBVAL) $(ON_A_CLUSTER)

# Another CPU's rounding: PyTorch's kernels without vector instructions sum in other orders. The
# tests marked numerical (not those marked once, nor the checkers': messages) and the notebooks
# rounding can change; the timing cells nbval ignores are not run again (conftest.py).
other-cpu: setup
	ATEN_CPU_CAPABILITY=default $(PYTEST) -m "notebook or (numerical and not once)" \
		-k "not checker" $(NBVAL) --nbval-skip-timings \
		$(filter-out $(ROUNDING_FREE) $(LONG_RUNS),$(ALL))

# On a machine with CUDA (skipped elsewhere): every strategy on the GPU with NCCL, autocast and
# GradScaler on CUDA, the bytes held read from CUDA's allocator, gloo on CUDA tensors
# (tests/test_gpu.py). README says what of it has run on a GPU.
test-gpu: setup
	$(PY) -m pytest -m gpu -v tests/test_gpu.py

# Every tier on this Python (.ci/run adds another Python's).
ci: test long soak other-cpu slides cluster-tests

# Another Python (CI runs the newest that pyproject.toml allows): its own environment, the
# launcher's tests (its soaks included) and one notebook. `make test-python PYTHON=python3.13`
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
	$(PY) benchmarks/bfloat16.py

clean:
	rm -rf $(VENV) .venv-* .pytest_cache
