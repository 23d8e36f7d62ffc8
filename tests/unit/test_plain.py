"""Values between ranks as JSON and raw tensor bytes ([Note: nothing unpickled] in comm/plain.py)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from dataparallel.comm.plain import PlainError, decode, encode, from_bytes, to_bytes


class WritesFile:
    """A pickle that runs code when unpickled: it writes `path`."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('ran')",))


def crafted(path) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(WritesFile(path))), dtype=torch.uint8)


def test_values_come_back_equal_with_their_types():
    value = {
        "model": {"w": torch.randn(3, 4), "b": torch.zeros(0, dtype=torch.bfloat16)},
        "state": {0: {"step": torch.tensor(3.0), "flags": torch.tensor([True, False])}},
        "groups": [{"betas": (0.9, 0.95), "lr": 1e-3, "foreach": None, "name": "x"}],
        "dtype": torch.float16,
        "nan": float("nan"),
        (1, "a"): [1, 2],
        "numpy": np.random.RandomState(3).get_state(),  # PowerSGD's generator
    }
    back = from_bytes(to_bytes(value))
    assert torch.equal(back["model"]["w"], value["model"]["w"])
    assert back["model"]["b"].dtype == torch.bfloat16 and back["model"]["b"].shape == (0,)
    assert back["state"][0]["step"].item() == 3.0 and back["state"][0]["flags"].tolist() == [
        True,
        False,
    ]
    assert back["groups"] == value["groups"] and isinstance(back["groups"][0]["betas"], tuple)
    assert back["dtype"] is torch.float16 and back["nan"] != back["nan"]
    assert back[(1, "a")] == [1, 2]
    restored = np.random.RandomState()
    restored.set_state(back["numpy"])
    assert restored.rand() == np.random.RandomState(3).rand()
    assert back["numpy"][1].dtype == np.uint32 and back["numpy"][1].shape == (624,)


def test_an_object_that_is_not_plain_is_refused_with_its_path():
    with pytest.raises(PlainError, match=r"\.a\[1\]: a WritesFile cannot travel"):
        encode({"a": [1, WritesFile("x")]})


@pytest.mark.parametrize(
    "header",
    [{"dict": [1]}, {"tensor": 5}, {"dtype": "Popen"}, {"object": "os.system"}, {"a": 1, "b": 2}],
)
def test_a_header_outside_the_format_is_refused(header):
    with pytest.raises(PlainError, match="not a plain value's header"):
        decode(header, [])


def test_a_crafted_pickle_is_never_unpickled(tmp_path):
    target = tmp_path / "ran"
    pickle.loads(crafted(target).numpy().tobytes())  # the payload is live: unpickled, it runs
    assert target.read_text() == "ran"
    target.unlink()
    for buffer in (
        crafted(target),
        torch.cat([torch.tensor([3, 0, 0, 0, 0, 0, 0, 0], dtype=torch.uint8), crafted(target)]),
    ):
        with pytest.raises(PlainError):
            from_bytes(buffer)
    assert not target.exists()
