"""Issue 43: what a Kubeflow TrainJob runs, and glmtune on Ray Train V2, against one `scripts/torchrun.sh 2` run.

- Two "nodes" on localhost run the emitted TrainJob's command with its env and the runtime's PET_* variables
  (PET_NNODES=2, PET_NPROC_PER_NODE=1, PET_NODE_RANK, PET_MASTER_ADDR/PORT): the adapter equals torchrun.sh 2's,
  and a local HTTPS server with its own CA receives the progress POSTs (bearer token, SDK-valid body, 5 s apart).
- SIGTERM to both nodes mid-run (Kueue's pre-emption): exit 7 within the TrainJob's grace period; the same two
  commands again resume to the same adapter, while the progress endpoint is dead the whole time.
- A local Ray cluster (2 CPUs, a 100 MB object store, no dashboard): `python -m glmtune.ray --workers 2` trains the
  same adapter, with one worker process killed mid-run (Ray restarts the group and glmtune resumes to it); a bad
  input ends in the rank's line and exit 2.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml
from helpers import REPO
from helpers.cli import glmtune_in_process

pytest.importorskip("kubeflow_trainer_api", reason='the kubeflow extra: pip install -e ".[kubeflow]"')

STEPS = 16
ARGS = [
    "lora=all_linear",
    "train.learning_rate=1e-2",
    f"train.max_steps={STEPS}",
    "train.save_steps=4",
    "train.logging_steps=1",
    "probe.enabled=false",
    f"data.train_file={REPO / 'data/samples/train.jsonl'}",
    "data.val_file=null",
]
ENV = {
    **os.environ,
    "PYTHONUNBUFFERED": "1",
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": str(REPO),
    "RAY_USAGE_STATS_ENABLED": "0",
}
TOKEN = "a-projected-service-account-jwt"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def adapter(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run_dir / "adapter" / "adapter_model.safetensors")


def assert_same_adapter(run_dir: Path, reference: dict) -> None:
    got = adapter(run_dir)
    assert got.keys() == reference.keys()
    worst = max((got[n] - reference[n]).abs().max().item() for n in got)
    assert worst <= 1e-6, f"adapter differs from torchrun.sh 2's by {worst}"


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return sum('"loss"' in line for line in path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The adapter of `scripts/torchrun.sh 2` with ARGS: every launch here must end at it."""
    from glmtune.models.presets import ensure_tiny

    ensure_tiny("glm4")
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    proc = subprocess.run(
        [str(REPO / "scripts" / "torchrun.sh"), "2", *ARGS, f"hydra.run.dir={run_dir}"],
        env={**ENV, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return adapter(run_dir)


# --- Kubeflow Trainer v2: the TrainJob's command, launched as the torch-distributed runtime launches it ---------


@pytest.fixture(scope="module")
def trainjob(tmp_path_factory) -> dict:
    """The TrainJob mode=plan emits for ARGS on 2 nodes of 1 process (this machine's CPU plan)."""
    work = tmp_path_factory.mktemp("emit")
    proc = glmtune_in_process(
        "mode=plan",
        "dist.nnodes=2",
        "dist.nproc_per_node=1",
        "plan.emit=trainjob",
        "plan.name=tiny-lora",
        *ARGS,
        cwd=work,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    [path] = work.glob("outputs/*/*/trainjob.yaml")
    return yaml.safe_load(path.read_text())


def grace_period(job: dict) -> int:
    patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    return patch["template"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]


def start_nodes(job: dict, volume: Path, extra_env: dict) -> list[subprocess.Popen]:
    """Each node's container: the TrainJob's command, args and env in the runtime's working dir (the volume), plus
    the PET_* variables the torch plugin injects. The volume's cache is the test session's (tiny model, data)."""
    trainer = job["spec"]["trainer"]
    command = [sys.executable if c == "python" else c for c in trainer["command"]] + trainer["args"]
    env = {
        **ENV,
        **{e["name"]: e["value"] for e in trainer["env"] if e["name"] != "GLMTUNE_CACHE"},
        **extra_env,
        "PET_NNODES": str(trainer["numNodes"]),
        "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(free_port()),
    }
    return [
        subprocess.Popen(
            command,
            cwd=volume,
            env={**env, "PET_NODE_RANK": str(node)},
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for node in range(trainer["numNodes"])
    ]


class StatusServer(http.server.ThreadingHTTPServer):
    """The Trainer controller's status endpoint: HTTPS with a certificate of its own CA; records every POST."""

    def __init__(self, certs: Path):
        self.posts: list[tuple[float, str, str, dict]] = []  # (time, path, authorization, body)

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(handler):  # noqa: N802 - http.server's name
                body = json.loads(handler.rfile.read(int(handler.headers["Content-Length"])))
                self.posts.append((time.monotonic(), handler.path, handler.headers.get("Authorization"), body))
                handler.send_response(200)
                handler.end_headers()

            def log_message(handler, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(certs / "server.crt", certs / "server.key")
        self.socket = context.wrap_socket(self.socket, server_side=True)


def make_certs(folder: Path) -> Path:
    """A CA and a server certificate for 127.0.0.1 that it signed (openssl), as the controller's webhook CA."""
    folder.mkdir()
    run = lambda *a: subprocess.run(["openssl", *a], cwd=folder, check=True, capture_output=True)  # noqa: E731
    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=test trainer CA",
    )
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "2",
        "-extfile",
        "san.ext",
    )
    return folder


@pytest.mark.slow
def test_two_nodes_as_the_runtime_launches_them_train_torchruns_adapter_and_report_progress(
    tmp_path, trainjob, reference
):
    from kubeflow_trainer_api.models import TrainerV1alpha1UpdateTrainJobStatusRequest as Request

    server = StatusServer(make_certs(tmp_path / "certs"))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    (tmp_path / "token").write_text(TOKEN + "\n")
    path = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/ml/trainjobs/tiny-lora/status"
    url = f"https://127.0.0.1:{server.server_address[1]}{path}"
    volume = tmp_path / "volume"
    volume.mkdir()
    nodes = start_nodes(
        trainjob,
        volume,
        {
            "KUBEFLOW_TRAINER_SERVER_URL": url,
            "KUBEFLOW_TRAINER_SERVER_TOKEN": str(tmp_path / "token"),
            "KUBEFLOW_TRAINER_SERVER_CA_CERT": str(tmp_path / "certs" / "ca.crt"),
        },
    )
    outs = [node.communicate(timeout=900) for node in nodes]
    server.shutdown()
    assert [node.returncode for node in nodes] == [0, 0], [err[-3000:] for _, err in outs]

    run_dir = volume / "outputs" / "tiny-lora"  # GLMTUNE_RUN_ID = the TrainJob's name, on the volume
    assert json.loads((run_dir / "plan.json").read_text())["choices"]["world_size"] == 2  # PET_NNODES x PROC
    assert_same_adapter(run_dir, reference)

    posts = server.posts
    assert len(posts) >= 2, posts
    assert {(where, auth) for _, where, auth, _ in posts} == {(path, f"Bearer {TOKEN}")}  # the token file's, stripped
    for _, _, _, body in posts:  # the SDK's request model reads each body back unchanged (the time as a datetime)
        parsed, sent = Request.from_dict(body).to_dict()["trainerStatus"], dict(body["trainerStatus"])
        when = datetime.fromisoformat(sent.pop("lastUpdatedTime").replace("Z", "+00:00"))
        assert parsed.pop("lastUpdatedTime") == when and when.tzinfo is not None
        assert parsed == sent and set(body) == {"trainerStatus"}
    times = [t for t, _, _, _ in posts]
    assert min(b - a for a, b in zip(times, times[1:])) >= 4.9  # at most one update per 5 s (receive-time jitter)
    statuses = [body["trainerStatus"] for _, _, _, body in posts]
    assert [s["progressPercentage"] for s in statuses] == sorted(s["progressPercentage"] for s in statuses)
    last = statuses[-1]
    assert last["progressPercentage"] == 100 and last["estimatedRemainingSeconds"] == 0
    metrics = {m["name"]: m["value"] for m in last["metrics"]}
    assert metrics["step"] == metrics["total_steps"] == str(STEPS) and float(metrics["loss"]) > 0
    # a post after some steps carries the time left (how many come between the first and the last depends on the
    # machine's speed: the ETA itself is checked in test_trainjob.py)
    assert all("estimatedRemainingSeconds" in s for s in statuses if 0 < s["progressPercentage"])


@pytest.mark.slow
def test_sigterm_to_both_nodes_exits_7_within_the_grace_period_and_the_same_commands_resume(
    tmp_path, trainjob, reference
):
    """Kueue's pre-emption: SIGTERM to every pod's main process, SIGKILL after terminationGracePeriodSeconds. The
    progress endpoint is dead throughout (nothing listens on its port): one warning, training unaffected."""
    (tmp_path / "token").write_text(TOKEN)
    dead = {
        "KUBEFLOW_TRAINER_SERVER_URL": f"http://127.0.0.1:{free_port()}/status",
        "KUBEFLOW_TRAINER_SERVER_TOKEN": str(tmp_path / "token"),
    }
    volume = tmp_path / "volume"
    volume.mkdir()
    run_dir = volume / "outputs" / "tiny-lora"
    nodes = start_nodes(trainjob, volume, dead)
    deadline = time.monotonic() + 600
    while logged_steps(run_dir) < 3:
        assert all(node.poll() is None for node in nodes), [node.communicate()[1][-3000:] for node in nodes]
        assert time.monotonic() < deadline, "no training step within 600 s"
        time.sleep(0.05)
    sent = time.monotonic()
    for node in nodes:
        node.send_signal(signal.SIGTERM)
    outs = [node.communicate(timeout=grace_period(trainjob)) for node in nodes]  # else: killed by Kubernetes
    took = time.monotonic() - sent
    assert [node.returncode for node in nodes] == [7, 7], [err[-3000:] for _, err in outs]
    assert took <= grace_period(trainjob)
    stops = [line for line in outs[0][1].splitlines() if line.startswith("glmtune: ")]
    assert len(stops) == 1 and stops[0].startswith("glmtune: stopped by SIGTERM at step "), outs[0][1][-3000:]
    assert "Traceback" not in outs[0][1] + outs[1][1]
    assert json.loads((run_dir / "run_state.json").read_text())["status"] == "interrupted"

    nodes = start_nodes(trainjob, volume, dead)  # the re-admitted pods: the same command on the same volume
    outs = [node.communicate(timeout=900) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-3000:] for _, err in outs]
    assert "resuming from" in outs[0][0]
    assert outs[0][0].count("cannot report progress to Kubeflow Trainer") == 1  # once (a warning), never stopped it
    assert_same_adapter(run_dir, reference)


# --- Ray Train V2 on a local cluster -------------------------------------------------------------------------------


def session_processes(sid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                    if int(fields[3]) == sid and fields[0] != "Z":  # field 6 of stat: the session; 3: state
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return found


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """`ray start --head --block` in a session of its own, small for this 2-core machine; stopped by signalling
    exactly the processes of that session (every Ray process it started), never by name."""
    pytest.importorskip("ray.train", reason='the ray extra: pip install -e ".[ray]"')
    port = free_port()
    temp = tmp_path_factory.mktemp("ray")
    head = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "ray"),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            "--num-cpus=2",
            "--num-gpus=0",
            "--object-store-memory=100000000",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={temp}",
        ],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    started = time.monotonic()
    for line in head.stdout:
        if "Ray runtime started" in line:
            break
        assert time.monotonic() - started < 300, "ray start did not finish within 300 s"
    assert head.poll() is None, "ray start exited"
    threading.Thread(target=lambda: [None for _ in head.stdout], daemon=True).start()  # keep its pipe drained
    yield {**ENV, "RAY_ADDRESS": f"127.0.0.1:{port}"}, time.monotonic() - started
    # 3 s of grace: a cluster of this test's own temp dir has nothing to save, and one of its processes outwaits a
    # SIGTERM for 15 s and more (measured: the whole grace on every run before)
    for sig, wait in ((signal.SIGTERM, 3), (signal.SIGKILL, 5)):
        for pid in session_processes(head.pid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + wait
        while session_processes(head.pid) and time.monotonic() < end:
            head.poll()  # reap `ray start` itself: a zombie would count as alive until the wait ran out
            time.sleep(0.2)


def ray_run(env: dict, storage: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "glmtune.ray", "--workers", "2", "--storage", str(storage), *args],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def own_lines(stderr: str) -> list[str]:
    """The driver's own glmtune lines (Ray prefixes what it relays from its actors with `(Name pid=...)`)."""
    return [line for line in stderr.splitlines() if line.startswith("glmtune: ")]


def rank_process(run_dir: Path, rank: int) -> int | None:
    """The glmtune rank `rank` training into `run_dir` (a child of its Ray worker), found by its env and argv."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"hydra.run.dir={run_dir}".encode() in argv and f"RANK={rank}".encode() in environ:
            return int(entry)
    return None


@pytest.mark.slow
def test_ray_two_workers_train_torchruns_adapter_and_resume_it_after_a_worker_process_is_killed(
    tmp_path, ray_cluster, reference
):
    """The group trains to a first complete checkpoint, loses a worker process, and Ray's restarted group resumes
    the run to torchrun's adapter (a run that loses nothing takes the same path without the restart)."""
    env, _ = ray_cluster
    run_dir = tmp_path.resolve() / "killed" / "glmtune"  # as the driver names it
    proc = ray_run(env, tmp_path, "--name", "killed", "--max-failures", "1", *ARGS)
    deadline = time.monotonic() + 600
    while not list(run_dir.glob("checkpoints/checkpoint-*/COMPLETE")):  # a complete checkpoint to lose work after
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no checkpoint within 600 s"
        time.sleep(0.1)
    child = rank_process(run_dir, 1)
    assert child is not None
    worker = int(Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[1])  # its Ray worker process
    assert "RayTrainWorker" in Path(f"/proc/{worker}/cmdline").read_text()
    os.kill(worker, signal.SIGKILL)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, (out[-2000:], err[-3000:])
    assert "resuming from" in out  # the restarted group continued the run from its last complete checkpoint
    assert f"glmtune on Ray: done; run dir {run_dir}" in out
    assert json.loads((run_dir / "plan.json").read_text())["choices"]["world_size"] == 2  # Ray's world
    assert_same_adapter(run_dir, reference)


@pytest.mark.slow
def test_ray_a_rank_that_refuses_its_input_ends_the_run_with_its_line_and_exit_2(tmp_path, ray_cluster):
    env, _ = ray_cluster
    proc = ray_run(
        env,
        tmp_path,
        "--name",
        "bad",
        "--max-failures",
        "2",
        *ARGS[:-2],
        f"data.train_file={tmp_path / 'missing.jsonl'}",
    )
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 2, (out[-2000:], err[-3000:])
    [line] = own_lines(err)
    assert line.startswith("glmtune: error: ") and "missing.jsonl" in line
    assert "resuming from" not in out  # the restart (max-failures 2) ended at once, no rank ran again


def test_ray_command_line_mistakes_are_one_line_and_exit_2_before_ray_starts(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "glmtune.ray",
            "--workers",
            "3-2",
            "--storage",
            "s3://bucket/runs",
            "train.lrr=1",
            "hydra.run.dir=x",
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    [line] = proc.stderr.splitlines()
    for says in ("--workers '3-2'", "--storage s3://bucket/runs", "hydra.run.dir", "unknown key 'train.lrr'"):
        assert says in line
