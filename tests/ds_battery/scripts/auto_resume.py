"""The auto-resume idiom: load from the save directory whatever is there (nothing on the first run), train, save
with a client state; a second engine resumes from it."""
import argparse
import os

import deepspeed
import torch
from common import Net, data, report, train

parser = argparse.ArgumentParser()
parser.add_argument("--save_dir", required=True)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
deepspeed.init_distributed()


def run(steps, start):
    torch.manual_seed(0)
    model = Net()
    engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    path, client = engine.load_checkpoint(args.save_dir)
    first = client["step"] if client else 0
    losses = train(engine, data(32).split(4)[first:first + steps])
    engine.save_checkpoint(args.save_dir, client_state={"step": first + steps, "note": "mine"})
    return path is None, client.get("note") if client else None, first, losses, engine.global_steps


first = run(3, 0)
second = run(2, 3)
report(fresh=first[0], resumed_fresh=second[0], note=second[1], start=second[2], losses=first[3] + second[3],
       steps=second[4], latest=open(os.path.join(args.save_dir, "latest")).read().strip())
