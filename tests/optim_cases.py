"""What the ChunkedAdam(W) test files share (test_optim_8bit.py too): a small
net, with a spare head used on some steps, a training loop, and the
comparison of two models' parameters."""

from __future__ import annotations

import torch

from .accuracy import tolerance


class Net(torch.nn.Module):
    def __init__(self, spare=True):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.Tanh(), torch.nn.Linear(33, 19),
                                        torch.nn.Tanh())
        self.head = torch.nn.Linear(19, 5)
        if spare:  # (made last: body and head start the same either way)
            self.spare = torch.nn.Linear(19, 5)  # used only on some steps

    def forward(self, x, use_spare=False):
        h = self.body(x)
        out = self.head(h)
        return out + self.spare(h) if use_spare else out


def make_net(dtype=torch.float32, spare=True):
    torch.manual_seed(0)
    return Net(spare).to(dtype)


def train_steps(model, optimizer, steps, *, sign=1.0, scheduler=None, clip=None, spare_every=0, set_to_none=True,
           seed=1):
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        param = next(model.parameters())  # (the data follows the model's device and dtype)
        x = torch.randn(16, 7, generator=generator).to(param.device, param.dtype)
        y = torch.randn(16, 5, generator=generator).to(param.device, param.dtype)
        optimizer.zero_grad(set_to_none=set_to_none)
        use_spare = spare_every > 0 and step % spare_every == 0
        loss = sign * torch.nn.functional.mse_loss(model(x, use_spare), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def trajectory_tolerance(backend):
    """fp32 trajectories track torch to rounding; under the Triton kernel
    to its bias corrections' float32 rounding (accuracy.py)."""
    return tolerance(torch.float32, "adam_trajectory_triton" if backend == "triton" else "default")


def assert_same_params(a, b, **tol):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.detach().double(), q.detach().double(), msg=lambda m: f"{name}: {m}", **tol)
