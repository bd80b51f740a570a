"""In-process elasticity: surviving workers keep running across membership changes.

    from elasticrun.worker import elastic

    state = elastic.State(model=model, optimizer=optimizer, step=0)

    @elastic.run
    def train(state): ...

    train(state)

With `elasticrun --elastic-mode=in-process ...` survivors keep running; in restart mode
(the default) a restarted worker resumes from its last commit, kept in host memory by
the agent. See docs/in-process.md.
"""

from elasticrun.worker.elastic.run import run
from elasticrun.worker.elastic.state import EarlierShards, MembershipChanged, ShardedState, State

__all__ = ["EarlierShards", "MembershipChanged", "ShardedState", "State", "run"]
