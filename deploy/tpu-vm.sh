#!/usr/bin/env bash
# Run meshgen on every host of a multi-host TPU VM (e.g. a v6e-16: 4 hosts) with gcloud's `--worker=all`.
#   deploy/tpu-vm.sh TPU_NAME ZONE slice   ARGS...  one torchrun job over all hosts (mesh.nodes = hosts)
#   deploy/tpu-vm.sh TPU_NAME ZONE workers ARGS...  each host its own job on its chips (workers.index = its id)
# e.g. deploy/tpu-vm.sh my-v6e-16 us-east5-b slice conf=flux2_tp mesh.dp=2 mesh.tp=8 output.dir=gs://BUCKET/run
# Check the job first, on any machine (a dry run needs no TPU, no weights; the script adds mesh.nodes):
#   ./launch.sh --dry-run conf=flux2_tp mesh.nodes=4 mesh.dp=2 mesh.tp=8 dataset.path=gs://BUCKET/prompts.jsonl output.dir=gs://BUCKET/run
# Separate single-host TPU VMs on one job: deploy/tpu-vms.sh.
# Each host needs the checkout in ~/meshgen (MESHGEN_REMOTE_DIR) with `pip install -e ".[tpu,gcs]"`, e.g.:
#   gcloud compute tpus tpu-vm ssh TPU_NAME --zone ZONE --worker=all \
#     --command 'git clone REPO_URL meshgen && cd meshgen && pip install -e ".[tpu,gcs]"'
# A stop (Ctrl-C) ends the ssh sessions; rerun the same command to resume.
set -euo pipefail
if [[ $# -lt 3 || ! "$3" =~ ^(slice|workers)$ ]]; then
  echo "usage: $0 TPU_NAME ZONE slice|workers [launch.sh arguments]" >&2
  exit 2
fi
tpu="$1" zone="$2" mode="$3"
shift 3
# The hosts' internal addresses, in worker order (worker i is the i-th).
hosts="$(gcloud compute tpus tpu-vm describe "$tpu" --zone "$zone" \
  --format='value[delimiter=","](networkEndpoints[].ipAddress)')"
count="$(tr ',' '\n' <<<"$hosts" | grep -c .)"
master="${hosts%%,*}"
# Each host's worker number comes from its metadata server (agent-worker-number), unless already set.
remote='export TPU_WORKER_ID="${TPU_WORKER_ID:-$(curl -sf -H Metadata-Flavor:Google'
remote+=' http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number)}"'
if [[ "$mode" == slice ]]; then
  # TorchTPU finds its peers from TPU_WORKER_HOSTNAMES; torchrun's rendezvous from NODE_RANK and MASTER_ADDR.
  # Both follow the same host order: NODE_RANK is the host's place in TPU_WORKER_HOSTNAMES.
  remote+="; export TPU_WORKER_HOSTNAMES=$hosts NODE_RANK=\"\$TPU_WORKER_ID\" MASTER_ADDR=$master MASTER_PORT=29500"
  set -- "mesh.nodes=$count" "$@"
  share=""
else
  # Separate jobs: no TPU_WORKER_HOSTNAMES, which would make TorchTPU set up one slice-wide job.
  share=" workers.index=\"\$TPU_WORKER_ID\" workers.count=$count"
fi
args=""
if [[ $# -gt 0 ]]; then args="$(printf ' %q' "$@")"; fi
remote+="; cd $(printf %q "${MESHGEN_REMOTE_DIR:-meshgen}") && exec ./launch.sh$args$share"
exec gcloud compute tpus tpu-vm ssh "$tpu" --zone "$zone" --worker=all --command "$remote"
