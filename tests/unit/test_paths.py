"""Every tensor-parallel rank must capture the same way (device steps are accounted later than host
steps): a rank that fell back to host copies is refused at start-up, naming the ranks."""

from types import SimpleNamespace

import pytest

from hscapture import CompatibilityError, PeerFailedError, _native
from hscapture.capture.ranksync import RankSync


class PeersTP:
    """Rank 0 of a group whose other ranks report `peers` (the all-gather of the path codes)."""

    def __init__(self, peers):
        self.size, self.rank, self.peers = 1 + len(peers), 0, peers

    def all_gather_i64(self, v):
        return [v, *self.peers]


class Rank:
    """A rank on `path` (with `overlap`) whose group is `tp`."""

    def __init__(self, tp, path, overlap=False):
        self.sync, self.path, self.overlap = RankSync(tp), path, overlap

    def _agree_on_path(self, failure=None):
        return self.sync.agree_on_path(self.path, self.overlap, failure)


def capture(tp, path, overlap=False):
    return Rank(tp, path, overlap)


def code(path, overlap=False):
    return _native.path_code(path, overlap)


def test_ranks_on_the_same_path_agree():
    """They meet (one all-gather of their path codes) and go on; overlap means nothing without the device path;
    one rank meets nobody."""
    for path, overlap, peer in [("device", True, code("device", 1)), ("none", True, code("none", False))]:
        tp = PeersTP([peer] * 3)
        gathered = []
        tp.all_gather_i64 = lambda v, tp=tp, gathered=gathered: gathered.append(v) or [v, *tp.peers]
        assert capture(tp, path, overlap)._agree_on_path() is None
        assert gathered == [peer], "this rank sent its own path's code, equal to its peers'"
    alone = SimpleNamespace(size=1, rank=0, all_gather_i64=lambda v: pytest.fail("one rank gathers nothing"))
    capture(alone, "host")._agree_on_path()
    assert len({code("device", 0), code("device", 1), code("host", 1), code("none", 0), code("failed", 0)}) == 5


@pytest.mark.parametrize(
    "peer,why",
    [
        (code("host"), r"rank 1: host"),
        (code("device", False), r"rank 1: device\)"),
        (code("device", 2), r"rank 1: device \(2 steps in flight\)"),
    ],
)
def test_a_rank_on_another_path_is_refused_by_name(peer, why):
    with pytest.raises(
        CompatibilityError, match=rf"rank 0: device \(1 steps in flight\); {why}.*HSCAPTURE_DEVICE_PATH=off"
    ):
        capture(PeersTP([peer]), "device", True)._agree_on_path()


def test_a_rank_whose_set_up_failed_still_meets_the_others():
    from hscapture import ConfigError

    tp = PeersTP([code("device", True)])
    gathered = []
    tp.all_gather_i64 = lambda v: gathered.append(v) or [v, code("device", True)]
    with pytest.raises(ConfigError, match="its own reason"):
        capture(tp, "failed")._agree_on_path(ConfigError("its own reason"))
    assert gathered == [code("failed")], "the failed rank took part in the gather"
    with pytest.raises(PeerFailedError, match=r"rank\(s\) \[1\] could not set up their capture path"):
        capture(PeersTP([code("failed")]), "device", True)._agree_on_path()
