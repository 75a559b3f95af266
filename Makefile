# The two commands a new user needs. Both create .venv on first use.
#   make lab    JupyterLab on notebooks/, on 127.0.0.1 with a token
#   make test   the whole test suite, notebooks included (what CI runs)
#   make test-extended  the default run plus the extended cases (every size, every model)
#   make doctor is this machine ready for a workshop? (exit 0 when it is)
.PHONY: lab test test-extended lint bench doctor

PORT ?= 8888
# Jupyter refuses to run as root unless told; containers often run as root.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)

lab:
	scripts/env.sh jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.port=$(PORT) \
	  --ServerApp.root_dir=notebooks --ServerApp.open_browser=False \
	  --LanguageServerManager.autodetect=False $(ROOT_FLAG)

# 2 pytest-xdist workers: the suite mostly waits (rank start-up, rendezvous, kernels), so 2
# on 2 cores cut its time; a module's tests share one worker (tests/conftest.py).
# `make test WORKERS=0` runs it in this one process.
WORKERS ?= 2
XDIST = -n $(WORKERS) --dist loadgroup --no-loadscope-reorder

test:
	scripts/env.sh python -m pytest -q $(XDIST) $(PYTEST_ARGS)

test-extended:
	scripts/env.sh python -m pytest -q -m "" $(XDIST) $(PYTEST_ARGS)

doctor:
	scripts/env.sh python -m tplab doctor

lint:
	scripts/env.sh ruff check tplab tests benchmarks

bench:
	scripts/env.sh python benchmarks/launch.py
