#!/usr/bin/env bash
# Launch a meshgen job on this host: ./launch.sh [--dry-run] [conf=NAME] [HYDRA_OVERRIDE ...]
# Knobs: PYTHON (the interpreter; default .venv/bin/python of this checkout if present, else python3).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${PYTHON:-}"
if [[ -z "$py" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then py="$root/.venv/bin/python"; else py=python3; fi
fi
# exec: the launcher becomes this process, so a signal sent to launch.sh (PID 1 in a container) reaches it.
exec "$py" -m launcher.host.launch "$@"
