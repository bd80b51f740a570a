"""The wrapper that keeps a training function running across membership changes.

    @elastic.run
    def train(state):
        ...  # build the data loader for dist.get_world_size(), resume from state.step
        while state.step < steps:
            ...
            state.step += 1
            state.commit()

    train(State(model=model, optimizer=optimizer, step=0))

Under `elasticrun --elastic-mode=in-process` each pass of the loop below is one round:
wait for the agent's assignment, make the round's process group, sync the state, call
the function. When `commit()` notices a change, or a collective fails (a peer died; the
agent interrupts collectives that would hang), the group is destroyed, the state rolled
back to the last commit where needed, and the function called again in the next round
with the new rank and world size: the process, its CUDA context, its imports and its
data stay. Anywhere else (torchrun, restart mode) the function runs once in a group made
from the environment, so one script serves both modes; in restart mode it first restores
the last commit the agent kept in host memory for this worker (host_copy.py), so a
worker restarted after a failure resumes where it was, with no file read.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from elasticrun.errors import EXIT_USAGE, StateMemoryError
from elasticrun.worker.elastic.host_copy import HostCopy
from elasticrun.worker.elastic.link import AgentLink
from elasticrun.worker.elastic.session import CollectiveAbandonedError, GroupSession, flag_device
from elasticrun.worker.elastic.state import MembershipChanged, State
from elasticrun.worker.steptime import new_round as count_steps_afresh

R = TypeVar("R")

#: the line to the agent in in-process mode, opened when the script imports this API:
#: the agent then knows at once that the script can be re-formed in place
LINK = AgentLink.from_env()

#: how long joining a group may wait for its peers, and the groups' collective timeout;
#: peers that die are noticed by the agent long before (it interrupts the collective)
DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)


def run(
    fn: Callable[..., R] | None = None,
    *,
    backend: str | None = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> Any:
    """Decorate a training function `fn(state, *args, **kwargs)`; see the module doc.

    `backend` is passed to `init_process_group` (None: torch's default, gloo for CPU
    tensors and nccl for CUDA ones). Usable bare (`@run`) or with arguments.
    """
    if fn is None:
        return functools.partial(run, backend=backend, timeout=timeout)

    @functools.wraps(fn)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> R:
        call = functools.partial(fn, state, *args, **kwargs)
        if LINK is None:
            return _run_once(call, state, backend, timeout)
        return _run_elastic(LINK, call, state, backend, timeout)

    return wrapper


def _run_once(
    call: Callable[[], R], state: State, backend: str | None, timeout: datetime.timedelta
) -> R:
    made = not dist.is_initialized()
    if made:
        dist.init_process_group(backend, timeout=timeout)
    host: HostCopy | None = None
    try:
        host = HostCopy.from_env()
        # the round the commits are made in (elasticrun's agent names it; 0 under torchrun): a
        # commit's lineage, and how a re-shard tells the newest of two commits (ShardedState.earlier)
        state._attach(None, int(os.environ.get("ELASTICRUN_ROUND") or 0))
        state._keep_in(host)
        state.sync()
        return call()
    except StateMemoryError as e:
        _stop(e)
    finally:
        if host is not None:
            host.settle()  # a commit's GPU copies in flight end whole
        if made:
            dist.destroy_process_group()


def _run_elastic(
    link: AgentLink,
    call: Callable[[], R],
    state: State,
    backend: str | None,
    timeout: datetime.timedelta,
) -> R:
    after = 0
    kept: object = None  # a superseded round's store that this rank served (GroupSession.leave)
    while True:
        assignment = link.next_assignment(after)
        after = assignment.round
        session = GroupSession(assignment, backend, timeout)
        link.on_change(session.round_over)
        if link.superseded(assignment.round):  # said before the callback was in place: join() refuses
            session.round_over(assignment.round, link.peer_lost(assignment.round))
        try:
            session.join()
            kept = None  # the group formed: no peer dials the superseded round's store any more
            state._attach(functools.partial(_check_membership, link, assignment.round), assignment.round)
            state.sync()
            count_steps_afresh()  # the step timing reports this round's steps
            return call()
        except MembershipChanged:
            pass  # noticed by commit(): the state is that commit
        except Exception as e:
            state.restore()
            if not link.superseded(assignment.round):
                # No change announced: a failure the agent must judge (a peer's death or
                # re-formation it has not heard of yet, or a bug here); it answers with a
                # new round or a stop. Nothing printed here: the agent says what it was,
                # with the traceback only if it was a failure.
                link.report_broken(assignment.round, traceback.format_exc(), by_peer=broken_by_peer(e))
        finally:
            state._attach(None)
            link.on_change(None)
            kept = session.leave() or kept


def _stop(error: StateMemoryError) -> NoReturn:
    """End the worker on a state that does not fit: one line, no traceback (exit 2, as for bad flags).

    The line also goes to torch's error file, which the agent's failure report reads."""
    line = f"elasticrun: {error}"
    print(line, file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with open(error_file, "w") as out:
            json.dump({"message": line}, out)
    raise SystemExit(EXIT_USAGE) from None


#: what gloo and nccl say when a peer closed its end of the group
_PEER_WORDS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "communicator was aborted")


def broken_by_peer(error: BaseException) -> bool:
    """Whether `error` came out of a collective (which a peer leaving the group breaks).

    By its type, a frame of torch.distributed or DDP on its way, or gloo's and nccl's
    words for a closed peer (DDP's reducer raises them from inside `backward()`). A
    user's error taken for one only waits the agent's settle time before it counts."""
    if isinstance(error, (dist.DistError, CollectiveAbandonedError)) or any(word in str(error) for word in _PEER_WORDS):
        return True
    frames = traceback.extract_tb(error.__traceback__)
    return any(f"{os.sep}torch{os.sep}distributed{os.sep}" in frame.filename for frame in frames)


def _check_membership(link: AgentLink, round_number: int) -> None:
    """Leave at this commit if any rank heard that the round is over."""
    flag = torch.tensor([int(link.superseded(round_number))], device=flag_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        raise MembershipChanged(f"round {round_number} is over")
