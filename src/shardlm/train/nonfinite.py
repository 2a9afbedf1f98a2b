"""A non-finite step, caught on the device: the optimizer skips it and every later update, the next host read
raises.

Reading the loss to the host every step would stall the device queue, so the check stays on the device: the
first step whose loss or gradient norm is not finite is recorded in a 3-value tensor that travels in the
step's one host read (:meth:`NonFiniteGuard.raise_if_recorded`).
"""

from __future__ import annotations

import torch

from shardlm.errors import NonFiniteError


class NonFiniteGuard:
    """The first non-finite step of a run, kept on ``device``.

    Attributes:
        record: (3,) float64 on the device: (1-based step or 0 when none, loss, gradient norm) of the first
            step whose loss or gradient norm was not finite.
    """

    def __init__(self, device: torch.device) -> None:
        self.record = torch.zeros(3, dtype=torch.float64, device=device)

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor,
              optimizer: torch.optim.Optimizer) -> None:
        """On the device: remember step ``step`` (1-based) when ``loss`` (0-dim) or ``grad_norm`` (0-dim)
        is not finite and no earlier step was, and from then on make ``optimizer`` skip its updates (fused
        AdamW's ``found_inf``; its step counts do not advance). A non-fused optimizer has no ``found_inf``:
        its step is applied and reported at the next read."""
        grad_norm = grad_norm.to(loss.device)
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        first = bad & (self.record[0] == 0)
        now = torch.stack([torch.full_like(loss, step), loss, grad_norm]).to(self.record.dtype)
        self.record = torch.where(first, now, self.record)
        if optimizer.defaults.get("fused"):
            optimizer.found_inf = (self.record[0] > 0).float()

    @staticmethod
    def raise_if_recorded(values: list[float]) -> None:
        """Raise :class:`NonFiniteError` when ``values`` (the host copy of :attr:`record`) names a step.

        Raises:
            NonFiniteError: naming the step, its loss and gradient norm, and what to change.
        """
        step, loss, grad_norm = values
        if step > 0:
            raise NonFiniteError(
                f"step {int(step)}: loss={loss} grad_norm={grad_norm} is not finite; stopping with the "
                "weights from before that step (its update and any after it were skipped; lower train.lr, "
                "check the data, or use fp32)")
