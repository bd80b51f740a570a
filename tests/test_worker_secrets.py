"""The agent's secrets stay in the agent, and a store open to others says so (real processes).

- An agent hosting a token-protected c10d store, started with ELASTICRUN_STORE_TOKEN and
  a variable named by password_env: its worker's environment holds neither value, and
  ELASTICRUN_STORE_TOKEN_FILE names a 0600 file with a worker credential of the job
  (never the token), gone once the agent ends.
- Without a token, `elasticrun store serve` and an agent hosting the store warn in one
  line when they listen on a wildcard address; on loopback `store serve` says nothing.

Workers are plain Python (no torch), so each test takes a few seconds.
"""

from __future__ import annotations

import json
import re
import secrets
import signal
from pathlib import Path

import pytest

from elasticrun.store.credentials import Role, grant_of_token
from tests.support.agent_helpers import write_script
from tests.support.elastic_cluster import RDZV_CONF, Cluster, Proc
from tests.support.helpers import free_port
from tests.support.reliability_rows import Reliability

pytestmark = pytest.mark.timeout(120)

#: prints the worker's whole environment (what a script might log), and reports the
#: token file it was given in the file named by argv[1]
ENV_PROBE = """\
import json, os, stat, sys
for key, value in sorted(os.environ.items()):
    print(f"env {key}={value}", flush=True)
path = os.environ.get("ELASTICRUN_STORE_TOKEN_FILE")
report = {"path": path}
if path:
    report["mode"] = stat.S_IMODE(os.stat(path).st_mode)
    report["content"] = open(path).read()
with open(sys.argv[1], "w") as f:
    json.dump(report, f)
"""

#: the warning's words, whichever command prints it
NO_TOKEN = r"has no token: anyone who can reach that port can join the job"


def agent(cluster: Cluster, name: str, endpoint: str, script: Path, *args: str, conf: str = RDZV_CONF) -> Proc:
    return cluster.launch(
        name,
        "--nnodes=1", "--nproc-per-node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id=sec-{secrets.token_hex(4)}",
        f"--rdzv-conf={conf}", "--local-addr=127.0.0.1", "--shutdown-timeout=5",
        f"--log-dir={cluster.tmp / 'logs'}", str(script), *args,
    )


@pytest.mark.security
def test_workers_get_no_secret_but_a_private_token_file(
    cluster: Cluster, tmp_path: Path, reliability: Reliability
) -> None:
    token = "store-token-" + secrets.token_hex(12)
    password = "etcd-password-" + secrets.token_hex(12)
    cluster._env.update(ELASTICRUN_STORE_TOKEN=token, TRAIN_DB_PASSWORD=password)
    probe = write_script(tmp_path, "probe.py", ENV_PROBE)
    report_file = tmp_path / "report.json"
    a = agent(
        cluster, "agent", f"127.0.0.1:{free_port()}", probe, str(report_file),
        conf=f"{RDZV_CONF},password_env=TRAIN_DB_PASSWORD",
    )
    assert a.wait_exit() == 0, a.text()[-3000:]
    out = a.text()
    assert re.search(r"^\[0\]<stdout>: env TORCHELASTIC_RUN_ID=", out, re.MULTILINE), out[-3000:]
    assert token not in out and password not in out, "a secret reached the worker's output"
    assert not re.search(r"<stdout>: env (ELASTICRUN_STORE_TOKEN|TRAIN_DB_PASSWORD)=", out), out[-3000:]
    report = json.loads(report_file.read_text())
    path = Path(report["path"])
    assert re.search(rf"^\[0\]<stdout>: env ELASTICRUN_STORE_TOKEN_FILE={re.escape(str(path))}$", out, re.MULTILINE)
    assert path.is_relative_to(cluster.tmp / "logs"), path  # in the agent's run folder
    run_id = re.search(r"^\[0\]<stdout>: env TORCHELASTIC_RUN_ID=(.*)$", out, re.MULTILINE)
    assert run_id is not None, out[-3000:]
    grant = grant_of_token(report["content"], token)  # a worker's of this job's run, not the token
    assert grant is not None and grant.role is Role.WORKER and grant.job == run_id.group(1) and grant.run, grant
    assert report["mode"] == 0o600 and report["content"] != token, report | {"content": "..."}
    assert not path.exists(), "the agent left its token file behind"
    assert not re.search(NO_TOKEN, out), out[-3000:]  # a token: nothing to warn about
    cluster.assert_no_orphans()
    reliability.record(
        part="security",
        scenario="a worker that dumps its environment",
        injected="an agent with $ELASTICRUN_STORE_TOKEN and an etcd password_env variable set; its worker "
        "prints its whole environment",
        happened="neither secret in the worker's environment or output; the worker got "
        "ELASTICRUN_STORE_TOKEN_FILE, a 0600 file in the agent's run folder holding a worker credential of its "
        "job (not the token), removed when the agent ended",
        lost="nothing",
    )


def _serve(cluster: Cluster, name: str, host: str) -> str:
    """Run `store serve` on `host` without a token until it serves; stop it; its output."""
    store = cluster.launch(
        name, "store", "serve", "--host", host, "--port", "0"
    )
    store.wait_for(r"serving on")
    if host == "0.0.0.0":
        store.wait_for(NO_TOKEN)
    store.signal(signal.SIGTERM)
    assert store.wait_exit() == 0, store.text()
    return store.text()


@pytest.mark.security
def test_a_store_without_a_token_warns_unless_on_loopback(
    cluster: Cluster, tmp_path: Path, reliability: Reliability
) -> None:
    cluster._env.pop("ELASTICRUN_STORE_TOKEN", None)
    wildcard = _serve(cluster, "store-all", "0.0.0.0")
    warnings = [line for line in wildcard.splitlines() if re.search(NO_TOKEN, line)]
    assert len(warnings) == 1, wildcard
    assert re.match(r"\[elasticrun \S+ WARNING\] the store on 0\.0\.0\.0:", warnings[0]), warnings[0]
    assert "--token-file or $ELASTICRUN_STORE_TOKEN" in warnings[0], warnings[0]
    loopback = _serve(cluster, "store-lo", "127.0.0.1")
    assert "warning" not in loopback, loopback

    # an agent that hosts the store on every interface warns the same way, once
    done = write_script(tmp_path, "done.py", "print('done', flush=True)\n")
    a = agent(cluster, "agent", f"0.0.0.0:{free_port()}", done)
    assert a.wait_exit() == 0, a.text()[-3000:]
    lines = [line for line in a.text().splitlines() if re.search(NO_TOKEN, line)]
    assert len(lines) == 1, a.text()[-3000:]
    assert "set --rdzv-conf token_file or $ELASTICRUN_STORE_TOKEN" in lines[0], lines[0]
    cluster.assert_no_orphans()
    reliability.record(
        part="security",
        scenario="a store without a token that others can reach",
        injected="store serve on 0.0.0.0 and on 127.0.0.1 without a token; an agent hosting the store on 0.0.0.0",
        happened="one warning line each on 0.0.0.0 (who can do what, and the flag that sets a token); none on "
        "loopback",
        lost="nothing",
    )
