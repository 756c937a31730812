# EAGLE-3 hidden-state dump for SGLang: a patch series on a pinned upstream checkout.
# Every target takes SGLANG_VERSION= (a release in sglang.lock; default: its default) and
# SGLANG_DIR= (patch that tree instead of the pinned checkout .sglang/<version>/).

PYTHON ?= python3
SGLANG_VERSION ?=
SGLANG_DIR ?=
ALLOW_UNLOCKED ?=
PYTEST_ARGS ?=
# make port: FROM (a locked release) and TO (the new one); PORT_PYTHON picks a wheel-only release's wheel.
FROM ?=
TO ?=
PORT_PYTHON ?=

VERSION := $(or $(SGLANG_VERSION),$(shell $(PYTHON) -m scripts.toolchain.lock default))
TOOLS_VENV := .venv/tools
TOOLS_PY := $(TOOLS_VENV)/bin/python
RUNTIME_PYTHON_VERSION := $(shell $(PYTHON) -m scripts.toolchain.lock python $(VERSION))
RUNTIME_VENV := .venv/sglang-$(VERSION)
RUNTIME_PY := $(RUNTIME_VENV)/bin/python
CHECKOUT := $(or $(SGLANG_DIR),.sglang/$(VERSION))
LIBCUDA_STUB_DIR := .venv/libcuda-stub
LIBIBVERBS_DIR := .venv/libibverbs
SCRIPT_ARGS := --version $(VERSION) $(if $(SGLANG_DIR),--dir $(SGLANG_DIR)) $(if $(ALLOW_UNLOCKED),--allow-unlocked)
# How tests and the demo run the patched tree: the runtime venv holds upstream SGLang and its
# dependencies; the patched checkout goes first on the path.
RUNTIME_ENV := SGLANG_VERSION=$(VERSION) SGLANG_CHECKOUT=$(abspath $(CHECKOUT)) PYTHONPATH=$(abspath $(CHECKOUT)):$(CURDIR) \
	LD_LIBRARY_PATH=$(abspath $(LIBCUDA_STUB_DIR)):$(abspath $(LIBIBVERBS_DIR))$(if $(LD_LIBRARY_PATH),:$(LD_LIBRARY_PATH))

.PHONY: help tools runtime apply verify revert refresh-patches readme-tables port port-continue port-skip port-abort test test-tools test-matrix test-warmup test-unit test-server test-tensor-parallel test-release test-acceptance demo demo-online generate bench bench-acceptance acceptance-bundle acceptance-table bench-generate bench-generate-servers bench-writer bench-checksum bench-answer-steps bench-export clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t 20

$(TOOLS_VENV)/.installed: requirements/tools.txt
	$(PYTHON) -m venv $(TOOLS_VENV)
	$(TOOLS_PY) -m pip install --quiet -r requirements/tools.txt
	touch $@

tools: $(TOOLS_VENV)/.installed ## the small environment apply/verify/revert/refresh need

# Every target that runs SGLang (its recipe uses $(RUNTIME_ENV)) depends on apply, which refuses a
# checkout whose files differ from sglang_overlay/; tests/toolchain/test_makefile.py checks it.
apply: tools ## build the pinned checkout (or patch SGLANG_DIR) and apply the series; a no-op when applied, refused when stale
	$(TOOLS_PY) -m scripts.toolchain apply $(SCRIPT_ARGS)

verify: tools ## report every hunk as applies/applied/drift and every stale file; never writes (exit 0 ok, 1 drift, half-applied or stale, 2 usage)
	$(TOOLS_PY) -m scripts.toolchain verify $(SCRIPT_ARGS)

revert: tools ## restore the upstream bytes of every patched file
	$(TOOLS_PY) -m scripts.toolchain revert $(SCRIPT_ARGS)

refresh-patches: tools ## regenerate patches/v<version>/ from the pinned checkout's commits
	$(TOOLS_PY) -m scripts.toolchain refresh-patches $(SCRIPT_ARGS)

readme-tables: tools ## regenerate README.md's per-release patch tables from patches/
	$(TOOLS_PY) -m scripts.toolchain readme-tables

port: tools ## carry FROM's series to release TO (git three-way); adds TO to sglang.lock once every patch is in
	$(TOOLS_PY) -m scripts.toolchain port --from "$(FROM)" --to "$(TO)" $(if $(PORT_PYTHON),--python $(PORT_PYTHON))

port-continue: tools ## after resolving a port's conflict in .sglang/<TO>/ (git add), go on with the port
	$(TOOLS_PY) -m scripts.toolchain port-continue $(if $(TO),--to $(TO))

port-skip: tools ## drop the patch a port stopped at (upstream made it unnecessary) and go on
	$(TOOLS_PY) -m scripts.toolchain port-skip $(if $(TO),--to $(TO))

port-abort: tools ## give a port up: removes .sglang/<TO>/ (sglang.lock and patches/ were never changed)
	$(TOOLS_PY) -m scripts.toolchain port-abort $(if $(TO),--to $(TO))

$(RUNTIME_VENV)/.installed: requirements/runtime.txt requirements/trainers.txt
	$$(scripts/toolchain/find-python $(RUNTIME_PYTHON_VERSION)) -m venv $(RUNTIME_VENV)
	$(RUNTIME_PY) -m pip install --quiet "sglang==$(VERSION)" -r requirements/runtime.txt
	$(RUNTIME_PY) -m pip install --quiet --no-deps -r requirements/trainers.txt
	touch $@

$(LIBCUDA_STUB_DIR)/libcuda.so.1: stubs/libcuda_stub.c
	mkdir -p $(LIBCUDA_STUB_DIR)
	if [ -e /dev/nvidiactl ] || ldconfig -p | grep -q 'libcuda.so.1 '; then \
		echo "a real NVIDIA driver is present: no libcuda stand-in"; touch $@.none; \
	else cc -shared -fPIC -O2 -o $@ $<; fi

# Mooncake's store and master link libibverbs.so.1 even when they only speak TCP. Where the host
# has none: the Debian packages' libraries, unpacked into one folder (nothing installed
# system-wide) that RUNTIME_ENV puts on the library path. A fresh image without package lists
# gets them first.
IBVERBS_PACKAGES := libibverbs1 libnl-3-200 libnl-route-3-200
$(LIBIBVERBS_DIR)/libibverbs.so.1:
	if ldconfig -p | grep -q 'libibverbs.so.1 '; then \
		echo "the host has libibverbs.so.1: none unpacked"; mkdir -p $(LIBIBVERBS_DIR); touch $@.none; \
	else \
		staging=$(LIBIBVERBS_DIR).partial; rm -rf $$staging && mkdir -p $$staging/debs && \
		(cd $$staging/debs && \
			{ apt-get download $(IBVERBS_PACKAGES) || { apt-get update -qq && apt-get download $(IBVERBS_PACKAGES); }; } && \
			for deb in *.deb; do dpkg -x $$deb tree || exit 1; done) && \
		find $$staging/debs/tree -name 'lib*.so*' -exec cp -P -t $$staging {} + && \
		rm -rf $$staging/debs $(LIBIBVERBS_DIR) && mv $$staging $(LIBIBVERBS_DIR); \
	fi

runtime: $(RUNTIME_VENV)/.installed $(LIBCUDA_STUB_DIR)/libcuda.so.1 $(LIBIBVERBS_DIR)/libibverbs.so.1 ## SGLang's runtime (torch and friends, about 11 GB) for VERSION

test-tools: tools ## toolchain tests (no SGLang runtime needed)
	$(TOOLS_PY) -m pytest -q tests/toolchain $(PYTEST_ARGS)

# UNIT_MARKERS: a pytest -m expression; test-matrix gives "not same_on_every_release" for the
# releases whose whole server suite it does not run (tests/unit/conftest.py says which).
UNIT_MARKERS ?=
# TEST_WORKERS: tests run at once (pytest-xdist; 1: one at a time). A server test's time is
# mostly its server's start, three processes importing SGLang one after another, which keeps
# about two thirds of a core busy: on two cores three workers ran the same tests in 0.56 of the
# time. Test files go to workers whole (their module fixtures start once), the files with most
# tests first; test-warmup's tests, one file, go one by one.
TEST_WORKERS ?= 3
xdist = $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist $(1))
test-unit: apply runtime ## unit tests of the patched SGLang code on CPU tensors ([UNIT_MARKERS=] [TEST_WORKERS=])
	$(RUNTIME_ENV) $(RUNTIME_PY) -m pytest -q $(call xdist,loadfile) tests/unit $(if $(UNIT_MARKERS),-m "$(UNIT_MARKERS)") $(PYTEST_ARGS)

test-warmup: apply runtime ## real server: warmup plus one prefill with dumping on, and the negative controls
	$(RUNTIME_ENV) $(RUNTIME_PY) -m pytest -q $(call xdist,load) tests/server/test_warmup.py $(PYTEST_ARGS)

test-server: apply runtime ## every real-server test for VERSION but the tensor-parallel ones, and the online trainer side's (tests/online: a real Mooncake store; SGLang-free, so once)
	$(RUNTIME_ENV) $(RUNTIME_PY) -m pytest -q $(call xdist,loadfile) tests/server tests/online \
		--ignore tests/server/test_tensor_parallel.py $(PYTEST_ARGS)

# Eight ranks of one server fill the machine by themselves (twelve processes, about 9 GB):
# the tensor-parallel tests run one at a time, after the other server tests.
test-tensor-parallel: apply runtime ## real servers of eight CPU ranks (--tp-size 8): written once, rows, DP attention, the naive patch, faults, refusals
	$(RUNTIME_ENV) $(RUNTIME_PY) -m pytest -q tests/server/test_tensor_parallel.py $(PYTEST_ARGS)

test-release: test-unit test-server ## unit and server tests for VERSION

# The acceptance pipeline's CPU smoke (tests/acceptance): SpecForge's own trainer on our export of
# a real dump. SpecForge 0.2.0 pins SGLang 0.5.14 (requirements/trainers.txt), so test-matrix runs
# it with that release.
SPECFORGE_RELEASE := 0.5.14
test-acceptance: apply runtime ## SpecForge's trainer on our export of a tiny model's dump, on the CPU (SGLANG_VERSION=$(SPECFORGE_RELEASE))
	$(RUNTIME_ENV) $(RUNTIME_PY) -m pytest -q tests/acceptance $(PYTEST_ARGS)

# The releases whose whole server suite CI runs: the default. Every other locked release runs
# its unit tests and make test-warmup, which keeps CI's time bounded as releases are added
# (0.5.9's whole suite, 32 minutes on two cores, took CI to its limit; make test-server
# SGLANG_VERSION=0.5.9 runs it).
FULL_SERVER_SUITE ?= $(shell $(PYTHON) -m scripts.toolchain.lock default)

# Without SGLANG_VERSION: every release in sglang.lock, in TEST_LANES lanes side by side
# (scripts/test_matrix.sh; one by default: on two cores, two lanes starved a CPU-bound server
# test past its timeout). PRUNE_RUNTIMES=1 runs one lane and removes each release's runtime
# after its tests (a disk that holds one runtime at a time; CI on a small disk).
PRUNE_RUNTIMES ?=
TEST_LANES ?= 1
test: test-tools test-matrix ## everything CI runs: toolchain tests, then per release unit tests and test-warmup, the server suite on FULL_SERVER_SUITE

test-matrix: tools $(LIBCUDA_STUB_DIR)/libcuda.so.1 $(LIBIBVERBS_DIR)/libibverbs.so.1 ## per release (SGLANG_VERSION=: that one) unit tests and test-warmup, the whole server suite on FULL_SERVER_SUITE; TEST_LANES releases at a time
	FULL_SERVER_SUITE="$(FULL_SERVER_SUITE)" SPECFORGE_RELEASE="$(SPECFORGE_RELEASE)" TEST_LANES="$(TEST_LANES)" PRUNE_RUNTIMES="$(PRUNE_RUNTIMES)" SGLANG_DIR="$(SGLANG_DIR)" \
		scripts/test_matrix.sh $(or $(SGLANG_VERSION),$(shell $(PYTHON) -m scripts.toolchain.lock versions))

demo: apply runtime ## the whole path on a tiny model: conversations -> generate -> dump -> SpecForge and speculators exports
	$(RUNTIME_ENV) $(RUNTIME_PY) -m scripts.dumps.demo

demo-online: apply runtime ## the same into a local Mooncake store (master and its memory), every sample read back by a trainer's stream, no rows on disk
	$(RUNTIME_ENV) $(RUNTIME_PY) -m scripts.online.demo

DATASET ?=
OUT ?=
MODEL ?=
GENERATE_ARGS ?=
generate: apply runtime ## DATASET= OUT= MODEL= [GENERATE_ARGS=]: serve MODEL with dumping on, dump DATASET's conversations into OUT
	@test -n "$(DATASET)" -a -n "$(OUT)" -a -n "$(MODEL)" || { echo "usage: make generate DATASET=<file> OUT=<dir> MODEL=<model dir> [GENERATE_ARGS=\"...\"]"; exit 2; }
	$(RUNTIME_ENV) $(RUNTIME_PY) -m scripts.dumps.generate --dataset $(abspath $(DATASET)) --out $(abspath $(OUT)) --model $(abspath $(MODEL)) $(GENERATE_ARGS)

BENCH_SUITES ?= prefill hidden write scaling
BENCH_ARGS ?=
bench: apply runtime ## benchmarks (scripts/bench/dump.py [BENCH_ARGS]) into results/bench-<host kind>-<version>.json; see BENCHMARKS.md
	$(RUNTIME_ENV) $(RUNTIME_PY) -m scripts.bench.dump $(foreach suite,$(BENCH_SUITES),--suite $(suite)) $(BENCH_ARGS) \
		--out results/bench-$(if $(shell command -v nvidia-smi),gpu,cpu)-$(VERSION).json

bench-generate: apply runtime ## the generate command vs the raw concurrent sender on one server (scripts/bench/generate.py) into results/bench-generate-<host kind>-<version>.json
	$(RUNTIME_ENV) $(RUNTIME_PY) -m scripts.bench.generate --rounds 8 --conversations 96 \
		--out results/bench-generate-$(if $(shell command -v nvidia-smi),gpu,cpu)-$(VERSION).json

bench-generate-servers: apply runtime ## generate over two servers vs a raw sender pinned to each (scripts/bench/generate.py --servers 2) into results/bench-generate-2servers-<host kind>-<version>.json
	$(RUNTIME_ENV) $(RUNTIME_PY) -m scripts.bench.generate --servers 2 --rounds 8 --conversations 96 \
		--out results/bench-generate-2servers-$(if $(shell command -v nvidia-smi),gpu,cpu)-$(VERSION).json

BENCH_DIR ?= .cache/bench-writer
bench-writer: apply runtime ## the dump writer alone vs dd on BENCH_DIR's filesystem (scripts/bench/writer.py) into results/bench-writer-<host kind>.json
	$(RUNTIME_ENV) $(RUNTIME_PY) -m scripts.bench.writer --dir $(BENCH_DIR) \
		--out results/bench-writer-$(if $(shell command -v nvidia-smi),gpu,cpu).json

BENCH_CHECKSUM_DIR ?= /dev/shm/bench-checksum
bench-checksum: apply runtime ## the dump's checksum: XXH3-128 (and hashlib's) per core, and the writer with and without it on BENCH_CHECKSUM_DIR (scripts/bench/checksum.py) into results/bench-checksum-<host kind>.json
	$(RUNTIME_ENV) $(RUNTIME_PY) -m scripts.bench.checksum --dir $(BENCH_CHECKSUM_DIR) \
		--out results/bench-checksum-$(if $(shell command -v nvidia-smi),gpu,cpu).json

bench-answer-steps: apply runtime ## the dump's time per decode step that carries dumped answers, staged and not (scripts/bench/answer_steps.py [BENCH_ARGS]) into results/bench-answer-steps-<host kind>-<version>.json
	$(RUNTIME_ENV) $(RUNTIME_PY) -m scripts.bench.answer_steps $(BENCH_ARGS) \
		--out results/bench-answer-steps-$(if $(shell command -v nvidia-smi),gpu,cpu)-$(VERSION).json

BENCH_EXPORT_DIR ?= .cache/bench-export
bench-export: apply runtime ## both exports vs dd reading and writing on BENCH_EXPORT_DIR's filesystem (scripts/bench/export.py) into results/bench-export-<host kind>.json
	$(RUNTIME_ENV) $(RUNTIME_PY) -m scripts.bench.export --dir $(BENCH_EXPORT_DIR) \
		--out results/bench-export-$(if $(shell command -v nvidia-smi),gpu,cpu).json

# The acceptance benchmark (scripts/acceptance, BENCHMARKS.md "Acceptance"). Build the bundle where
# the package index is reachable, then run each step on the GPU machine with .devcarry carried:
# STEP=target once (its results committed under results/gpu/acceptance/target), then
# STEP=pipeline with a few CONTENDERS a call (each step fits 10 minutes); `make acceptance-table`
# reads every run's raw results.
acceptance-bundle: ## the acceptance bundle for a GPU machine without network: SGLang 0.5.14 and SpecForge 0.2.0 in .devcarry/site.tar.xz
	bash scripts/bench/gpu/build_bundle.sh .devcarry acceptance

STEP ?= pipeline
CONTENDERS ?= untrained,ours-seed1
ACCEPTANCE_OUT ?= $(or $(OUT),.cache/acceptance)
bench-acceptance: ## on the GPU machine with .devcarry: one step of the acceptance benchmark (STEP=target, or STEP=pipeline CONTENDERS=...) into ACCEPTANCE_OUT
	OUT=$(abspath $(ACCEPTANCE_OUT)) bash scripts/bench/gpu/run_acceptance.sh $(STEP) $(if $(filter pipeline,$(STEP)),--contenders $(CONTENDERS))

acceptance-table: tools ## the acceptance table from results/gpu/acceptance/*/acceptance.json
	$(TOOLS_PY) -m scripts.acceptance.table

clean: ## remove checkouts, venvs and caches
	rm -rf .sglang .venv .cache
