"""`python -m elasticrun` and the `elasticrun` command: the torchrun-compatible launcher.

Its first instruction closes the process to its user's other processes
(`forbid_dumps`): `$ELASTICRUN_STORE_TOKEN` sits in /proc/<pid>/environ from the `exec`,
and any process of the user could read it there until then. The window that is left,
the interpreter's own start, is measured in docs/backends.md ("Who may do what").
"""

from elasticrun.agent.undumpable import forbid_dumps

forbid_dumps()

from elasticrun.launcher.cli import console_main  # noqa: E402 - after forbid_dumps, on purpose


def main() -> None:
    """Entry point of the `elasticrun` script."""
    console_main()


if __name__ == "__main__":
    console_main()
