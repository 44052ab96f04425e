# sysdra — quick start: `make demo`, `make test`.
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
PROFILE ?= server-2s-gpu-nic

.PHONY: all venv peers test test-fast demo demo-partitions run cluster allocate bench reliability protos fixtures image manifests install clean

all: test

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# The Go test peers (control plane, allocator, the real node's kubelet and containerd) into .peers/bin; cached,
# a no-op when nothing changed (docs/control-plane.md). Needs Go >= 1.26 and the module proxy.
peers:
	tests/peers/build.sh

# The whole suite, slow end-to-end tests included (they need root, podman, lspci: see .ci/run).
test: $(STAMP) peers
	$(VPY) -m pytest -q

# Unit and integration tests only (they need the control plane's peers and helm, not the real node's).
test-fast: $(STAMP)
	tests/peers/build.sh control-plane helm crds
	$(VPY) -m pytest -q -m "not slow"

demo: $(STAMP)
	$(VPY) -m agent.tools.demo --profile $(PROFILE)

# A partitioned GPU: mode switch at prepare on the simulated amdgpu (docs/partitions.md).
demo-partitions: $(STAMP)
	$(VPY) -m fixtures.simkernel.demo

# What the scheduler's allocator allocates for CLAIM on PROFILE's published slices (or SLICES=dir).
CLAIM ?= deploy/example-claim.yaml
allocate: $(STAMP)
	tests/peers/build.sh allocator
	$(VPY) -m tests.allocate --claim $(CLAIM) $(if $(SLICES),--slices $(SLICES),--profile $(PROFILE))

# The daemon on a bundled fixture node, offline cluster and kubelet dirs under .state/run, until Ctrl-C.
run: $(STAMP)
	mkdir -p .state/run
	SYSDRA_CONFIG=/dev/null $(VPY) -m agent run --root fixtures/sysfs/$(PROFILE) --node-name demo-node \
		--cluster dir:.state/run/cluster --kubelet-dir .state/run/kubelet --cdi-dir .state/run/cdi

# A real single-node Kubernetes v1.37.2 cluster: control plane, containerd, the kubelet and the agent
# on PROFILE, until Ctrl-C; prints a kubeconfig (docs/real-node.md). Needs root.
cluster: $(STAMP) peers
	$(VPY) -m tests.cluster --profile $(PROFILE)

bench: $(STAMP)
	$(VPY) -m bench.run

# Run the fault-injection suite (tests/faults) and regenerate docs/reliability.md from its results.
reliability: $(STAMP)
	$(VPY) -m tests.faults.report

# Regenerate the gRPC stubs from agent/protos/*.proto (a test fails when they are stale).
protos: $(STAMP)
	$(VPY) -m agent.protos.generate

# Regenerate fixtures/sysfs/* from fixtures/specs/*.yaml.
fixtures: $(STAMP)
	$(VPY) fixtures/generate.py

# The agent's image from the Containerfile with podman, saved as an OCI archive under .state/image
# (docs/install.md); the base is made locally with debootstrap when no registry has it. Needs root.
image:
	deploy/image/build.sh

# deploy/*.yaml from the Helm chart's default values (deploy/helm/sysdra; a test fails when stale).
manifests: $(STAMP)
	tests/peers/build.sh helm
	$(VPY) -m tests.helm manifests

# Install the systemd unit, tmpfiles entry and default config (DESTDIR/PREFIX honoured).
install:
	DESTDIR=$(DESTDIR) PREFIX=$(or $(PREFIX),/usr/local) SYSDRA_BIN=$(SYSDRA_BIN) sh systemd/install.sh

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
