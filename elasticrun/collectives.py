"""torch.distributed's calls that block on peers, and elasticrun's wrappers around them.

The worker's step timing wraps the calls (a rank inside one waits for its peers, so that
time is no compute: elasticrun.worker.steptime); the stacks' summary tells ranks that
wait in *different* ones, which can never meet (elasticrun.rendezvous.stack_summary);
the wrappers' own frames are left out of every stack and traceback shown. Plain names,
no torch: the worker, the agent and the rendezvous read it.
"""

from __future__ import annotations

#: the calls that block on peers (or queue a collective whose Work.wait() then does)
COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_coalesced", "all_gather_into_tensor",
    "all_gather_object", "reduce", "reduce_scatter", "reduce_scatter_tensor", "broadcast", "broadcast_object_list",
    "barrier", "monitored_barrier", "all_to_all", "all_to_all_single", "gather", "gather_object", "scatter",
    "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list",
    "recv_object_list",
    # DDP's broadcast of a model's buffers (BatchNorm's running statistics) from rank 0 at
    # the start of every forward, and of its parameters at its construction: a C++ call
    # that DDP makes through torch.distributed's namespace, where the other ranks wait
    # for rank 0
    "_broadcast_coalesced",
)

#: elasticrun's own frames between a script and torch: the step timing's wrappers
#: (elasticrun.worker.steptime, elasticrun.worker.ddp_waits). No stack or traceback
#: shows them: they are ours, not the user's, and say nothing about where a rank is.
_WRAPPERS = (
    ("elasticrun/worker/steptime.py", ("timed",)),
    ("elasticrun/worker/ddp_waits.py", ("timed", "_finished")),
)


def is_wrapper_frame(file: str, function: str) -> bool:
    """Whether a frame is one of elasticrun's wrappers around a collective (`timed`)."""
    file = file.replace("\\", "/")
    return any(file.endswith(suffix) and function in names for suffix, names in _WRAPPERS)
