#!/usr/bin/env bash
# N independent single-host TPU VMs (e.g. 4 x v6e-8) on one job: each VM runs its own torchrun job on its chips,
# all writing one output folder in a shared bucket; VM i (in the order given) is workers.index=i of N. Shards are
# shared through claims, so a VM that starts late, stops or is recreated takes what is left; rerun the same
# command to resume (a VM whose run still holds its worker exits 4, the others go on).
#   deploy/tpu-vms.sh ZONE TPU_NAME[,TPU_NAME...] ARGS...
# e.g. deploy/tpu-vms.sh us-east5-b vm-a,vm-b,vm-c,vm-d conf=flux2_tp dataset.path=gs://BUCKET/prompts.jsonl output.dir=gs://BUCKET/run
# Check the job first, on any machine (a dry run needs no TPU, no weights; this is VM 0's share):
#   ./launch.sh --dry-run conf=flux2_tp dataset.path=gs://BUCKET/prompts.jsonl output.dir=gs://BUCKET/run workers.index=0 workers.count=4
# Each VM needs the checkout in ~/meshgen (MESHGEN_REMOTE_DIR) with `pip install -e ".[tpu,gcs]"`. Secrets and
# caches: each VM reads ~/.config/meshgen/env if present (HF_TOKEN=hf_... for gated FLUX.2-dev; the Hub cache
# stays on the VM's disk, HF_HOME, across runs); compiled programs can be shared by every VM in the bucket
# (execution.compile_cache_dir=gs://BUCKET/compile-cache). The exit status is the first VM's non-zero one.
set -euo pipefail
if [[ $# -lt 2 ]]; then
  echo "usage: $0 ZONE TPU_NAME[,TPU_NAME...] [launch.sh arguments]" >&2
  exit 2
fi
zone="$1"
IFS=, read -r -a vms <<<"$2"
shift 2
count="${#vms[@]}"
args=""
if [[ $# -gt 0 ]]; then args="$(printf ' %q' "$@")"; fi
dir="$(printf %q "${MESHGEN_REMOTE_DIR:-meshgen}")"
# No TPU_WORKER_* variables: each VM is a single-host job of its own, its share given explicitly.
env_file='if [[ -f ~/.config/meshgen/env ]]; then set -a; source ~/.config/meshgen/env; set +a; fi'
codes="$(mktemp -d)"
trap 'rm -rf "$codes"' EXIT
for i in "${!vms[@]}"; do
  remote="$env_file; cd $dir && exec ./launch.sh$args workers.index=$i workers.count=$count"
  (
    set +e
    gcloud compute tpus tpu-vm ssh "${vms[$i]}" --zone "$zone" --worker=0 --command "$remote" 2>&1 |
      sed -u "s/^/[${vms[$i]}] /"
    echo "${PIPESTATUS[0]}" >"$codes/$i"
  ) &
done
wait
status=0
for i in "${!vms[@]}"; do
  code="$(cat "$codes/$i")"
  echo "${vms[$i]} (workers.index=$i): exit $code" >&2
  if [[ $status == 0 && $code != 0 ]]; then status=$code; fi
done
exit "$status"
