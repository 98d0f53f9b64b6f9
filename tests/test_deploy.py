"""Deployment recipes (issue 17), each checked offline against its engine: Kubernetes objects against the API's
schemas (kubernetes-validate), scripts with `bash -n`, and `launch.sh --dry-run` under the environment each
engine sets, showing the worker share or the node rank it derives."""

import copy
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
        elif "secretKeyRef" in e["valueFrom"]:
            env[e["name"]] = "stand-in-secret"
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


def pod_failure_action(job_spec: dict, exit_code: int | None = None, condition: str | None = None) -> str:
    """What the Job controller does with a failed pod (batch/v1 podFailurePolicy): the first rule that matches
    the meshgen container's exit code or one of the pod's conditions; no match counts against the backoff limit."""
    for rule in job_spec["podFailurePolicy"]["rules"]:
        codes = rule.get("onExitCodes")
        if codes and exit_code is not None and codes.get("containerName", "meshgen") == "meshgen":
            if (exit_code in codes["values"]) == (codes["operator"] == "In"):
                return rule["action"]
        if condition and any(c["type"] == condition for c in rule.get("onPodConditions", [])):
            return rule["action"]
    return "Count"


def jobset_job() -> dict:
    [rjob] = manifest("jobset-v6e16.yaml")["spec"]["replicatedJobs"]
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": rjob["name"]}, **rjob["template"]}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("cronjob.yaml", {2: "FailJob", 4: "FailJob", 3: "Count", "preempted": "Ignore"}),
        # An Indexed Job: exit 4 is one worker's folder held by another live run of that worker: only its index stops.
        ("indexed-job.yaml", {2: "FailJob", 4: "FailIndex", 3: "Count", "preempted": "Ignore"}),
        # A slice restarts as a whole (the JobSet's failurePolicy); bad input or a held folder fails it at once.
        ("jobset-v6e16.yaml", {2: "FailJob", 4: "FailJob", 3: "Count"}),
    ],
)
def test_pod_failure_policy_fails_at_once_on_2_and_4_and_retries_3_and_preemptions(name, expected):
    obj = manifest(name)
    spec = {"cronjob.yaml": lambda: obj["spec"]["jobTemplate"]["spec"], "indexed-job.yaml": lambda: obj["spec"]}.get(
        name, lambda: jobset_job()["spec"]
    )()
    assert spec["template"]["spec"]["restartPolicy"] == "Never"  # the API refuses podFailurePolicy otherwise
    for what, action in expected.items():
        got = pod_failure_action(spec, condition="DisruptionTarget", exit_code=143) if what == "preempted" else None
        got = got or pod_failure_action(spec, exit_code=what)
        assert got == action, (name, what, got)
    assert pod_failure_action(spec, exit_code=137) == "Count"  # a crash or an OOM kill is retried up to the limit
    if name == "jobset-v6e16.yaml":
        rules = obj["spec"]["failurePolicy"]["rules"]
        assert [(r["action"], r["onJobFailureReasons"]) for r in rules] == [("FailJobSet", ["PodFailurePolicy"])]
        assert all(r["name"] for r in rules)
    bad = copy.deepcopy(obj)
    inner = {"cronjob.yaml": lambda: bad["spec"]["jobTemplate"]["spec"], "indexed-job.yaml": lambda: bad["spec"]}
    if name in inner:  # the validator knows the rules' fields: a misspelt one is refused
        rule = inner[name]()["podFailurePolicy"]["rules"][0]
        rule["onExitCode"] = rule.pop("onExitCodes")
        with pytest.raises(kubernetes_validate.ValidationError):
            validate(bad)


@pytest.mark.parametrize("name", ["cronjob.yaml", "indexed-job.yaml", "jobset-v6e16.yaml"])
def test_manifests_take_the_hub_token_from_a_secret_and_keep_the_caches(name):
    """HF_TOKEN from a Secret (never a literal), HF_HOME on a mounted volume (the weights survive the pod), and the
    compile cache on a volume or the bucket."""
    spec = jobset_job()["spec"] if name == "jobset-v6e16.yaml" else manifest(name)["spec"]
    spec = spec.get("jobTemplate", {}).get("spec", spec)
    pod = spec["template"]["spec"]
    container = container_of(spec)
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    home = env["HF_HOME"]["value"]
    mount = next(m for m in mounts if home.startswith(m + "/"))
    [volume] = [v for v in pod["volumes"] if v["name"] == mounts[mount]]
    assert "persistentVolumeClaim" in volume  # outlives the pod
    [cache] = [a.partition("=")[2] for a in container["args"] if a.startswith("execution.compile_cache_dir=")]
    assert cache.startswith("gs://") or any(cache.startswith(m + "/") for m in mounts)
    assert "hf_" not in (DEPLOY / name).read_text().replace("hf_...", "")  # no token in the file itself


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


@pytest.mark.parametrize("script", ["slurm-array.sbatch", "slurm-multinode.sbatch", "tpu-vm.sh", "tpu-vms.sh"])
def test_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(DEPLOY / script)], capture_output=True).returncode == 0
    assert os.access(DEPLOY / script, os.X_OK)


def test_slurm_array_task_is_a_worker():
    env = {"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_JOB_ID": "77"}
    res = run_script("slurm-array.sbatch", "--dry-run", "conf=tiny", env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert dry_run_lines(res.stdout)[1] == "# workers: index=2 count=4"
    assert re.search(r"^#SBATCH --array=0-3$", (DEPLOY / "slurm-array.sbatch").read_text(), re.M)


@pytest.mark.parametrize("script", ["slurm-array.sbatch", "slurm-multinode.sbatch"])
def test_slurm_scripts_export_the_env_file_to_the_launcher(script, fake_bin, tmp_path):
    """MESHGEN_ENV_FILE (HF_TOKEN, HF_HOME) reaches the launcher: a variable it sets is what the launcher sees
    (OMP_NUM_THREADS, which a CPU dry run otherwise sets to 1 itself)."""
    env_file = tmp_path / "env"
    env_file.write_text("HF_TOKEN=hf_stand_in\nOMP_NUM_THREADS=3\n")
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node-[a-b]"}
    env |= {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "1"}
    env.pop("OMP_NUM_THREADS", None)
    base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    full = {**base, "PYTHON": sys.executable, "SLURM_SUBMIT_DIR": str(REPO), **env}
    for env_path, said in ((str(tmp_path / "none"), True), (str(env_file), False)):
        res = subprocess.run(
            ["bash", str(DEPLOY / script), "--dry-run", "conf=tiny"],
            env={**full, "MESHGEN_ENV_FILE": env_path},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == 0, res.stderr[-2000:]
        assert ("export OMP_NUM_THREADS=1" in res.stdout) == said, res.stdout


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


def test_tpu_vms_runs_one_worker_per_vm_and_returns_the_first_failure(tmp_path):
    """deploy/tpu-vms.sh: VM i of N runs its own single-host job as workers.index=i of N; each VM's exit status is
    said, and the script's is the first non-zero one (a stand-in gcloud runs each VM's command here)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "gcloud").write_text(
        '#!/usr/bin/env bash\necho "$*" >> "$FAKE_LOG"\nname="$5"\n'
        'while [[ $# -gt 0 && "$1" != --command ]]; do shift; done\n'
        '[[ "$name" == vm-down ]] && { echo "ssh: connect to host vm-down: timed out" >&2; exit 255; }\n'
        'exec bash -c "$2"\n'
    )
    (bin_ / "gcloud").chmod(0o755)
    log = tmp_path / "gcloud.log"
    home = tmp_path / "home"
    (home / ".config" / "meshgen").mkdir(parents=True)
    (home / ".config" / "meshgen" / "env").write_text("OMP_NUM_THREADS=3\n")  # each VM's own env file is read
    env = {"PATH": f"{bin_}:{os.environ['PATH']}", "FAKE_LOG": str(log), "MESHGEN_REMOTE_DIR": str(REPO)}
    env["HOME"] = str(home)
    res = run_script("tpu-vms.sh", "zone-a", "vm-a,vm-b", "--dry-run", "conf=tiny", env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    ssh = log.read_text().splitlines()
    assert sorted(ln.split()[4] for ln in ssh) == ["vm-a", "vm-b"]
    assert all("--zone zone-a --worker=0 --command" in ln for ln in ssh)
    for i, vm in enumerate(("vm-a", "vm-b")):
        mine = [ln.removeprefix(f"[{vm}] ") for ln in res.stdout.splitlines() if ln.startswith(f"[{vm}] ")]
        torchruns, workers = dry_run_lines("\n".join(mine))
        assert workers == f"# workers: index={i} count=2"
        assert len(torchruns) == 1 and "--standalone --nnodes=1" in torchruns[0]
        assert not any(ln.startswith("export OMP_NUM_THREADS=1") for ln in mine)
        assert f"{vm} (workers.index={i}): exit 0" in res.stderr
    res = run_script("tpu-vms.sh", "zone-a", "vm-a,vm-down", "--dry-run", "conf=tiny", env=env)
    assert res.returncode == 255 and "vm-down (workers.index=1): exit 255" in res.stderr
    assert "vm-a (workers.index=0): exit 0" in res.stderr
    assert run_script("tpu-vms.sh", "zone-a", env=env).returncode == 2  # usage
