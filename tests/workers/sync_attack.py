"""A rank that attacks State.sync() with a pickle, and the rank it attacks.

argv: role(victim|attacker) port out_dir. The attacker joins the group as a rank with
the newest commit (so the victim receives from it) and sends, where the structure of the
state belongs, a pickle that creates out_dir/pwned when it is unpickled: what
`dist.send_object_list` sends, so a victim that unpickles would run it. The victim writes
what sync() raised to out_dir/victim.txt.
"""

import pathlib
import sys

import torch
import torch.distributed as dist

from elasticrun.worker.elastic import State

role, port, out = sys.argv[1], int(sys.argv[2]), pathlib.Path(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=int(role == "attacker"), world_size=2)


class Payload:
    def __reduce__(self):
        return (open, (str(out / "pwned"), "w"))


if role == "attacker":
    gathered = [torch.zeros(3, dtype=torch.int64) for _ in range(2)]
    # "I hold the newest commit": 99 commits, the last in round 1, synced before
    dist.all_gather(gathered, torch.tensor([99, 1, 1], dtype=torch.int64))
    dist.send_object_list([Payload()], dst=0)
else:
    state = State(model=torch.nn.Linear(2, 2), step=0)
    try:
        state.sync()
        outcome = "synced"
    except Exception as e:  # noqa: BLE001 - the test reads what it was
        outcome = f"{type(e).__name__}: {e}"
    (out / "victim.txt").write_text(outcome)
dist.destroy_process_group()
