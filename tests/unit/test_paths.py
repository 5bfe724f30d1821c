"""Every tensor-parallel rank must capture the same way (device steps are accounted later than host
steps): a rank that fell back to host copies is refused at start-up, naming the ranks."""

from types import SimpleNamespace

import pytest

from hscapture import CompatibilityError, PeerFailedError
from hscapture.capture.ranksync import RankSync, path_code


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
        self.sync.agree_on_path(self.path, self.overlap, failure)


def capture(tp, path, overlap=False):
    return Rank(tp, path, overlap)


def code(path, overlap=False):
    return path_code(path, overlap)


def test_ranks_on_the_same_path_agree():
    capture(PeersTP([code("device", True)] * 3), "device", True)._agree_on_path()
    capture(PeersTP([code("none")]), "none", True)._agree_on_path()  # overlap means nothing without the device path
    capture(SimpleNamespace(size=1, rank=0), "host")._agree_on_path()


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
