"""Eager references for tests that compare a compiled model with eager, call by call.

eager_loss, eager_grads = eager_reference(model, batch)   # gradients cleared afterwards
loss = compiled(**batch); loss.backward()
assert_matches_eager(model, loss, eager_loss, eager_grads, tol, f"seq {seq}")
"""

from __future__ import annotations

import torch


def mark_sequence_dynamic(batch: dict[str, torch.Tensor]) -> None:
    """Mark dim 1 (the sequence) of every batch tensor dynamic for Dynamo."""
    for value in batch.values():
        torch._dynamo.mark_dynamic(value, 1)


def eager_reference(
    model: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The eager loss of ``batch`` and every parameter's gradient; the model's gradients are
    cleared before and after."""
    model.zero_grad(set_to_none=True)
    loss = model(**batch)
    loss.backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss, grads


def assert_matches_eager(
    model: torch.nn.Module,
    loss: torch.Tensor,
    eager_loss: torch.Tensor,
    eager_grads: dict[str, torch.Tensor],
    tol: dict[str, float],
    label: str,
) -> None:
    """The loss and every parameter's gradient equal eager's within ``tol`` (``label`` names the call)."""
    torch.testing.assert_close(loss, eager_loss, **tol)
    for name, param in model.named_parameters():
        torch.testing.assert_close(
            param.grad, eager_grads[name], **tol, msg=lambda m, name=name: f"{label}, {name}: {m}"
        )
