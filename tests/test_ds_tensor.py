"""A ZeRO-3 parameter's ``ds_tensor`` (DeepSpeed's name for this rank's partition of it): the rank's piece of the
parameter wherever its shard lives, read when used ([Note: the partition as a view] in offload/zero/partition_view.py).
"""

import copy

import pytest
import torch
from engine_cases import base_config, batches, loss_of, make_any

import offload
from offload.machine.launch import run_ranks


def pieces(rank, world, params, path):
    """Each parameter's ds_tensor after two steps (its count, its values, its device) and the whole parameter."""
    config = base_config(2, 1, world, offload_param={"device": params, "nvme_path": path, "max_in_cpu": 0}
                         if params == "nvme" else {"device": params})
    engine, *_ = offload.initialize(model=make_any("gpt"), config=config)
    for tokens in batches(2, 2 * world):
        engine.backward(loss_of(engine, "gpt", tokens[rank * 2:(rank + 1) * 2]))
        engine.step()
    out = {"pieces": {}, "whole": engine.full_state_dict()}
    for name, p in engine.module.named_parameters():
        d = p.ds_tensor
        out["pieces"][name] = (d.numel(), d.ds_numel, d.clone(), str(d.device), tuple(d.shape), p.ds_numel)
    first = next(p for p in engine.module.parameters() if p.ds_tensor.numel() > 2)
    before = first.ds_tensor.clone()
    with pytest.raises(RuntimeError, match="ds_tensor is this rank's partition.*would write into it"):
        first.ds_tensor.add_(1.0)
    first.ds_tensor.detach().add_(100.0)  # each works on a copy: never the shard the optimizer owns
    first.ds_tensor.data.mul_(0)
    first.ds_tensor[0:2].zero_()
    assert torch.equal(first.ds_tensor.clone(), before)
    buf = torch.empty(before.shape, dtype=before.dtype)
    buf.copy_(first.ds_tensor)  # an op that only reads it runs
    assert torch.equal(buf, before) and first.ds_tensor.tolist() == before.tolist()
    assert torch.equal(copy.deepcopy(first.ds_tensor), before)
    out["sum"], out["first"] = float(first.ds_tensor.float().sum()), first.ds_tensor.clone()
    engine.close()
    with pytest.raises(RuntimeError, match="ds_tensor belongs to an engine that has been closed"):
        first.ds_tensor.sum()
    return out


@pytest.mark.parametrize("params", ["cpu", "nvme"])
def test_each_ranks_ds_tensor_is_its_piece_and_the_pieces_make_the_parameter(tmp_path, params):
    ranks = run_ranks(pieces, 2, params=params, path=str(tmp_path))
    whole = ranks[0]["whole"]
    assert ranks[0]["pieces"].keys() == ranks[1]["pieces"].keys() and len(ranks[0]["pieces"]) > 3
    some_split = False
    for name, (n0, c0, v0, dev0, shape0, total) in ranks[0]["pieces"].items():
        n1, c1, v1, dev1, shape1, _ = ranks[1]["pieces"][name]
        assert n0 + n1 == total == whole[name].numel(), name  # the shares add up to the parameter whole
        assert (c0, c1, shape0, shape1) == (n0, n1, (n0,), (n1,)) and dev0 == dev1 == "cpu"
        assert torch.equal(torch.cat([v0, v1]), whole[name].flatten()), name  # current values, in order
        some_split |= n0 > 0 and n1 > 0
    assert some_split  # a parameter that straddles the two shards
    assert ranks[0]["sum"] == pytest.approx(float(ranks[0]["first"].float().sum()))
