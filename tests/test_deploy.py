"""Deployment recipes (issue 17), each checked offline against its engine: Kubernetes objects against the API's
schemas (kubernetes-validate), scripts with `bash -n`, and `launch.sh --dry-run` under the environment each
engine sets, showing the worker share or the node rank it derives."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from conftest import PROMPTS, REPO, launch

# conf tiny's dry runs read the checkout's built tiny model (conftest.default_model) instead of building one
pytestmark = pytest.mark.usefixtures("default_model")

DEPLOY = REPO / "deploy"
# The manifests name a bucket and a data volume that a dry run here cannot reach: these stand in for them.
LOCAL = [PROMPTS, "output.dir=/tmp/meshgen-deploy-dry-run"]
K8S_VERSION = kubernetes_validate.latest_version()
INDEX_ANNOTATION = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def manifest(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def validate(obj: dict) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)  # strict: an unknown field is an error too


def container_of(job_spec: dict) -> dict:
    [container] = job_spec["template"]["spec"]["containers"]
    return container


def pod_env(container: dict, index: int) -> dict[str, str]:
    """The container's environment in the pod of completion index `index`, as Kubernetes would set it."""
    env = {"JOB_COMPLETION_INDEX": str(index)}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            assert e["valueFrom"]["fieldRef"]["fieldPath"] == INDEX_ANNOTATION, e
            env[e["name"]] = str(index)
    return env


def dry_run_lines(out: str) -> tuple[list[str], str]:
    """(torchrun lines, the workers line) of one or more dry runs' output."""
    lines = out.splitlines()
    return [ln for ln in lines if ln.startswith("torchrun ")], "\n".join(
        ln for ln in lines if ln.startswith("# workers")
    )


@pytest.mark.parametrize("name", ["cronjob.yaml", "indexed-job.yaml"])
def test_kubernetes_objects_are_valid(name):
    validate(manifest(name))
    bad = manifest(name)
    bad["spec"]["completionz"] = 4  # the validator must be able to refuse
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(bad)


def test_every_manifest_names_the_image_the_dockerfile_builds():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    built = set(re.findall(r"-t (REGISTRY/meshgen:\w+) \.", dockerfile))
    assert built == {"REGISTRY/meshgen:tpu", "REGISTRY/meshgen:cuda"}
    for name in ("cronjob.yaml", "indexed-job.yaml", "jobset-v6e16.yaml"):
        images = re.findall(r"image: (\S+)", (DEPLOY / name).read_text())
        assert images and set(images) <= built, name
        assert all(
            cmd == "/opt/meshgen/launch.sh"
            for cmd in re.findall(r'command: \["([^"]+)"\]', (DEPLOY / name).read_text())
        )
    assert 'ENTRYPOINT ["/opt/meshgen/launch.sh"]' in dockerfile and "WORKDIR /opt/meshgen" in dockerfile


def test_the_image_tree_runs_launch_sh(tmp_path):
    """The files the Dockerfile copies are all the launcher needs: a dry run from a tree of just those works."""
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    root = tmp_path / "opt" / "meshgen"
    root.mkdir(parents=True)
    for line in re.findall(r"^COPY (.+)$", dockerfile, re.M):
        *sources, dest = line.split()
        for src in sources:
            assert (REPO / src).exists(), src
            target = root / (src if dest in ("./", ".") else dest)
            copy = shutil.copytree if (REPO / src).is_dir() else shutil.copy2
            copy(REPO / src, target)
    extras = re.search(r"ARG EXTRA=(\w+)", dockerfile)[1]
    assert f"\n{extras} = [" in (REPO / "pyproject.toml").read_text()  # the default extra exists
    env = {**os.environ, "PYTHON": sys.executable}
    res = subprocess.run(
        ["./launch.sh", "--dry-run", "conf=tiny"], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "-m launcher.worker.main conf=tiny" in res.stdout


def test_jobset_pods_are_valid_jobs_and_derive_their_node_rank():
    js = manifest("jobset-v6e16.yaml")
    assert (js["apiVersion"], js["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    [rjob] = js["spec"]["replicatedJobs"]
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": rjob["name"]}, **rjob["template"]}
    validate(job)
    spec, container = job["spec"], container_of(job["spec"])
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 4
    assert spec["template"]["spec"]["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
        "cloud.google.com/gke-tpu-topology": "4x4",
    }
    assert container["resources"]["limits"]["google.com/tpu"] == 4
    assert any(a.startswith("output.dir=gs://") for a in container["args"])
    # The hostnames JobSet gives its pods: <jobset>-<replicated job>-<job index>-<pod index>.<subdomain = jobset>.
    name = js["metadata"]["name"]
    hosts = [f"{name}-{rjob['name']}-0-{i}.{name}" for i in range(4)]
    for index in (0, 3):
        env = pod_env(container, index)
        assert env["TPU_WORKER_HOSTNAMES"].split(",") == hosts and env["MASTER_ADDR"] == hosts[0]
        res = launch("--dry-run", *container["args"], *LOCAL, env=env)
        assert res.returncode == 0, res.stderr[-2000:]
        [torchrun], workers = dry_run_lines(res.stdout)
        assert f"--nnodes=4 --node-rank={index} --master-addr={hosts[0]} --master-port=29500" in torchrun
        assert "--nproc-per-node=4" in torchrun and workers == "# workers: index=0 count=1"  # one job, one worker
        assert "set_tpu_launch_env(nnodes=4, nproc_per_node=4)" in res.stdout


def test_indexed_job_pods_get_their_share_of_the_workers():
    job = manifest("indexed-job.yaml")
    container = container_of(job["spec"])
    for index in (0, 3):
        res = launch("--dry-run", *container["args"], *LOCAL, env=pod_env(container, index))
        assert res.returncode == 0, res.stderr[-2000:]
        [torchrun], workers = dry_run_lines(res.stdout)
        assert workers == f"# workers: index={index} count={job['spec']['completions']}"
        assert "--standalone --nnodes=1 --nproc-per-node=8" in torchrun


@pytest.fixture
def fake_bin(tmp_path) -> Path:
    """srun, scontrol and gcloud stand-ins that run what the real ones would run on each node, here."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    scripts = {
        "srun": 'while [[ "$1" == --* ]]; do shift; done\n'
        'for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i SLURM_PROCID=$i "$@" || exit $?; done',
        "scontrol": '[[ "$1 $2" == "show hostnames" ]] && printf "node-a\\nnode-b\\n"',
        "gcloud": 'echo "$*" >> "$FAKE_LOG"\ncase " $* " in\n  *" describe "*) echo "10.0.0.1,10.0.0.2" ;;\n'
        '  *" ssh "*) while [[ $# -gt 0 && "$1" != --command ]]; do shift; done\n'
        '    for i in 0 1; do TPU_WORKER_ID=$i bash -c "$2" || exit $?; done ;;\nesac',
    }
    for name, body in scripts.items():
        (bin_ / name).write_text(f"#!/usr/bin/env bash\nset -euo pipefail\n{body}\n")
        (bin_ / name).chmod(0o755)
    return bin_


def run_script(script: str, *args: str, env: dict) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHON": sys.executable, "SLURM_SUBMIT_DIR": str(REPO), **env}
    return subprocess.run(["bash", str(DEPLOY / script), *args], env=full, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("script", ["slurm-array.sbatch", "slurm-multinode.sbatch", "tpu-vm.sh"])
def test_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(DEPLOY / script)], capture_output=True).returncode == 0
    assert os.access(DEPLOY / script, os.X_OK)


def test_slurm_array_task_is_a_worker():
    env = {"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_JOB_ID": "77"}
    res = run_script("slurm-array.sbatch", "--dry-run", "conf=tiny", env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert dry_run_lines(res.stdout)[1] == "# workers: index=2 count=4"
    assert re.search(r"^#SBATCH --array=0-3$", (DEPLOY / "slurm-array.sbatch").read_text(), re.M)


def test_slurm_multinode_is_one_torchrun_job_over_the_nodes(fake_bin):
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node-[a-b]"}
    res = run_script("slurm-multinode.sbatch", "--dry-run", "conf=tiny", env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    torchruns, workers = dry_run_lines(res.stdout)
    assert len(torchruns) == 2 and workers == "# workers: index=0 count=1\n# workers: index=0 count=1"
    for rank, line in enumerate(torchruns):
        assert f"--nnodes=2 --node-rank={rank} --master-addr=node-a --master-port=29500" in line
        assert "--nproc-per-node=1" in line and line.endswith("conf=tiny mesh.nodes=2")


@pytest.mark.parametrize("mode", ["slice", "workers"])
def test_gcloud_tpu_vm_ssh_runs_every_host(fake_bin, tmp_path, mode):
    log = tmp_path / "gcloud.log"
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "FAKE_LOG": str(log), "MESHGEN_REMOTE_DIR": str(REPO)}
    res = run_script("tpu-vm.sh", "my-tpu", "zone-a", mode, "--dry-run", "conf=flux2_tp", "mesh.tp=8", PROMPTS, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    ssh = [ln for ln in log.read_text().splitlines() if " ssh " in ln]
    assert len(ssh) == 1 and "tpus tpu-vm ssh my-tpu --zone zone-a --worker=all --command" in ssh[0]
    torchruns, workers = dry_run_lines(res.stdout)
    assert len(torchruns) == 2
    for i, line in enumerate(torchruns):
        if mode == "slice":
            assert f"--nnodes=2 --node-rank={i} --master-addr=10.0.0.1" in line and "mesh.nodes=2" in line
        else:
            assert "--standalone --nnodes=1" in line
    expected = [f"index={i} count=2" for i in range(2)] if mode == "workers" else ["index=0 count=1"] * 2
    assert workers == "\n".join(f"# workers: {e}" for e in expected)
