"""A function entrypoint of `elasticrun.launch`, run in one worker.

The launching process pickles `(function, args)` to a file (ELASTICRUN_CALL_PAYLOAD)
that only its user can read; each worker, a fresh interpreter started by that process's
own agent, unpickles it, calls the function and pickles the return value to
ELASTICRUN_CALL_RESULTS/<round>_<restart>_<rank>.pkl for the launcher to collect. Pickle
is sound here only because both ends are one user's processes on one host, started by
one another (as torchrun's multiprocessing workers are); nothing crosses the network.

A function of the launching script's `__main__` is found as multiprocessing's spawn
finds it: the script is run first as `__mp_main__` (its `if __name__ == "__main__":`
part does not run again) and stands in for `__main__` while unpickling.
"""

from __future__ import annotations

import os
import pickle
import runpy
import sys
import types
from collections.abc import Mapping
from pathlib import Path

PAYLOAD_ENV = "ELASTICRUN_CALL_PAYLOAD"
RESULTS_ENV = "ELASTICRUN_CALL_RESULTS"


def result_name(environ: Mapping[str, str]) -> str:
    """This attempt's result file: the latest round and restart win when collected."""
    return f"{environ['ELASTICRUN_ROUND']}_{environ['TORCHELASTIC_RESTART_COUNT']}_{environ['RANK']}.pkl"


def _load_main(path: str) -> None:
    main = types.ModuleType("__mp_main__")
    main.__file__ = path
    sys.modules["__mp_main__"] = sys.modules["__main__"] = main
    main.__dict__.update(runpy.run_path(path, run_name="__mp_main__"))


def main() -> None:
    with open(os.environ[PAYLOAD_ENV], "rb") as f:
        main_path = pickle.load(f)
        if main_path is not None:
            _load_main(main_path)
        function, args = pickle.load(f)
    value = function(*args)
    results = Path(os.environ[RESULTS_ENV])
    path = results / result_name(os.environ)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as out:
        pickle.dump(value, out)
    tmp.rename(path)


if __name__ == "__main__":
    main()
