"""Token-by-token comparison of captured states with a reference."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Comparison:
    worst: float  # worst relative error over every (sample, token, layer)
    where: tuple[int, int, int]  # (sample, token, layer slot) of the worst
    tokens: int

    def ok(self, tol: float) -> bool:
        return self.worst <= tol


def relative_errors(ours, ref):
    """Per (token, layer): ||ours - ref|| / ||ref|| (both [L, n, H])."""
    import torch

    a, b = ours.float(), ref.float()
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: captured {tuple(a.shape)}, reference {tuple(b.shape)}")
    return torch.linalg.vector_norm(a - b, dim=-1) / torch.linalg.vector_norm(b, dim=-1).clamp_min(1e-12)


def compare(samples: list, refs: list) -> Comparison:
    worst, where, tokens = 0.0, (-1, -1, -1), 0
    for i, (ours, ref) in enumerate(zip(samples, refs, strict=True)):
        err = relative_errors(ours, ref)
        tokens += err.shape[0]
        m = float(err.max())
        if m > worst or where[0] < 0:
            flat = int(err.argmax())
            worst, where = m, (i, flat // err.shape[1], flat % err.shape[1])
    return Comparison(worst, where, tokens)
