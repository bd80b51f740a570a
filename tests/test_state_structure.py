"""In-process mode's state transfer carries plain data and tensors, never pickle: what
a peer sends cannot run code in a worker (`elasticrun.worker.elastic.structure`)."""

from __future__ import annotations

import math
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elasticrun.errors import StateTransferError
from elasticrun.worker.elastic.structure import MAX_BYTES, TensorHole, decode, encode
from tests.support.helpers import free_port
from tests.support.reliability_rows import Reliability

WORKERS = Path(__file__).parent / "workers"


def test_an_optimizers_structure_travels_exactly() -> None:
    # what Adam's state dict and plain values look like once their tensors are holes:
    # int keys, tuples, None, booleans, inf and nan, bytes, nested containers
    hole = TensorHole(3, (64, 8), torch.bfloat16, on_cpu=False)
    structure = {
        "optimizer": {
            "state": {0: {"step": TensorHole(0, (), torch.float32, True), "exp_avg": hole}},
            "param_groups": [{"params": [0, 1], "lr": 0.01, "betas": (0.9, 0.999), "foreach": None,
                              "amsgrad": False, "max_norm": math.inf}],
        },
        "step": 12, "tag": "rank1", "raw": b"\x00\xff", "empty": ((), [], {}),
    }
    back = decode(encode(structure))
    assert back == structure
    assert isinstance(back["optimizer"]["param_groups"][0]["betas"], tuple)
    assert math.isnan(decode(encode({"loss": math.nan}))["loss"])


def test_a_value_the_format_cannot_carry_is_named_when_sent() -> None:
    class Mine:
        pass

    with pytest.raises(StateTransferError, match=r"test_state_structure\..*Mine in the state cannot be sent"):
        encode({"step": 1, "thing": Mine()})


class _Payload:
    """What a pickle-speaking attacker sends: unpickling it creates a file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.path), "w"))


@pytest.mark.parametrize("data", [
    b"",
    b"not json",
    b'{"x": 1}',  # an untagged object
    b'{"h": [0, [2], "Tensor", true]}',  # a class of torch's, not a dtype
    b'{"h": [0, [-1], "float32", true]}',
    b'{"d": [[{"l": []}, 1]]}',  # an unhashable key
    b'{"b": "not base64!"}',
    b"[" * 100_000 + b"]" * 100_000,
])
def test_what_is_not_a_structure_is_refused(data: bytes) -> None:
    with pytest.raises(StateTransferError, match="not a state structure"):
        decode(data)


def test_a_pickle_is_refused_and_never_run(tmp_path: Path) -> None:
    pwned = tmp_path / "pwned"
    with pytest.raises(StateTransferError, match="never as pickle"):
        decode(pickle.dumps({"step": _Payload(pwned)}))
    assert not pwned.exists()
    with pytest.raises(StateTransferError, match="at most"):
        decode(b" " * (MAX_BYTES + 1))


@pytest.mark.security
@pytest.mark.timeout(90)  # two processes importing torch on two cores
def test_a_peer_sending_a_pickle_in_sync_is_refused(tmp_path: Path, reliability: Reliability) -> None:
    # the attacker speaks as dist.send_object_list does (a length, then pickle bytes)
    # where the structure of the newest commit belongs
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(WORKERS / "sync_attack.py"), role, port, str(tmp_path)])
             for role in ("victim", "attacker")]
    try:
        assert [p.wait(timeout=80) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert not (tmp_path / "pwned").exists(), "the victim ran the attacker's code"
    outcome = (tmp_path / "victim.txt").read_text()
    assert outcome.startswith("StateTransferError: a peer sent something that is not a state structure"), outcome
    reliability.record(
        part="security",
        scenario="a peer sends a pickle in a state transfer",
        injected="in-process mode's State.sync(): the rank with the newest commit sends, where the state's "
        "structure belongs, a pickle that creates a file when unpickled (what dist.send_object_list sends)",
        happened="the receiving rank raised StateTransferError ('not a state structure ... never as pickle'); "
        "the file was never created",
        lost="nothing (no code ran)",
    )
