# Entry points for people and CI. Each target is idempotent.
PYTHON := .venv/bin/python
ROLLOUT := .venv/bin/rollout

.PHONY: setup jaeger demo test down status

# System packages (Java, Maven, bubblewrap, docker.io, iproute2), .venv, Kafka jars, SmolLM2-135M-Instruct.
setup:
	ops/bootstrap.sh

# Jaeger v2, built once and cached, for the tracing tests only (make demo does not wait for it).
jaeger: setup
	ops/jaeger.sh

# A short real RL run on the local stack (Kafka + NATS on the default ports, bubblewrap sandboxes).
demo: setup
	$(ROLLOUT) infra up --bwrap
	$(ROLLOUT) demo

# Static checks (pyflakes: unused and undefined names; mypy: types, paths and strictness from
# pyproject.toml), then the suite; the integration fixtures start a
# private broker, nats-server and Docker engine as needed.
test: setup jaeger
	$(PYTHON) -m pyflakes engine modelserver domains learning actors sandboxes streams ops tests loadtests
	$(PYTHON) -m mypy
	$(PYTHON) -m pytest tests -q

down:
	$(ROLLOUT) infra down

status:
	$(ROLLOUT) infra status
