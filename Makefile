# The two commands of README.md: `make serve` (the service) and `make test` (CI's command).
#
# The Python environment, first that applies:
#   make PY=/path/to/python ...   that interpreter (a conda env, a system Python you manage)
#   an active virtualenv          $VIRTUAL_ENV/bin/python
#   otherwise                     a project venv in .venv, made with $(PYTHON) on first use
# Setup (scripts/setup.sh) runs again only when a packaging file changed since it last
# succeeded for that interpreter (a stamp in .make/); `make reinstall` forces it.
PYTHON ?= python3
# `make serve PORT=9000`: another port. Unset, the server's own settings apply (its
# MOE_GEMM_PORT, MOE_GEMM_HOST and other MOE_GEMM_* variables), else 127.0.0.1:8000.
PORT ?=

ifdef PY
  ENV_CFG :=
else ifdef VIRTUAL_ENV
  PY := $(VIRTUAL_ENV)/bin/python
  ENV_CFG := $(wildcard $(VIRTUAL_ENV)/pyvenv.cfg)
else
  VENV := .venv
  PY := $(VENV)/bin/python
  ENV_CFG := $(VENV)/pyvenv.cfg
  # As if activated: console scripts (moe-gemm, moe-gemm-server, ruff) resolve to the venv.
  export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
endif

# One stamp per interpreter, so that switching PY or venvs installs into the new one. A
# recreated venv has a new pyvenv.cfg, newer than its stamp.
STAMP := .make/setup-$(shell printf '%s' '$(PY)' | cksum | cut -d' ' -f1).stamp
SETUP_INPUTS := pyproject.toml server/pyproject.toml client/pyproject.toml \
	scripts/setup.sh scripts/install_torch.py

.PHONY: setup reinstall serve test check demo lint

setup: $(STAMP)

$(STAMP): $(SETUP_INPUTS) $(ENV_CFG)
	PYTHON=$(PY) bash scripts/setup.sh
	@mkdir -p $(@D) && touch $@

reinstall:
	PYTHON=$(PY) bash scripts/setup.sh
	@mkdir -p $(dir $(STAMP)) && touch $(STAMP)

ifdef VENV
$(VENV)/pyvenv.cfg:
	@if [ -e $(VENV) ]; then \
	  echo "make: $(VENV) exists but is not a virtual environment (no pyvenv.cfg); remove" \
	    "it, or choose an interpreter with make PY=/path/to/python" >&2; exit 2; fi
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null || { \
	  echo "make: $(PYTHON) is not Python >= 3.10; run make PYTHON=python3.X with a newer" \
	    "one" >&2; exit 2; }
	@echo "make: creating the project virtual environment $(VENV) with $(PYTHON)"
	@$(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); \
	  echo "make: '$(PYTHON) -m venv' failed (Debian/Ubuntu: apt install python3-venv)," \
	    "or choose an interpreter with make PY=/path/to/python" >&2; exit 2; }
endif

serve: setup
	$(PY) -m moe_gemm_server$(if $(PORT), --port $(PORT))

check: setup
	$(PY) -m moe_gemm.cli check

test: setup
	$(PY) -m moe_gemm.cli check
	$(PY) -m pytest -q

demo: setup
	$(PY) -m moe_gemm.cli demo

lint: setup
	$(PY) -m ruff check moe_gemm server client tests benchmarks scripts
