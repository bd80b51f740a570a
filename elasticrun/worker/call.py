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

import json
import os
import pickle
import runpy
import sys
import time
import traceback
import types
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

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


#: frames that are ours, not the user's: this module's and runpy's (a script's functions)
_OUR_FILES = frozenset({__file__, runpy.__file__, "<frozen runpy>"})


def _fail(error: Exception) -> NoReturn:
    """Report `error` as the user's own.

    The traceback without this module's frames and runpy's (which only say how the
    worker was started), on stderr and in torch's error file format
    (TORCHELASTIC_ERROR_FILE), which the failure report reads; exit 1."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in _OUR_FILES:
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(error), error, tb))
    print(text, end="", file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        message = "".join(traceback.format_exception_only(type(error), error)).strip()
        extra = {"py_callstack": text, "timestamp": str(int(time.time()))}
        with open(error_file, "w") as out:
            json.dump({"message": {"message": message, "extraInfo": extra}}, out)
    sys.exit(1)



def main() -> None:
    with open(os.environ[PAYLOAD_ENV], "rb") as f:
        main_path = pickle.load(f)
        try:
            if main_path is not None:
                _load_main(main_path)
        except Exception as e:
            _fail(e)
        function, args = pickle.load(f)
    try:
        value = function(*args)
    except Exception as e:  # SystemExit and KeyboardInterrupt end the worker as they would anyway
        _fail(e)
    results = Path(os.environ[RESULTS_ENV])
    path = results / result_name(os.environ)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as out:
        pickle.dump(value, out)
    tmp.rename(path)


if __name__ == "__main__":
    main()
