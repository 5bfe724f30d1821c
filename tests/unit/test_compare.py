"""The comparison itself must be able to fail."""

import torch

from hscapture.testing.compare import compare


def test_identical_passes_and_shifts_fail():
    torch.manual_seed(0)
    ref = [torch.randn(7, 3, 16), torch.randn(4, 3, 16)]
    assert compare(ref, ref).worst == 0.0
    token_shift = [torch.roll(ref[0], 1, dims=0), ref[1]]
    layer_shift = [ref[0], torch.roll(ref[1], 1, dims=1)]
    assert compare(token_shift, ref).worst > 0.5
    c = compare(layer_shift, ref)
    assert c.worst > 0.5 and c.where[0] == 1
