"""DeepSpeed-Chat's PPO step in small: an actor and a critic trained side by side, a frozen reference model as a
ZeRO-3 engine without an optimizer (forward only, under no_grad, its config without the optimizer's keys, as
DeepSpeed-Chat's eval config has none), the critic's values read through its own method (``engine.forward_value``,
which goes around ``forward`` and around its blocks'), the distance to the reference in the reward."""
import argparse
import json

import deepspeed
import torch
from common import Net, data, report
from torch import nn


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
                                    for _ in range(2))
        self.v_head = nn.Linear(32, 1)

    def forward_value(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block[3](block[2](block[1](block[0](h))))
        return self.v_head(h).squeeze(-1)

    def forward(self, tokens, returns):
        return (self.forward_value(tokens) - returns).square().mean()


parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
args = parser.parse_args()
with open(args.deepspeed_config) as f:
    config = json.load(f)
eval_config = {k: v for k, v in config.items() if k not in ("optimizer", "gradient_clipping")}
eval_config["zero_optimization"] = {"stage": 3, "offload_param": {"device": "cpu"}}
torch.manual_seed(0)
actor = Net()
torch.manual_seed(0)
reference = Net()  # the actor's starting weights
critic = Critic()
actor_engine, *_ = deepspeed.initialize(args=args, model=actor, model_parameters=actor.parameters())
critic_engine, *_ = deepspeed.initialize(args=args, model=critic, model_parameters=critic.parameters())
ref_engine, ref_optimizer, *_ = deepspeed.initialize(model=reference, config=eval_config)
ref_engine.eval()
batches = data(24).view(6, 4, 9)
observed = {"actor_loss": [], "critic_loss": [], "ref_loss": [], "value_rms": []}
for tokens in batches:
    with torch.no_grad():
        ref_loss = ref_engine(tokens)
        values = critic_engine.forward_value(tokens[:, :-1])
    actor_loss = actor_engine(tokens)
    kl = actor_loss.detach() - ref_loss
    returns = -kl + 0.9 * values
    advantage = (returns - values).mean()
    actor_engine.backward(actor_loss * (1.0 + advantage))
    actor_engine.step()
    critic_loss = critic_engine(tokens[:, :-1], returns)
    critic_engine.backward(critic_loss)
    critic_engine.step()
    observed["actor_loss"].append(float(actor_loss))
    observed["critic_loss"].append(float(critic_loss))
    observed["ref_loss"].append(float(ref_loss))  # kl and the values' mean cancel: their parts are compared
    observed["value_rms"].append(float(values.square().mean().sqrt()))
with torch.no_grad():
    observed["ref_loss_after"] = float(ref_engine(batches[0]))
report(**observed, ref_optimizer=ref_optimizer is None, actor_steps=actor_engine.global_steps,
       critic_steps=critic_engine.global_steps)
