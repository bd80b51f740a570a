"""Who a caller of the built-in store is, and the worker namespace of a job.

A caller's role is derived from the admin token or read from its client certificate.

Three roles, as etcd's RBAC splits users by key prefix:

- **admin**: everything. The store's token (`token_file`, `$ELASTICRUN_STORE_TOKEN`):
  the agents and job control (`stop`, `drain`, `join`).
- **worker** of job J: the c10d operations only, on J's own keys, which the server keeps
  under `/elasticrun/J/w/` (`worker_prefix`), out of reach of every job's records.
  What the agent hands its workers, never the admin token.
- **reader**: reads (Range, Watch) and nothing else: `status`, `list`, `logs`, scrapers.

The worker and reader credentials are derived from the admin token, so the server needs
no list of them and nothing to store: a credential carries its role (and job), and an
HMAC-SHA256 keyed by the admin token that the server recomputes and compares in constant
time. Whoever holds the admin token can mint any of them (`elasticrun store credential`);
whoever holds one cannot derive another, nor the token.

    worker of job J, run R   erw2.<J>.<R>.<hex HMAC(token, "worker\\0" + J + "\\0" + R)>
    reader                   err1.<hex HMAC(token, "reader\\0")>

(J and R in base64url without padding.) The credential an agent writes for its workers
names the run of the job it belongs to: the nonce its first node put in the job's launch
record (`RUN_RECORD`, `run_of_launch`), new each time the job starts (and each time a
store that restarted empty sees it again). The server takes it only while that run is
the job's current one and the job runs (its round record, `ROUND_RECORD`, is there and
not closed: `run_is_on`), so a credential that leaked from a run dies with it, and
`stop` ends it at once. A worker
credential with no run (R empty: what `elasticrun store credential` mints, and a
certificate's role) is a standing grant for the job, revoked only by a new token.

A client certificate names its role in a URI subject alternative name
(`elasticrun:admin`, `elasticrun:reader`, `elasticrun:worker:<job>`); one with none is
admin, as every certificate the client CA signed was before roles existed.

Imported by both ends (the agent derives its workers' credential, the server checks it):
nothing of the server or of grpc here.
"""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
import hmac
import json
from collections.abc import Iterable
from dataclasses import dataclass

#: Where every job keeps its keys (`/elasticrun/<job>/`), the rendezvous's layout.
JOBS_PREFIX = "/elasticrun/"
#: The folder of a job's prefix that holds its workers' c10d keys.
WORKER_FOLDER = "w/"

_WORKER_TAG = "erw2"
_READER_TAG = "err1"
#: the scheme of a role in a certificate's URI subject alternative name
CERT_URI_SCHEME = "elasticrun:"


class Role(enum.StrEnum):
    ADMIN = "admin"
    WORKER = "worker"
    READER = "reader"


@dataclass(frozen=True, slots=True)
class Grant:
    """What a credential allows: a role, and for a worker the job whose keys it reaches.

    `NOTHING` is what two credentials that disagree (a token of one job, a certificate
    of another) allow together.
    """

    role: Role | None
    job: str = ""
    #: a worker's run of `job`, "" for any run (see the module's docstring)
    run: str = ""

    def describe(self) -> str:
        if self.role is None:
            return "no role (its token and certificate name different roles)"
        if self.role is Role.WORKER:
            return f"worker of job {self.job!r}"
        return self.role.value

    def __and__(self, other: Grant) -> Grant:
        """What a call carrying both credentials may do.

        The lesser of the two (a worker of one run of a job is less than a worker of any
        run of it)."""
        if self.role is Role.ADMIN:
            return other
        if other.role is Role.ADMIN or other == self:
            return self
        if self.role is other.role is Role.WORKER and self.job == other.job and "" in (self.run, other.run):
            return self if self.run else other
        return NOTHING


ADMIN = Grant(Role.ADMIN)
READER = Grant(Role.READER)
NOTHING = Grant(None)


def check_job(job: str) -> str:
    """A job id a worker credential can name.

    What --rdzv-id takes (no '/'), which the commands check first; anything else is a
    caller's mistake (ValueError)."""
    if not job or "/" in job:
        raise ValueError(f"a job id must be a non-empty name without '/', got {job!r}")
    return job


def worker_prefix(job: str) -> str:
    """The prefix under which the server keeps the c10d keys of job `job`'s workers."""
    return f"{JOBS_PREFIX}{job}/{WORKER_FOLDER}"


def worker_job_of(key: str) -> str | None:
    """The job whose worker namespace holds `key`, None for a key outside every one."""
    if not key.startswith(JOBS_PREFIX):
        return None
    job, slash, rest = key[len(JOBS_PREFIX) :].partition("/")
    return job if slash and job and rest.startswith(WORKER_FOLDER) else None


#: The record (under a job's prefix) whose `RUN_FIELD` names the job's current run: the
#: rendezvous's job launch record (`rendezvous/records.py`, `JobLaunch.run`).
RUN_RECORD = "r/job/launch"
RUN_FIELD = "run"


#: The record (under a job's prefix) whose `CLOSED_FIELD` says the job has ended: the
#: rendezvous's round record (`rendezvous/rounds.py`, `RoundHead.closed`).
ROUND_RECORD = "r/job/round"
CLOSED_FIELD = "closed"


def run_is_on(raw_round: bytes | None) -> bool:
    """Whether a job whose round record is `raw_round` (None: there is none) runs.

    A job's workers run only in a round: before its first there are none, and once it
    ended (closed, or its closed record expired) its run's credentials are dead."""
    if raw_round is None:
        return False
    try:
        closed = json.loads(raw_round).get(CLOSED_FIELD, "")
    except (ValueError, AttributeError):
        return False
    return not closed


def run_of_launch(raw: bytes | None) -> str:
    """The run a job's launch record names ("" for none).

    None: a job started by a version that had no runs, a static rendezvous, or a record
    that does not parse."""
    if raw is None:
        return ""
    try:
        run = json.loads(raw).get(RUN_FIELD, "")
    except (ValueError, AttributeError):
        return ""
    return run if isinstance(run, str) else ""


def _mac(token: str, role: Role, *parts: str) -> str:
    message = "\0".join((role.value, *parts)).encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def _b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def _unb64(encoded: str) -> str | None:
    try:
        return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None


def worker_credential(token: str, job: str, run: str = "") -> str:
    """The credential of job `job`'s workers in run `run` ("": any run), derived from the admin `token`."""
    return f"{_WORKER_TAG}.{_b64(check_job(job))}.{_b64(run)}.{_mac(token, Role.WORKER, job, run)}"


def reader_credential(token: str) -> str:
    """The read-only credential, derived from the admin `token`."""
    return _READER_TAG + "." + _mac(token, Role.READER, "")


def grant_of_token(given: str, token: str) -> Grant | None:
    """What the bearer of `given` may do on a store whose admin token is `token`.

    None when `given` is neither that token nor a credential derived from it."""
    if hmac.compare_digest(given.encode(), token.encode()):
        return ADMIN
    tag, _, rest = given.partition(".")
    if tag == _READER_TAG:
        return READER if hmac.compare_digest(rest, _mac(token, Role.READER, "")) else None
    if tag != _WORKER_TAG:
        return None
    encoded_job, _, rest = rest.partition(".")
    encoded_run, _, mac = rest.partition(".")
    job, run = _unb64(encoded_job), _unb64(encoded_run)
    if not job or "/" in job or run is None or not hmac.compare_digest(mac, _mac(token, Role.WORKER, job, run)):
        return None
    return Grant(Role.WORKER, job, run)


def grant_of_certificate(uris: Iterable[str]) -> Grant:
    """What a client certificate with these URI subject alternative names may do.

    `elasticrun:admin`, `elasticrun:reader` and `elasticrun:worker:<job>` name a role
    (the scheme in any case); several together allow what all of them allow (the
    lesser); any other `elasticrun:` URI allows nothing. A certificate with none of them is admin: before
    roles, every certificate the client CA signed could do everything, and a site that
    wants less says so in the certificates it issues.
    """
    grant = ADMIN
    for uri in uris:
        # a URI's scheme has no case (RFC 3986): `ELASTICRUN:reader` names a role too
        if uri[: len(CERT_URI_SCHEME)].lower() != CERT_URI_SCHEME:
            continue
        named = uri[len(CERT_URI_SCHEME) :]
        if named == "admin":
            role = ADMIN
        elif named == "reader":
            role = READER
        elif named.startswith("worker:") and named[7:] and "/" not in named[7:]:
            role = Grant(Role.WORKER, named[7:])
        else:
            role = NOTHING
        grant &= role
    return grant
