"""The backward hooks' two paths: a module with one output tensor (a plain tensor hook) and one with several (a
multi-grad hook that fires once, on the first gradient), and a unit's flat gradient made from whole or partial
``.grad`` sets. Each trains beside plain PyTorch on CPU and must match it element for element (within fp32 rounding)."""

import pytest
import torch
from engine_cases import base_config
from torch import nn

import offload


class TwoOutputs(nn.Module):
    """Returns two tensors whose gradients reach it at different points of backward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


class Net(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.pre = nn.Linear(width, width)  # so that the split's backward needs its weights (for its input's grad)
        self.split = TwoOutputs(width)
        self.long = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
        self.sometimes = nn.Linear(width, width)  # used on odd steps only: its unit gets no gradient on even ones
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, odd: bool) -> torch.Tensor:
        a, b = self.split(self.pre(x))
        y = self.long(a) + b  # b's gradient arrives before a's, which goes through the long branch first
        if odd:
            y = self.sometimes(y)
        return self.head(torch.tanh(y)).square().mean()


def _train(engine_or_model, opt, steps: int) -> list[float]:
    gen = torch.Generator().manual_seed(3)
    losses = []
    for step in range(steps):
        x = torch.randn(5, 32, generator=gen)
        loss = engine_or_model(x, step % 2 == 1)
        losses.append(loss.item())
        if opt is None:
            engine_or_model.backward(loss)
            engine_or_model.step()
        else:
            loss.backward()
            for p in engine_or_model.parameters():  # as DeepSpeed (ignore_unused_parameters): a zero gradient
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            opt.step()
            opt.zero_grad()
    return losses


@pytest.mark.parametrize("discrete", [False, True], ids=["in-place", "gathered"])
def test_a_module_with_two_outputs_and_a_unit_without_gradients_train_as_plain_pytorch(monkeypatch, discrete):
    if discrete:  # units are released after forward and gathered again by the pre-backward hooks
        monkeypatch.setenv("OFFLOAD_EMULATED_DISCRETE_DEVICE", "1")
    torch.manual_seed(0)
    model = Net()
    ref = Net()
    ref.load_state_dict(model.state_dict())
    # Units: pre, split (two outputs), long, sometimes..head (on even steps half of it gets no gradient: the flat
    # gradient's fall-back path).
    config = base_config(5, 1, 1, clip=0.0, unit_bytes=8448)
    config["optimizer"]["params"]["weight_decay"] = 0.0
    config["zero_optimization"]["stage3_prefetch_bucket_size"] = 0  # only the hooks gather: none runs ahead
    engine, *_ = offload.initialize(model=model, config=config, device="cpu", dist_init_required=False)
    try:
        assert [u.plan.anchors for u in engine.units] == [["pre"], ["split"], ["long"], ["sometimes", "head"]]
        losses = _train(engine, None, 6)
        state = engine.full_state_dict()
    finally:
        engine.close()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    ref_losses = _train(ref, ref_opt, 6)
    # The native Adam rounds differently from torch's, so the comparison has fp32 tolerances (as the parity tests').
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(state[key], value)
