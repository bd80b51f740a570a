"""The examples do what they say, and their command lines stay valid.

- examples/train_elastic.py, SIGKILLed mid-run under elasticrun, resumes from its
  checkpoint (not from step 0) when started again, and finishes.
- Every `elasticrun` command line in the Kubernetes manifests, the Kubernetes README and
  the Slurm batch script is accepted by the CLI: launcher lines are parsed by
  `launch_parser()` and turned into a config by `build_config()` (with the training
  script replaced by an existing dummy file, and `--nproc-per-node=gpu` by 1 on hosts
  without GPUs); subcommand lines are parsed by `subcommand_parser()` and their job
  flags checked by `job_target()` (`list`: `store_target()`).
"""

from __future__ import annotations

import os
import queue
import re
import shlex
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest

from elasticrun.launcher.assemble import build_config
from elasticrun.launcher.cli import SUBCOMMANDS, launch_parser, subcommand_parser
from elasticrun.launcher.config import LaunchConfig
from elasticrun.launcher.control import job_target, store_target
from examples.elastic_demo import descendants, kill_tree
from tests.support.helpers import ELASTICRUN

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
K8S = EXAMPLES / "kubernetes"
SLURM = EXAMPLES / "slurm"
WAIT = 60.0


# --- train_elastic.py resumes after a kill ------------------------------------------------


class Job:
    """An elasticrun process whose output lines are read on a thread, to wait on them."""

    def __init__(self, argv: list[str], cwd: Path) -> None:
        self.proc = subprocess.Popen(
            argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_line(self, pattern: str, timeout: float = WAIT) -> re.Match[str]:
        """The first line (from here on) that matches; fail at EOF or after `timeout`."""
        regex = re.compile(pattern)
        while True:
            try:
                line = self._queue.get(timeout=timeout)
            except queue.Empty:
                pytest.fail(
                    f"no line matching {pattern!r} within {timeout:g}s; output:\n" + "\n".join(self.lines[-30:])
                )
            if line is None:
                pytest.fail(f"output ended before a line matching {pattern!r}; output:\n" + "\n".join(self.lines[-30:]))
            self.lines.append(line)
            match = regex.search(line)
            if match:
                return match

    def finish(self, timeout: float = WAIT) -> int:
        """Read to the end and return the exit code."""
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout)
        while True:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                break
            if line is not None:
                self.lines.append(line)
        return code

    def kill_all(self) -> None:
        """SIGKILL the agent and every process below it, each by PID."""
        kill_tree(self.proc)


@pytest.fixture
def jobs() -> Iterator[list[Job]]:
    started: list[Job] = []
    yield started
    for job in started:
        if job.proc.poll() is None:
            job.kill_all()


@pytest.mark.timeout(150)
def test_train_elastic_resumes_from_its_checkpoint_after_a_kill(tmp_path: Path, jobs: list[Job]) -> None:
    pytest.importorskip("torch")
    ckpt = tmp_path / "ckpt"
    steps, every = 30, 4
    argv = [
        *ELASTICRUN, "--standalone", "--nproc-per-node=2",
        str(EXAMPLES / "train_elastic.py"), f"--steps={steps}", f"--checkpoint-every={every}",
        f"--checkpoint-dir={ckpt}", "--step-time=0.05",
    ]
    first = Job(argv, tmp_path)
    jobs.append(first)
    assert first.wait_line(r"start at step (\d+)").group(1) == "0"
    # Rank 0 writes the checkpoint of step 2*every before it prints the next step.
    first.wait_line(rf"Step #{2 * every + 1}\s")
    workers = descendants(first.proc.pid)
    assert workers, "the agent has no worker processes to kill"
    first.kill_all()
    assert first.proc.returncode == -signal.SIGKILL

    import torch

    saved = int(torch.load(ckpt / "ckpt.pt", weights_only=True)["step"])
    assert saved >= 2 * every and saved % every == 0 and saved < steps

    second = Job(argv, tmp_path)
    jobs.append(second)
    resumed = int(second.wait_line(r"start at step (\d+)").group(1))
    assert resumed == saved
    assert second.finish() == 0, "\n".join(second.lines[-30:])
    done = [int(m.group(1)) for line in second.lines if (m := re.search(r"Step #(\d+)\s", line))]
    assert done and done[0] == saved + 1 and done[-1] == steps


# --- command lines in the deployment examples ---------------------------------------------


def _substitute(text: str, values: dict[str, str]) -> str:
    """Expand $(VAR) (Kubernetes), ${VAR}, ${VAR:-default} and $VAR (shell) from `values`."""

    def one(m: re.Match[str]) -> str:
        name = m.group("k8s") or m.group("brace") or m.group("plain")
        if m.group("default") is not None and not values.get(name):  # as the shell: unset or empty
            return _substitute(m.group("default"), values)
        if name in values:
            return values[name]
        raise AssertionError(f"no sample value for ${name} in {text!r}")

    pattern = r"\$\((?P<k8s>\w+)\)|\$\{(?P<brace>\w+)(?::-(?P<default>[^}]*))?\}|\$(?P<plain>[A-Za-z_]\w*)"
    return re.sub(pattern, one, text)


_SHELL_OPS = ("&&", "||", ";", "|", "&")


def elasticrun_argv(tokens: list[str]) -> list[str] | None:
    """The arguments after `elasticrun` / `python -m elasticrun`, up to a shell operator."""
    for i, token in enumerate(tokens):
        command = token.endswith("/elasticrun") or (
            token == "elasticrun" and (i == 0 or tokens[i - 1] in ("-m", "--", "exec", "srun", *_SHELL_OPS))
        )
        if command:
            rest = tokens[i + 1:]
            ends = [j for j, arg in enumerate(rest) if arg in _SHELL_OPS]
            return rest[: ends[0]] if ends else rest
    return None


def shell_commands(script: str) -> list[str]:
    """Logical lines of a shell script (continuations joined, comments dropped)."""
    joined = re.sub(r"\\\n", " ", script)
    lines = []
    for line in joined.splitlines():
        line = re.sub(r"\s+#\s.*$", "", line).strip()  # a trailing comment
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def _containers(node: object) -> list[dict]:
    """Every container of every pod template in a manifest, wherever its kind keeps them
    (a Job's spec.template, a PyTorchJob's replica specs, a JobSet's replicated Jobs)."""
    if isinstance(node, list):
        return [c for item in node for c in _containers(item)]
    if not isinstance(node, dict):
        return []
    if isinstance(node.get("containers"), list):  # a pod spec
        return [*(node.get("initContainers") or []), *node["containers"]]
    return [c for value in node.values() for c in _containers(value)]


def operator_env(doc: dict) -> dict[str, str]:
    """What the Kubeflow training operator adds to every pod of an elastic PyTorchJob: its
    elasticPolicy as torchrun's PET_* variables (the operator's documented mapping)."""
    policy = (doc.get("spec") or {}).get("elasticPolicy") if doc.get("kind") == "PyTorchJob" else None
    if not policy:
        return {}
    host = policy.get("rdzvHost", f"{doc['metadata']['name']}-worker-0")
    env = {
        "PET_RDZV_BACKEND": policy.get("rdzvBackend", "c10d"),
        "PET_RDZV_ENDPOINT": f"{host}:{policy['rdzvPort']}",
        "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
    }
    for variable, key in (("PET_MAX_RESTARTS", "maxRestarts"), ("PET_NPROC_PER_NODE", "nProcPerNode"),
                          ("PET_RDZV_ID", "rdzvId")):
        if key in policy:
            env[variable] = str(policy[key])
    if policy.get("rdzvConf"):
        env["PET_RDZV_CONF"] = ",".join(f"{c['key']}={c['value']}" for c in policy["rdzvConf"])
    return env


def _manifest_docs() -> list[tuple[str, dict]]:
    yaml = pytest.importorskip("yaml")
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path.name, doc))
    return docs


def test_every_kubernetes_manifest_parses_and_names_its_kind() -> None:
    docs = _manifest_docs()
    assert docs, "no manifests in examples/kubernetes"
    kinds = {doc["kind"] for _, doc in docs}
    assert {"StatefulSet", "Service", "PriorityClass", "Job"} <= kinds, kinds
    for name, doc in docs:
        meta = doc.get("metadata") or {}
        assert doc.get("apiVersion") and (meta.get("name") or meta.get("generateName")), f"{name}: {doc.get('kind')}"
    etcd = next(doc for _, doc in docs if doc["kind"] == "StatefulSet" and doc["metadata"]["name"] == "etcd")
    assert etcd["spec"]["replicas"] == 3
    headless = next(
        doc for _, doc in docs
        if doc["kind"] == "Service" and doc["metadata"]["name"] == etcd["spec"]["serviceName"]
    )
    assert headless["spec"]["clusterIP"] == "None"
    classes = {doc["metadata"]["name"]: doc for _, doc in docs if doc["kind"] == "PriorityClass"}
    training = [
        c for _, doc in docs if doc["kind"] == "Job"
        for c in [doc["spec"]["template"]["spec"].get("priorityClassName")]
    ]
    assert training and all(c in classes for c in training)
    assert all(classes[c]["value"] < min(v["value"] for k, v in classes.items() if k not in training) for c in training)


#: where, the arguments after `elasticrun`, and the variables it gets from outside its
#: command line (a PyTorchJob's from the operator)
Command = tuple[str, list[str], dict[str, str]]


def manifest_commands() -> list[Command]:
    """Every elasticrun command in the manifests."""
    found = []
    for name, doc in _manifest_docs():
        outside = operator_env(doc)
        for container in _containers(doc):
            env = {e["name"]: e.get("value", "placeholder") for e in container.get("env") or []}
            env.setdefault("POD_IP", "10.0.0.1")
            argv = [str(a) for a in [*(container.get("command") or []), *(container.get("args") or [])]]
            if len(argv) >= 3 and argv[1] == "-c" and argv[0].endswith("sh"):
                scripts = shell_commands(argv[2])
            else:
                scripts = [shlex.join(argv)]
            for line in scripts:
                tokens = shlex.split(_substitute(line, env))
                args = elasticrun_argv(tokens)
                if args is not None:
                    found.append((f"{name}: {container['name']}", args, outside))
    return found


#: sample values for the variables the Slurm script and the Kubernetes README use
SAMPLE_ENV = {
    "SLURM_JOB_ID": "1234",
    "SLURM_JOB_NODELIST": "node[001-005]",
    "SLURM_NNODES": "5",
    "SLURM_GPUS_ON_NODE": "8",
    "SLURMD_NODENAME": "node002",
    "HEAD_NODE": "node001",
    "JOB": "bert-elastic",
    "POD": "elastic-train-0-abcde",
    "HOME": "/home/user",
    "SLURM_PROCID": "1",
    "NNODES": "4",  # the script's default is an arithmetic expansion: $((SLURM_NTASKS - 1))
}


def shell_script_commands(where: str, script: str, values: dict[str, str] | None = None) -> list[Command]:
    """elasticrun commands of a shell script; its simple `NAME=value` lines are followed
    (in `values`, which a caller may share between the blocks of one document)."""
    found = []
    values = dict(SAMPLE_ENV) if values is None else values
    for line in shell_commands(script):
        assign = re.fullmatch(r"(?:export\s+)?([A-Za-z_]\w*)=(\S*)", line)
        if assign:
            value = assign.group(2)
            # a command substitution stands for a host or pod name here
            values[assign.group(1)] = "node001" if "$(" in value else _substitute(value, values)
            continue
        if "elasticrun" not in line:
            continue
        args = elasticrun_argv(shlex.split(_substitute(line, values)))
        if args is not None:
            found.append((where, args, {}))
    return found


def slurm_commands() -> list[Command]:
    found = []
    for path in sorted(SLURM.glob("*.sbatch")):
        found += shell_script_commands(path.name, path.read_text())
    return found


def readme_commands() -> list[Command]:
    found = []
    values = dict(SAMPLE_ENV)
    text = (K8S / "README.md").read_text()
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, flags=re.S):
        found += shell_script_commands("kubernetes/README.md", block, values)
    return found


def check_cli_accepts(args: list[str], dummy_script: Path, env: dict[str, str] | None = None) -> str:
    """Parse one elasticrun command line as the CLI would, with `env` as its environment;
    return its kind. A token file named in --rdzv-conf is in the pod or on the node: a
    sample one stands for it."""
    token = dummy_script.with_name("store.token")
    token.write_text("sample-token\n")
    args = [re.sub(r"token_file=[^,]+", f"token_file={token}", a) for a in args]
    if args and args[0] in SUBCOMMANDS:
        parsed = subcommand_parser().parse_args(args)
        if args[0] == "list":
            store_target(parsed)
        elif args[0] != "store":
            job_target(parsed)
        return args[0]
    launch_config(args, dummy_script, env or {})
    return "launch"


def launch_config(args: list[str], dummy_script: Path, env: dict[str, str]) -> LaunchConfig:
    """The launcher's config for a command line; its flags' defaults from `env`'s PET_*
    variables, as torchrun's."""
    with mock.patch.dict(os.environ, env):
        parsed = launch_parser().parse_args(args)
    parsed.training_script = str(dummy_script)
    if parsed.nproc_per_node == "gpu":
        parsed.nproc_per_node = "1"  # the GPU count is the host's, not the manifest's
    return build_config(parsed, env)


def test_every_elasticrun_command_in_the_deployment_examples_is_accepted(tmp_path: Path) -> None:
    dummy = tmp_path / "train.py"
    dummy.write_text("")
    commands = manifest_commands() + readme_commands() + slurm_commands()
    kinds: dict[str, set[str]] = {}
    for where, args, env in commands:
        try:
            kind = check_cli_accepts(args, dummy, env)
        except Exception as e:  # noqa: BLE001 - report which line failed, and why
            pytest.fail(f"{where}: elasticrun {shlex.join(args)}\n  rejected: {type(e).__name__}: {e}")
        kinds.setdefault(where.split(":")[0], set()).add(kind)
    # The extraction itself must find what the examples are about.
    assert "launch" in kinds.get("training-job.yaml", set()), kinds
    assert "join" in kinds.get("join-pod.yaml", set()), kinds
    assert "launch" in kinds.get("pytorchjob-elastic.yaml", set()), kinds
    assert {"store", "launch"} <= kinds.get("jobset.yaml", set()), kinds
    assert {"status", "join", "drain", "logs"} <= kinds.get("kubernetes/README.md", set()), kinds
    assert "launch" in kinds.get("fault_tolerant.sbatch", set()), kinds
    assert "join" in kinds.get("fault_tolerant.sbatch", set()), kinds


def test_the_command_check_rejects_a_bad_command_line(tmp_path: Path) -> None:
    """The check above can fail: a flag the CLI does not know is caught."""
    from elasticrun.errors import UsageError

    dummy = tmp_path / "train.py"
    dummy.write_text("")
    with pytest.raises(UsageError):
        check_cli_accepts(
            ["--nnodes=2:8", "--rdzv-backend=etcd", "--rdzv-endpoint=e:2379", "--no-such-flag", "x.py"], dummy
        )
    with pytest.raises(UsageError):
        check_cli_accepts(["--nnodes=8:2", "--rdzv-backend=etcd", "--rdzv-endpoint=e:2379", "x.py"], dummy)
    with pytest.raises(UsageError):
        check_cli_accepts(["drain", "--rdzv-endpoint=e:2379", "--rdzv-id=j", "--cnt", "1"], dummy)
    argv = shlex.split("srun python -m elasticrun --nnodes=4 t.py && echo ok")
    assert elasticrun_argv(argv) == ["--nnodes=4", "t.py"]


def test_the_slurm_script_is_valid_bash_with_sbatch_options() -> None:
    scripts = sorted(SLURM.glob("*.sbatch"))
    assert scripts
    for path in scripts:
        checked = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
        assert checked.returncode == 0, checked.stderr
        options = re.findall(r"^#SBATCH\s+(--[\w-]+)", path.read_text(), flags=re.M)
        assert {"--nodes", "--ntasks-per-node"} <= set(options), options


def test_the_pytorchjob_command_takes_the_elastic_policy_from_the_operators_variables(tmp_path: Path) -> None:
    """The PyTorchJob's command names none of min:max, restarts, backend, id or timings:
    elasticrun reads them from the PET_* variables the operator sets, as torchrun would;
    the endpoint on the command line (all three etcd members) wins over the variable's."""
    dummy = tmp_path / "train.py"
    dummy.write_text("")
    [(_, args, env)] = [c for c in manifest_commands() if c[0].startswith("pytorchjob-elastic.yaml")]
    assert env["PET_NNODES"] == "2:8" and not any(a.startswith("--nnodes") for a in args)
    config = launch_config(args, dummy, env)
    spec, rdzv = config.job_spec, config.rdzv
    assert (spec.min_nodes, spec.max_nodes, spec.max_restarts) == (2, 8, 3)
    assert (rdzv.backend, rdzv.endpoint) == ("etcd", "etcd-0.etcd:2379,etcd-1.etcd:2379,etcd-2.etcd:2379")
    assert config.worker.run_id == "bert-elastic"
    assert {"heartbeat_timeout": "10", "join_timeout": "1800"}.items() <= dict(rdzv.conf).items()
