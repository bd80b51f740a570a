"""One function-entrypoint launch, timed inside the process (bench/bench_api.py).

argv: elasticrun|torch <nproc> <port>. Prints `seconds <launch call's wall time>` and the
per-rank return values; imports are outside the timed part, as a program that embeds the
launcher already has them loaded.
"""

from __future__ import annotations

import os
import sys
import time
import uuid


def rank_value() -> int:
    return int(os.environ["RANK"]) * 10


def main() -> None:
    which, nproc, port = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if which == "elasticrun":
        import elasticrun

        start = time.perf_counter()
        values = elasticrun.launch(rank_value, standalone=True, nproc_per_node=nproc)
    else:
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, rdzv_backend="c10d",
                              rdzv_endpoint=f"127.0.0.1:{port}", run_id=uuid.uuid4().hex, start_method="spawn")
        start = time.perf_counter()
        values = elastic_launch(config, rank_value)()
    print(f"seconds {time.perf_counter() - start:.4f}")
    print(f"values {sorted(values.items())}")


if __name__ == "__main__":
    main()
