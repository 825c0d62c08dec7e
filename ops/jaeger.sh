#!/usr/bin/env bash
# Builds Jaeger v2 once (Go module proxy -> go build -> ~/.cache/rollout-engine/jaeger-<version>/jaeger) for the
# tracing tests (tests/integration/test_tracing.py, test_infra.py's `infra up --jaeger`); instant once cached.
# `make test` runs it; `make demo` does not need it. The first build takes minutes (~7 on 2 cores).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
log() { echo "jaeger: $*"; }
# --- Jaeger v2 (Go module proxy -> go build -> ~/.cache/rollout-engine/jaeger-<version>/jaeger) -------
# The tracing integration test exports to it. The first build takes minutes (~7 on 2 cores).
if command -v go >/dev/null 2>&1 || [[ -x /usr/local/go/bin/go ]]; then
  .venv/bin/python - <<'PY'
from ops.infra import InfraConfig, InfraError
from ops.infra.jaeger import JAEGER_RELEASE, ensure_jaeger, jaeger_binary

cfg = InfraConfig.from_env()
if not jaeger_binary(cfg).is_file():
    print(f"jaeger: building Jaeger {JAEGER_RELEASE} with go (minutes)", flush=True)
try:
    print(f"jaeger: Jaeger {JAEGER_RELEASE} at {ensure_jaeger(cfg)}")
except InfraError as exc:
    raise SystemExit(f"jaeger: {exc}\n{exc.log_tail}")
PY
else
  log "go not found: skipping the Jaeger build (tests/integration/test_tracing.py needs it; install Go >= 1.24)"
fi
