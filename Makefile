# Everything a fresh machine with python3 needs: `make lab` to learn, `make test` to check.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
NOTEBOOKS := $(sort $(wildcard notebooks/[0-9][0-9]_*.ipynb))

.PHONY: setup lab present release grade book book-env handouts train cluster test long soak other-cpu slides cluster-tests ci test-python other-python test-gpu lint notebooks figures benchmark clean browser system-packages

setup: $(INSTALLED)

# tools/install.py: uv, given pip's settings, or pip where uv cannot stand in (61 s with pip, 25 s
# with uv, from a fresh clone on 2026-11-30). Either compiles every module to bytecode as it
# installs: where PYTHONDONTWRITEBYTECODE is set, as on CI's machine, nothing would compile them
# later, and every process would compile torch from source (tried: make test 7:27 became 10:08).
$(INSTALLED): requirements.txt pyproject.toml tools/install.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) tools/install.py -r requirements.txt -e .
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

# For a class (docs/teaching.md). `make release DEST=dir`: a copy of the course for students, with
# no reference solutions (helpers/release.py). `make grade SUBMISSIONS=dir`: every student's
# handed-in notebooks graded, each in a sandbox of its own, into dir/grades.csv (helpers/grading).
ifneq ($(filter release,$(MAKECMDGOALS)),)
ifeq ($(DEST),)
$(error say where: make release DEST=../course-for-students)
endif
endif
ifneq ($(filter grade,$(MAKECMDGOALS)),)
ifeq ($(SUBMISSIONS),)
$(error say which folder: make grade SUBMISSIONS=handed-in)
endif
endif
release: setup
	$(PY) -m helpers.release $(DEST)

grade: setup
	$(PY) -m helpers.grading $(SUBMISSIONS) $(ARGS)

# The capstone's longer run (lesson 14): 600 steps under torchrun on 4 ranks (10 minutes on the 2
# cores of its committed record, trained.json), with a progress line, in runs/capstone/. Ctrl-C saves a checkpoint and stops; `make train`
# again goes on from it. `make train ARGS=--fresh` starts over.
train: setup
	$(PY) -m helpers.capstone $(ARGS)

# A real Slurm of two nodes on this machine (lesson 15), until Ctrl-C: munge, slurmctld, two slurmd.
# As root: installs Debian's slurm-wlm and munge first where they are missing.
cluster: setup
	$(PY) -m helpers.on_a_cluster.cluster up

# The tiers: each is one pytest run on two workers, or three where a tier says so (pytest-xdist;
# much of a test's time is ranks waiting for each other or for a timeout, which another worker
# fills). Each file, a notebook's cells above all, runs on one worker in order (--dist loadfile).
# `--tier` (conftest.py) collects the notebooks and test files of a tier as each lesson's package
# declares them (TIER, SLOW, ROUNDING_FREE: helpers/lessons.py), slowest first, in that order
# (--no-loadscope-reorder): the longest files start at once, short ones fill in behind them.
PYTEST = $(PY) -m pytest -n $(WORKERS) --dist loadfile --no-loadscope-reorder --durations=25
WORKERS = 2
NBVAL := --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg

# Does the course work? The linter, every test but the soaks, the browser's and the cluster's,
# every notebook against its committed outputs (nbval) but those in tiers of their own (the
# capstone's, long; the cluster's, cluster-tests). Three workers on two cores: a third fills what
# the others leave idle while their ranks wait (its pytest, from a fresh clone on 2026-11-30: 390 s
# with two workers, 374 s with three, 384 s with four).
test: WORKERS = 3
test: setup lint
	$(PYTEST) -m "not soak and not gpu and not slides and not cluster" $(NBVAL) --tier test \
		notebooks tests

# The notebooks too long for make test (TIER = "long": lesson 14's capstone, a minute of
# training) under nbval.
long: setup
	$(PY) -m pytest $(NBVAL) --durations=5 --tier long notebooks tests

# Rare faults, slow by design: repetition, races between processes, real torchrun jobs. Test by
# test over both workers (no notebooks here): a file's slow tests, lesson 13's and 14's above
# all, need not wait for each other on one worker. Of a parametrized test, a third of its cases
# run, chosen from the commit (conftest.py, --cases-share): every test in every run, every case
# within three commits. `make soak SHARE=1` runs them all (and the slides tier every handout).
# The tests that wait out a timeout, and the longest, start first (marked starts_first).
SHARE ?= 3
soak: setup
	$(PYTEST) --dist load -m soak --cases-share $(SHARE) tests

# Every lesson in a real browser (tests/test_browser.py): as an instructor presents it, RISE's
# slides in Chromium at 1280 x 720, each lesson's first widget run live and moved, one lesson a
# test, each printing what it measured (-rA shows it); and two lessons in JupyterLab's notebook
# view, as a student runs them. And the book (make book) read offline in Chromium, and the
# handouts printed, a fifth of the lessons' in a run, taking turns by commit as the soaks' cases
# do (tests/test_book.py). Three workers on two cores: a browser waits for pages and kernels
# (with two, the cores were idle 28 % of the tier; with three, 13 %).
slides: WORKERS = 3
slides: setup browser
	$(PYTEST) --dist load -rA -m slides --cases-share $(SHARE) tests/test_book.py tests/test_browser.py

# The lessons of TIER = "cluster" (lesson 15) against a real Slurm of two nodes that each test
# starts (as root; Debian's slurm-wlm and munge, installed here where missing): its notebook under
# nbval, the requeued job equal to plain torchrun, the exercises' checkers submitting for real.
# Three workers (on two cores: their ranks wait on Slurm, and with two workers the cores were idle
# 25 % of the tier; with three, 7 %), which take the tests one by one and the notebook whole
# (--tests-one-by-one; conftest.py): the notebook and the two longest tests start at once, the
# others fill in behind (file by file, one file of tests of 4 minutes was the tier's tail, and
# the cores were idle 14 % of the tier). Where no cluster can start, its tests are skipped (the
# notebook's first cell fails, saying why); REQUIRE_CLUSTER=1 (CI) makes that an error.
cluster-tests: WORKERS = 3
cluster-tests: setup
	$(PY) -m helpers.on_a_cluster.cluster install
	$(PYTEST) --tests-one-by-one -m "cluster or notebook" $(NBVAL) --tier cluster notebooks tests

# Another CPU's rounding: PyTorch's kernels without vector instructions sum in other orders. The
# tests marked numerical (not those marked once, nor the checkers': messages) and make test's
# notebooks that rounding can change (not ROUNDING_FREE); the timing cells nbval ignores are not
# run again (conftest.py). Of the soaks among them, a third of the cases, as in the soak tier; of
# the notebooks, a third, taking turns by commit (each within three; 4:37 became 2:31 here).
# oneDNN too is held to AVX2 (ONEDNN_MAX_CPU_ISA), as on a laptop: on a CPU with AMX (seen on
# 2026-12-01), PyTorch 2.13's bfloat16 flash attention packs its matrices for the AMX that oneDNN
# finds, with the kernels of the capability chosen, and fails ("pack_vnni2 is only supported when
# avx512 is supported").
other-cpu: setup
	ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=AVX2 \
		$(PYTEST) -m "notebook or (numerical and not once)" -k "not checker" $(NBVAL) \
		--nbval-skip-timings --cases-share $(SHARE) --tier other-cpu notebooks tests

# On a machine with CUDA (skipped elsewhere): every strategy on the GPU with NCCL, autocast and
# GradScaler on CUDA, the bytes held read from CUDA's allocator, gloo on CUDA tensors
# (tests/test_gpu.py). README says what of it has run on a GPU.
test-gpu: setup
	$(PY) -m pytest -m gpu -v tests/test_gpu.py

# Debian's Chromium, where it is missing, as root with apt-get: the slides tier drives it
# (Playwright cannot download its own here). Elsewhere a word, and its tests are skipped.
browser:
	@if command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		if (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
				chromium) >/dev/null 2>&1; then \
			echo "installed $$(chromium --version 2>/dev/null)"; \
		else echo "error: could not install chromium with apt; the browser tests will fail" >&2; fi; \
	else echo "warning: no chromium (apt-get install chromium, as root): no browser tests" >&2; fi

# The system's packages of the slides and cluster tiers, one install after the other (apt takes
# one at a time): Chromium, then Slurm and munge (helpers/on_a_cluster). make ci installs them
# beside the soak tier, whose ranks leave part of the cores idle while they wait: an install
# waits on the network and unpacks on one core.
system-packages: setup browser
	$(PY) -m helpers.on_a_cluster.cluster install

# Every tier, in CI's order (.ci/run runs `make ci OTHER_PYTHON=...`), stopping at the first that
# fails: README's make test first. The tiers run one after another: run beside each other, their
# ranks outnumber the cores many times over and every tier slows (measured: other-cpu 3:28 alone,
# 8:22 beside lesson 15's and the capstone's tiers, no faster in all). The exceptions (BESIDE,
# tier:beside it) are light: the system's packages (Chromium, Slurm) install beside the soak
# tier, the environments of the other Python and of the book (make book, in the slides tier)
# beside the other-CPU tier (an install is mostly unpacking, on one core), and the other
# Python's tests run beside the capstone's one notebook (long, 85 % of the cores; the
# launcher's tests wait on their ranks and timeouts more than they compute). Each target's
# output is printed as it ends.
CI_TIERS := test soak other-cpu cluster-tests long slides test-python
BESIDE := soak:system-packages other-cpu:book-env \
	$(if $(OTHER_PYTHON),other-cpu:other-python long:test-python)
# Each tier's wall-clock time is printed as it ends, and all of them at the end: the budgets'
# measure (README), never asserted in a test.
ci:
	@times=""; \
	for tier in $(CI_TIERS); do \
		case " $(BESIDE) " in *":$$tier "*) continue;; esac; \
		beside=$$(for pair in $(BESIDE); do \
			[ "$${pair%%:*}" = "$$tier" ] && echo "$${pair#*:}"; done); \
		start=$$(date +%s); \
		$(MAKE) $${beside:+-j --output-sync=target} $$tier $$beside || exit 1; \
		took=$$(( $$(date +%s) - start )); \
		tier="$$tier$${beside:+ and }$$(echo $$beside | sed 's/ / and /g')"; \
		times="$$times; $$tier $$((took / 60)):$$(printf %02d $$((took % 60)))"; \
		echo "make ci: $$tier took $$((took / 60)):$$(printf %02d $$((took % 60)))"; \
	done; \
	echo "make ci: every tier passed$$times"

# Another Python (CI runs the newest that pyproject.toml allows): its own environment, the
# launcher's tests and one notebook. Of the soaks, those that depend on the Python (a script
# without a main guard, a kernel killed, torchrun's rendezvous), not those that repeat the same
# launch or race two launches (the soak tier runs them), nor the one that waits out run()'s
# default timeout of a minute (its 3-second twin runs the same code). `make test-python
# OTHER_PYTHON=python3.13`; without OTHER_PYTHON, a warning and nothing else.
OTHER_VENV := .venv-$(notdir $(OTHER_PYTHON))
ifeq ($(OTHER_PYTHON),)
test-python:
	@echo "warning: no other Python (OTHER_PYTHON=python3.13); only $$($(PY) -V) was tested" >&2
else
test-python: other-python
	$(OTHER_VENV)/bin/python -m pytest -n 2 -k "not with_the_default_timeout and not at_once \
		and not after_50_launches and not take_turns" \
		tests/test_launcher.py tests/test_spawn.py
	$(OTHER_VENV)/bin/python -m pytest $(NBVAL) notebooks/01_processes_and_groups.ipynb
endif

# The other Python's environment. What installing it says is shown when it ends, so that beside a
# tier (ci) it does not cut into that tier's lines.
other-python:
	@log=$$(mktemp); \
	if $(MAKE) setup VENV=$(OTHER_VENV) PYTHON=$(OTHER_PYTHON) >$$log 2>&1; then \
		cat $$log; rm -f $$log; \
	else \
		cat $$log >&2; rm -f $$log; \
		echo "error: installing the environment of $(OTHER_PYTHON) failed" >&2; exit 1; \
	fi

lint: setup
	$(VENV)/bin/ruff check .

# Re-execute every notebook in place: the committed outputs are nbval's reference.
notebooks: setup
	$(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace \
		--ExecutePreprocessor.timeout=600 $(NOTEBOOKS)
	$(PY) -m helpers.slides $(NOTEBOOKS)
	$(PY) -m helpers.syllabus --write

# The course as a website, offline (book/website.py): the committed notebooks, never executed again,
# in book/'s own environment (Sphinx, MyST-NB, sphinx-book-theme; no torch). `make book` writes
# build/book/html/index.html; BOOK=dir writes it elsewhere. How to publish it: docs/book.md.
BOOK_VENV := .venv-book
BOOK ?= build/book
$(BOOK_VENV)/.installed: requirements-book.txt tools/install.py
	test -x $(BOOK_VENV)/bin/python || $(PYTHON) -m venv $(BOOK_VENV)
	$(BOOK_VENV)/bin/python tools/install.py -r requirements-book.txt
	touch $@

book-env: $(BOOK_VENV)/.installed

book: book-env
	$(BOOK_VENV)/bin/python book/website.py $(BOOK)

# Each lesson's slides as a PDF, one sub-slide a page, printed by Chromium from reveal.js's print
# view with the network off (book/handouts.py; reveal.js, require.js and jQuery are fetched once
# from npm's registry, checked by their sha512, into build/vendor/). Writes build/handouts/*.pdf;
# HANDOUTS=dir elsewhere, LESSON=06 one lesson, NOTES=1 each sub-slide's speaker notes after it.
HANDOUTS ?= build/handouts
handouts: setup
	$(PY) book/handouts.py $(HANDOUTS) $(if $(NOTES),--notes) $(LESSON)

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
	$(PY) benchmarks/openmp_wait.py
	$(PY) benchmarks/topology.py

clean:
	rm -rf $(VENV) .venv-* .pytest_cache
