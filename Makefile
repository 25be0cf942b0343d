# Everything a fresh machine with python3 needs: `make lab` to learn, `make test` to check.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
NOTEBOOKS := $(sort $(wildcard notebooks/[0-9][0-9]_*.ipynb))

.PHONY: setup lab test notebooks benchmark clean

setup: $(INSTALLED)

$(INSTALLED): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt -e .
	touch $@

# JupyterLab refuses to run as root (containers, cloud VMs) unless told it may.
lab: setup
	$(VENV)/bin/jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root)

# Unit tests, then every notebook re-executed and compared with its committed outputs (nbval).
test: setup
	$(PY) -m pytest --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg tests $(NOTEBOOKS)

# Re-execute every notebook in place: the committed outputs are nbval's reference.
notebooks: setup
	$(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace \
		--ExecutePreprocessor.timeout=600 $(NOTEBOOKS)

benchmark: setup
	$(PY) benchmarks/launch.py

clean:
	rm -rf $(VENV) .pytest_cache
