"""An RLHF loop that lends the accelerator back while it generates (OpenRLHF's and verl's DeepSpeed backends): the
actor and critic engines train on the device, and around each generation phase their states go to host memory
(``offload_states``, with DeepSpeed's state types) and come back (``reload_states``); the training goes on as if
they had never moved."""
import argparse

import deepspeed
import torch
from common import Net, data, report
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
args = parser.parse_args()
torch.manual_seed(0)
actor = Net()
critic = Net()
actor_engine, *_ = deepspeed.initialize(args=args, model=actor, model_parameters=actor.parameters())
critic_engine, *_ = deepspeed.initialize(args=args, model=critic, model_parameters=critic.parameters())
batches = data(24).view(6, 4, 9)
observed = {"actor_loss": [], "critic_loss": [], "generated": []}
for tokens in batches:
    # generation: the engines' states leave the device (the critic's parameters stay, as a script keeps them
    # where it reads values during generation), then the actor's weights are read back for it
    actor_engine.offload_states(device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=False)
    critic_engine.offload_states(include=[OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params],
                                 device=OffloadDeviceEnum.cpu)
    actor_engine.reload_states()
    with torch.no_grad():
        observed["generated"].append(actor_engine(tokens).item())
    critic_engine.reload_states()
    actor_loss = actor_engine(tokens)
    actor_engine.backward(actor_loss)
    actor_engine.step()
    critic_loss = critic_engine(tokens)
    critic_engine.backward(critic_loss)
    critic_engine.step()
    observed["actor_loss"].append(actor_loss.item())
    observed["critic_loss"].append(critic_loss.item())
report(**observed)
