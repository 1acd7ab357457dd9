"""Launched the way clusters launch: the recipes of examples/slurm and examples/kubernetes.

Slurm (examples/slurm/membership.sbatch) on a real Slurm: a cluster of one node made for this
test (munged, slurmctld and slurmd from Debian's slurm-wlm and munge packages, on their own
ports, socket, key and state folder, stopped at the end), the recipe submitted with ``sbatch``
as a user submits it. 4 members and a warm spare, each a job step of its own; member 2's step
killed with ``scancel --signal=KILL JOB.STEP`` mid-run: the spare takes its place, the job trains
on at 4 to the last step, bit for bit equal, and Slurm records the job COMPLETED with exit code 0. Needs root and the packages
(``apt-get install slurm-wlm munge``; ``.ci/run`` installs them); skipped elsewhere.

Kubernetes (examples/kubernetes/fastreduce-job.yaml): no cluster runs here, so its manifests are
checked against Kubernetes' own schemas (kubernetes-validate, strict: no unknown field) for the
oldest and newest versions it knows, and for what the recipe needs: members that restart in
place (and so join the running job), one pod per member, the coordinator's Service in their
environment at the port the coordinator serves.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from fastreduce.launch import free_port

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "examples" / "slurm" / "membership.sbatch"
MANIFEST = ROOT / "examples" / "kubernetes" / "fastreduce-job.yaml"
STEPS = 400
KILL_AFTER = 30  # member 2's step is killed once it committed this many steps
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scancel", "scontrol", "squeue", "sinfo")

pytestmark = pytest.mark.timeout(300)


def _missing() -> str:
    if os.geteuid() != 0:
        return "needs root (the Slurm daemons run as root here)"
    lost = [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]
    return f"{', '.join(lost)} not installed: apt-get install slurm-wlm munge" if lost else ""


def _exe(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A one-node Slurm cluster of this test's own; the environment its commands need."""
    why = _missing()
    if why:
        pytest.skip(f"Slurm: {why}")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "munge"):
        (d / sub).mkdir()
    key = d / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    (d / "munge").chmod(0o700)
    sock = d / "munge" / "socket"
    cpus = os.cpu_count() or 1
    conf = d / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=fastreduce-test", "SlurmctldHost=localhost", "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", f"AuthInfo=socket={sock}", f"StateSaveLocation={d / 'state'}",
        f"SlurmdSpoolDir={d / 'spool'}", f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d / 'slurmd.pid'}",
        f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}", "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "MpiDefault=none",
        "ReturnToService=2", "SlurmdParameters=config_overrides", "MinJobAge=600",
        f"SlurmctldLogFile={d / 'slurmctld.log'}", f"SlurmdLogFile={d / 'slurmd.log'}",
        f"NodeName=localhost CPUs={cpus} Boards=1 SocketsPerBoard=1 CoresPerSocket={cpus} ThreadsPerCore=1 "
        "RealMemory=1000 State=UNKNOWN",
        "PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES", ""]))
    env = dict(os.environ, SLURM_CONF=str(conf))
    daemons = []
    try:
        daemons.append(subprocess.Popen([_exe("munged"), "--foreground", "--force", f"--socket={sock}",
                                          f"--key-file={key}", f"--pid-file={d / 'munge' / 'pid'}",
                                          f"--log-file={d / 'munge.log'}", f"--seed-file={d / 'munge' / 'seed'}"],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        for _ in range(100):
            if sock.exists():
                break
            time.sleep(0.1)
        daemons.append(subprocess.Popen([_exe("slurmctld"), "-D", "-f", str(conf)], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        daemons.append(subprocess.Popen([_exe("slurmd"), "-D", "-N", "localhost", "-f", str(conf)], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 60
        while "idle" not in _run(["sinfo", "-h", "-o", "%T"], env, check=False):
            if time.monotonic() > deadline or any(p.poll() is not None for p in daemons):
                logs = "\n".join(f.read_text()[-2000:] for f in d.glob("*.log"))
                pytest.fail(f"the test's Slurm did not come up:\n{logs}")
            time.sleep(0.5)
        yield env
    finally:
        subprocess.run(["scancel", "--user=root", "--full"], env=env, capture_output=True)
        for p in reversed(daemons):
            _stop(p)


def _run(cmd: list[str], env: dict[str, str], check: bool = True) -> str:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 or not check, f"{cmd}: {proc.stderr}"
    return proc.stdout


def _facts(out: Path, name: str) -> dict | None:
    try:
        return json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def test_a_member_step_killed_under_slurm_leaves_the_job_training_and_completed(slurm: dict[str, str],
                                                                                tmp_path: Path) -> None:
    env = dict(slurm, PYTHON=sys.executable, FASTREDUCE_PORT=str(free_port()), OMP_NUM_THREADS="1", SPARES="1")
    job = _run(["sbatch", "--parsable", "--ntasks=5", "--overcommit", f"--chdir={ROOT}",
                f"--output={tmp_path / 'job.out'}", str(RECIPE), str(STEPS), str(tmp_path)], env).strip()
    deadline = time.monotonic() + 120
    while (victim := _facts(tmp_path, "member2")) is None or victim["step"] < KILL_AFTER:
        assert time.monotonic() < deadline, f"member 2 did not train:\n{(tmp_path / 'job.out').read_text()}"
        time.sleep(0.2)
    _run(["scancel", "--signal=KILL", f"{job}.{victim['step_id']}"], env)
    deadline = time.monotonic() + 180
    while _run(["squeue", "-h", "-j", job], env, check=False).strip():
        assert time.monotonic() < deadline, f"the job did not end:\n{(tmp_path / 'job.out').read_text()}"
        time.sleep(0.5)
    record = _run(["scontrol", "show", "job", job], env)
    log = (tmp_path / "job.out").read_text()
    assert "JobState=COMPLETED" in record and "ExitCode=0:0" in record, f"{record}\n{log}"
    assert "4 of 4 members trained to step" in log, log  # the spare in member 2's place
    final = [_facts(tmp_path, name) for name in ("member0", "member1", "member3", "spare0")]
    assert all(f["step"] == STEPS and f["world"] == 4 for f in final), final
    assert all(f["losses"] == 1 for f in final[:3]), final
    assert len({f["digest"] for f in final}) == 1, final  # one model on every member
    assert _facts(tmp_path, "member2")["step"] < STEPS


@pytest.mark.parametrize("version", ["1.29.0", "1.37.0"])
def test_the_kubernetes_manifests_are_valid_and_wire_the_members_to_the_coordinator(version: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (the test extra)")
    import yaml  # (kubernetes-validate's own dependency)

    docs = list(yaml.safe_load_all(MANIFEST.read_text()))
    for doc in docs:
        kv.validate(doc, version, strict=True)  # raises naming the field
    by_kind = {d["kind"]: d for d in docs}
    assert set(by_kind) == {"Service", "Deployment", "Job"}, sorted(by_kind)
    service, coordinator, job = by_kind["Service"], by_kind["Deployment"], by_kind["Job"]
    served = coordinator["spec"]["template"]["spec"]["containers"][0]
    port = int(served["command"][served["command"].index("--port") + 1])
    assert service["spec"]["ports"][0]["targetPort"] == port and served["ports"][0]["containerPort"] == port
    assert service["spec"]["selector"].items() <= coordinator["spec"]["template"]["metadata"]["labels"].items()
    spec = job["spec"]
    assert spec["template"]["spec"]["restartPolicy"] == "OnFailure"  # a member restarts in place and rejoins
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    env = {e["name"]: e["value"] for e in spec["template"]["spec"]["containers"][0]["env"]}
    assert env["FASTREDUCE_COORDINATOR"] == f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    assert int(env["FASTREDUCE_WORLD_SIZE"]) == spec["parallelism"]
    assert 1 <= int(env["FASTREDUCE_MIN_RANKS"]) <= spec["parallelism"], env
    member = spec["template"]["spec"]["containers"][0]["command"]
    assert member[1] == "-m" and importlib.util.find_spec(member[2]) is not None, member  # in the image's package
