"""Store roles: credentials derived from the token, certificate roles, and how two combine."""

from __future__ import annotations

import pytest

from elasticrun.store.credentials import (
    ADMIN,
    NOTHING,
    READER,
    Grant,
    Role,
    grant_of_certificate,
    grant_of_token,
    reader_credential,
    worker_credential,
    worker_job_of,
    worker_prefix,
)
from elasticrun.store.server.callers import identify, permits

TOKEN = "the-admin-token"


def test_credentials_derive_from_the_token_and_only_from_it() -> None:
    worker = worker_credential(TOKEN, "job-ü.1")
    assert grant_of_token(TOKEN, TOKEN) == ADMIN
    assert grant_of_token(reader_credential(TOKEN), TOKEN) == READER
    assert grant_of_token(worker, TOKEN) == Grant(Role.WORKER, "job-ü.1")
    assert worker.isascii() and worker.isprintable() and TOKEN not in worker  # a gRPC header value
    tag, job, run, mac = worker.split(".")
    others = worker_credential(TOKEN, "other").split(".")
    of_run = worker_credential(TOKEN, "job-ü.1", "run-1")
    assert grant_of_token(of_run, TOKEN) == Grant(Role.WORKER, "job-ü.1", "run-1")
    _, _, run1, mac1 = of_run.split(".")
    for forged in (
        "", "nope", TOKEN + "x", reader_credential("another-token"), worker_credential("another-token", "job-ü.1"),
        f"{tag}.{others[1]}.{run}.{mac}",  # another job's name on this job's MAC
        f"{tag}.{job}.{run}.{others[3]}", f"{tag}.{job}", f"{tag}.!!.{run}.{mac}", "err1." + mac,
        f"{tag}.{job}.{run}.{mac1}", f"{tag}.{job}.{run1}.{mac}",  # a run's MAC without it, a run on a standing MAC
        "erw1." + job + "." + mac,  # the format before runs
    ):
        assert grant_of_token(forged, TOKEN) is None, forged
    with pytest.raises(ValueError):
        worker_credential(TOKEN, "a/b")


def test_certificate_roles_and_the_lesser_of_two() -> None:
    assert grant_of_certificate([]) == ADMIN  # no role named: admin, as before roles
    assert grant_of_certificate(["spiffe://x/y", "elasticrun:reader"]) == READER
    assert grant_of_certificate(["elasticrun:worker:j"]) == Grant(Role.WORKER, "j")
    assert grant_of_certificate(["elasticrun:root"]) == NOTHING
    # a URI's scheme has no case (RFC 3986): another spelling of a role is that role, never admin
    assert grant_of_certificate(["ELASTICRUN:reader"]) == READER
    assert grant_of_certificate(["ElasticRun:Reader"]) == NOTHING  # a role's name is exact: nothing
    worker_of_run = Grant(Role.WORKER, "a", "r1")
    assert worker_of_run & Grant(Role.WORKER, "a") == Grant(Role.WORKER, "a") & worker_of_run == worker_of_run
    assert worker_of_run & Grant(Role.WORKER, "a", "r2") == NOTHING
    assert grant_of_certificate(["elasticrun:worker:"]) == NOTHING
    assert grant_of_certificate(["elasticrun:admin", "elasticrun:reader"]) == READER
    assert Grant(Role.WORKER, "a") & Grant(Role.WORKER, "b") == NOTHING
    assert READER & Grant(Role.WORKER, "a") == NOTHING
    assert ADMIN & READER == READER & ADMIN == READER
    for service, method in (("Store", "Put"), ("C10dStore", "Set"), ("Store", "Range")):
        assert not permits(NOTHING, service, method)
    assert permits(READER, "Store", "RangePages") and not permits(READER, "C10dStore", "Get")
    worker = Grant(Role.WORKER, "a")
    assert permits(worker, "C10dStore", "Get") and not permits(worker, "Store", "Range")


def test_who_a_caller_is() -> None:
    worker = worker_credential(TOKEN, "j")
    cert, uris = b"-----BEGIN CERTIFICATE-----...", ["elasticrun:reader"]
    open_store = identify(bearer=None, token=None, certificate=None, uris=[], host="10.0.0.5")
    assert open_store is not None and open_store.grant == ADMIN and open_store.identity == "host 10.0.0.5"
    assert identify(bearer=None, token=TOKEN, certificate=None, uris=[], host="h") is None
    by_token = identify(bearer=worker, token=TOKEN, certificate=None, uris=[], host="h")
    assert by_token is not None and by_token.limited and by_token.identity == "worker credential of job 'j'"
    # every reader holds the one reader credential: each host's readers have a share of their own
    readers = [identify(bearer=reader_credential(TOKEN), token=TOKEN, certificate=None, uris=[], host=h)
               for h in ("10.0.0.5", "10.0.0.6", "10.0.0.5")]
    assert [r.identity if r else None for r in readers] == [
        "reader credential on host 10.0.0.5", "reader credential on host 10.0.0.6",
        "reader credential on host 10.0.0.5"]
    # the certificate decides: a reader, counted as its certificate
    both = identify(bearer=TOKEN, token=TOKEN, certificate=cert, uris=uris, host="h")
    assert both is not None and both.grant == READER and both.identity.startswith("certificate ")
    # the token decides: a worker with an admin certificate, counted as the job's workers
    mixed = identify(bearer=worker, token=TOKEN, certificate=cert, uris=[], host="h")
    assert mixed is not None and mixed.grant == Grant(Role.WORKER, "j") and "job 'j'" in mixed.identity


def test_worker_namespaces() -> None:
    assert worker_prefix("j") == "/elasticrun/j/w/"
    assert worker_job_of("/elasticrun/j/w/rank0") == "j"
    for key in ("/elasticrun/j/r/job/spec", "/elasticrun/j/w", "/elasticrun//w/x", "/other/j/w/x", "j/w/x"):
        assert worker_job_of(key) is None, key
