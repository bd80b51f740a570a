"""Who a caller of the built-in store is: its role, derived from the admin token or read
from its client certificate, and the worker namespace of a job.

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

    worker of job J   erw1.<J, base64url without padding>.<hex HMAC(token, "worker\\0" + J)>
    reader            err1.<hex HMAC(token, "reader\\0")>

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
from collections.abc import Iterable
from dataclasses import dataclass

#: Where every job keeps its keys (`/elasticrun/<job>/`), the rendezvous's layout.
JOBS_PREFIX = "/elasticrun/"
#: The folder of a job's prefix that holds its workers' c10d keys.
WORKER_FOLDER = "w/"

_WORKER_TAG = "erw1"
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

    def describe(self) -> str:
        if self.role is None:
            return "no role (its token and certificate name different roles)"
        if self.role is Role.WORKER:
            return f"worker of job {self.job!r}"
        return self.role.value

    def __and__(self, other: Grant) -> Grant:
        """What a call carrying both credentials may do: the lesser of the two."""
        if self.role is Role.ADMIN:
            return other
        if other.role is Role.ADMIN or other == self:
            return self
        return NOTHING


ADMIN = Grant(Role.ADMIN)
READER = Grant(Role.READER)
NOTHING = Grant(None)


def check_job(job: str) -> str:
    """A job id a worker credential can name: what --rdzv-id takes (no '/'), which the
    commands check first; anything else is a caller's mistake (ValueError)."""
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


def _mac(token: str, role: Role, job: str = "") -> str:
    message = f"{role.value}\0{job}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def worker_credential(token: str, job: str) -> str:
    """The credential of job `job`'s workers, derived from the admin `token`."""
    encoded = base64.urlsafe_b64encode(check_job(job).encode()).decode().rstrip("=")
    return f"{_WORKER_TAG}.{encoded}.{_mac(token, Role.WORKER, job)}"


def reader_credential(token: str) -> str:
    """The read-only credential, derived from the admin `token`."""
    return f"{_READER_TAG}.{_mac(token, Role.READER)}"


def grant_of_token(given: str, token: str) -> Grant | None:
    """What the bearer of `given` may do on a store whose admin token is `token`; None
    when `given` is neither that token nor a credential derived from it."""
    if hmac.compare_digest(given.encode(), token.encode()):
        return ADMIN
    tag, _, rest = given.partition(".")
    if tag == _READER_TAG:
        return READER if hmac.compare_digest(rest, _mac(token, Role.READER)) else None
    if tag != _WORKER_TAG:
        return None
    encoded, _, mac = rest.partition(".")
    try:
        job = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    if not job or "/" in job or not hmac.compare_digest(mac, _mac(token, Role.WORKER, job)):
        return None
    return Grant(Role.WORKER, job)


def grant_of_certificate(uris: Iterable[str]) -> Grant:
    """What a client certificate with these URI subject alternative names may do.

    `elasticrun:admin`, `elasticrun:reader` and `elasticrun:worker:<job>` name a role;
    several together allow what all of them allow (the lesser); an unknown
    `elasticrun:` URI allows nothing. A certificate with none of them is admin: before
    roles, every certificate the client CA signed could do everything, and a site that
    wants less says so in the certificates it issues.
    """
    grant = ADMIN
    for uri in uris:
        if not uri.startswith(CERT_URI_SCHEME):
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
