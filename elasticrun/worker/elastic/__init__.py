"""In-process elasticity: surviving workers keep running across membership changes.

    from elasticrun.worker import elastic

    state = elastic.State(model=model, optimizer=optimizer, step=0)

    @elastic.run
    def train(state): ...

    train(state)

Launch with `elasticrun --elastic-mode=in-process ...`; see docs/in-process.md.
"""

from elasticrun.worker.elastic.run import run
from elasticrun.worker.elastic.state import MembershipChanged, State

__all__ = ["MembershipChanged", "State", "run"]
