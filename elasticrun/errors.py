"""The error hierarchy of elasticrun.

Every module raises one of these, with the facts a user needs to act (which host, which
flag, what was expected). They are turned into a one-line message and an exit code only
at the CLI edge (`elasticrun.launcher.cli`), never earlier.
"""

from __future__ import annotations

# --- exit codes (docs/cli.md#exit-codes), chosen for schedulers ------------------------
# Kubernetes' ExitCode restart policy (PyTorchJob) takes 1-127 as permanent failures and
# 128-255 as retryable ones; a Job's podFailurePolicy can tell each code apart.

#: the workers failed beyond --max-restarts, or the job failed: torchrun's code
EXIT_TRAINING_FAILED = 1
#: a bad flag, value or combination; retrying the same command cannot help
EXIT_USAGE = 2
#: the infrastructure failed this node: the store unreachable, no round within
#: join_timeout, a GPU that is sick. Retryable, and above every 128+N a signal gives.
EXIT_INFRASTRUCTURE = 200
#: the agent was stopped by signal N: 128+N (143 for SIGTERM), as a shell reports it
EXIT_SIGNAL_BASE = 128


def exit_for_signal(signum: int) -> int:
    """The exit code of an agent stopped by signal `signum`."""
    return EXIT_SIGNAL_BASE + signum


class ElasticrunError(Exception):
    """Base of every error elasticrun raises on purpose.

    `exit_code` is what the CLI exits with when this error reaches it.
    """

    exit_code: int = EXIT_TRAINING_FAILED


class UsageError(ElasticrunError):
    """The user asked for something impossible: a bad flag, value or combination."""

    exit_code = EXIT_USAGE


# --- store ---------------------------------------------------------------------------


class StoreError(ElasticrunError):
    """A key-value store operation failed."""

    exit_code = EXIT_INFRASTRUCTURE


class StoreUnavailableError(StoreError):
    """The store could not be reached (within the deadline) at `endpoint`."""

    def __init__(self, endpoint: str, cause: str) -> None:
        super().__init__(f"store at {endpoint} is unreachable: {cause}")
        self.endpoint = endpoint
        self.cause = cause


class StoreGoneError(StoreUnavailableError):
    """The store an agent hosted refuses connections: that agent is gone, and the store's records with it.

    Retrying the call until its deadline cannot bring them back, so the call fails at
    once; the rendezvous then waits `store_host_grace` for a new store at the endpoint.
    """


class StoreAuthError(StoreError):
    """The store refused us: missing or wrong token, bad credentials, TLS mismatch."""

    exit_code = EXIT_USAGE


class StorePermissionError(StoreAuthError):
    """The store took our credential, but its role may not do this.

    A reader writing, a worker reading a job's records (the built-in store's roles,
    etcd's key permissions)."""


class StoreSettingError(StoreError):
    """A store setting that cannot work.

    An unreadable file, a malformed endpoint, credentials that do not go together.

    `settings` name the setting, or those that do not go together, as the store knows
    them (`token_file`, `ca_cert`, `endpoint`); the command that took them from the user
    says which flags they were.
    """

    exit_code = EXIT_USAGE

    def __init__(self, settings: str | tuple[str, ...], problem: str) -> None:
        self.settings = (settings,) if isinstance(settings, str) else settings
        self.problem = problem
        super().__init__(f"{', '.join(self.settings)}: {problem}")


class StoreAddressError(StoreError):
    """The store server cannot listen where it was asked.

    The port is taken, or the address is not one of this host's."""

    exit_code = EXIT_USAGE


class NotAStoreError(StoreError):
    """Something answers at the endpoint, but not as the store the backend expects.

    An etcd server at a c10d endpoint, another gRPC service, a program that does not
    speak gRPC at all. Retrying cannot help: the endpoint (or the backend) is wrong.

    `what` says what answers there, in a few words ("an etcd server").
    """

    exit_code = EXIT_USAGE

    def __init__(self, endpoint: str, what: str, fix: str) -> None:
        super().__init__(f"{endpoint} is {what}, not the built-in store: {fix}")
        self.endpoint = endpoint
        self.what = what


class StoreRequestError(StoreError):
    """The store refused a request as malformed: retrying it cannot help.

    A TTL that is no duration, say, or adding to a value that is no integer."""

    exit_code = EXIT_TRAINING_FAILED


class StoreLimitError(StoreError):
    """A request exceeded a bound of the store (key size, value size, key count)."""


class StoreTimeoutError(StoreError):
    """A waiting store operation (get-with-wait, wait) ran past its timeout."""


class LeaseExpiredError(StoreError):
    """The lease is gone: it expired or was revoked, and its keys with it."""

    def __init__(self, lease_id: int) -> None:
        super().__init__(f"lease {lease_id:x} has expired or was revoked")
        self.lease_id = lease_id


class CompactedError(StoreError):
    """A watch asked for history that the store no longer keeps; re-read and re-watch."""

    def __init__(self, requested: int, oldest: int) -> None:
        super().__init__(
            f"revision {requested} has been compacted (oldest kept: {oldest})"
        )
        self.requested = requested
        self.oldest = oldest


# --- rendezvous ----------------------------------------------------------------------


class RendezvousError(ElasticrunError):
    """The rendezvous could not give this node a place in the job."""


class RendezvousClosedError(RendezvousError):
    """The job has ended (successfully or not); no new round will open."""

    def __init__(self, run_id: str, outcome: str, detail: str = "") -> None:
        msg = f"rendezvous '{run_id}' is closed ({outcome})"
        super().__init__(f"{msg}: {detail}" if detail else msg)
        self.run_id = run_id
        self.outcome = outcome
        self.detail = detail


class JobEndedError(RendezvousClosedError):
    """The job had ended before this node started: the node ran nothing.

    A re-run with the id of an ended job (torchrun's habit, or no --rdzv-id at all:
    'none') finds the job's closed record, which stays for `closed_ttl`. The agent exits
    as the job ended all the same (0 if it succeeded): a scheduler that requeues a node
    of a finished job (Slurm's --requeue, a restarted pod) must not see a failure. What
    tells the user is the message, at warning level.
    """

    def __init__(self, run_id: str, outcome: str, detail: str, message: str) -> None:
        super().__init__(run_id, outcome, detail)
        self.args = (message,)


class RendezvousTimeoutError(RendezvousError):
    """No round this node could join formed within the join timeout."""

    exit_code = EXIT_INFRASTRUCTURE


class SpecMismatchError(RendezvousError):
    """This node's job spec differs from the one the running job was started with."""

    exit_code = EXIT_USAGE


# --- workers -------------------------------------------------------------------------


class StateTransferError(ElasticrunError):
    """In-process mode: a state's structure cannot be sent, or what a peer sent is not one.

    A value of a type the format does not carry cannot be sent; what came may be
    malformed, too big, or a pickle."""


class StateMemoryError(ElasticrunError):
    """Restart mode: a state's commit does not fit the host memory the agent gave it.

    Raised at the commit that does not fit (a state's first, unless it grew), so a
    script learns of the bound at once, not at its first failure."""


class WorkerStartError(ElasticrunError):
    """A worker process could not be started at all (missing script, bad interpreter)."""

    exit_code = EXIT_USAGE


# --- GPUs ----------------------------------------------------------------------------


class GpuUnhealthyError(ElasticrunError):
    """A GPU of this node failed its health check: the node does not join."""

    exit_code = EXIT_INFRASTRUCTURE


class HealthCheckError(ElasticrunError):
    """The operator's `--health-check` failed before this node joined: it does not join."""

    exit_code = EXIT_INFRASTRUCTURE
