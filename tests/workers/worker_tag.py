"""What the test workers print about themselves: their place in the job, in one tag
that the tests' regexes read (rank, world size, node rank, restart, round, pid)."""

import os


def identity() -> tuple[int, int, str]:
    """(rank, world size, tag) from the environment torchrun's variables set."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tag = (
        f"rank={rank} world={world} group_rank={os.environ['GROUP_RANK']} "
        f"restart={os.environ['TORCHELASTIC_RESTART_COUNT']} "
        f"round={os.environ.get('ELASTICRUN_ROUND', '?')} pid={os.getpid()}"
    )
    return rank, world, tag
