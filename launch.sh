#!/usr/bin/env bash
# Launch a meshgen job on this host: ./launch.sh [--dry-run] [--help] [--cfg job] [conf=NAME|conf=PATH.yaml] [HYDRA_OVERRIDE ...]
# Knobs: PYTHON (the interpreter; default .venv/bin/python of this checkout if present, else python3).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${PYTHON:-}"
if [[ -z "$py" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then py="$root/.venv/bin/python"; else py=python3; fi
fi
# This checkout's code whatever the working directory (a job started from the team's own folder), also where the
# interpreter has another checkout installed. exec: the launcher becomes this process, so a signal sent to
# launch.sh (PID 1 in a container) reaches it.
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" -m launcher.host.launch "$@"
