"""One rank of tests/test_distributed.py's FSDP2 check, started by torchrun on CPU (gloo): the bilinear model sharded
with `fully_shard` (one unit per BilinearBlock, then the root), a forward + backward on this rank's half of a batch,
an SGD step; every rank compares the loss and the gathered gradients and parameters with one process's unsharded
model on the whole batch. Rank 0 then saves the gathered full state dict (through train.py's `unsharded_copy`) with
save_pretrained, reloads it with from_pretrained and compares the logits. Writes OUT/rank{i}.json when all passed."""
import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from bilinear_lm import BilinearConfig, BilinearForCausalLM
from bilinear_lm.training import unsharded_copy

TOL = {"rtol": 1e-4, "atol": 1e-5}


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = BilinearConfig(vocab_size=67, hidden_size=24, num_hidden_layers=2, num_heads=3, state_size=5, rank=7,
                            intermediate_size=40, norm_chunk_size=4)
    model = BilinearForCausalLM(config)
    reference = copy.deepcopy(model)  # one process, unsharded, the whole batch
    batch = torch.randint(0, config.vocab_size, (2 * world, 16), generator=torch.Generator().manual_seed(1))

    ref_loss = reference(input_ids=batch, labels=batch).loss
    ref_loss.backward()
    ref_grads = {name: p.grad.clone() for name, p in reference.named_parameters()}

    mesh = init_device_mesh("cpu", (world,))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    mine = batch.chunk(world)[rank]
    loss = model(input_ids=mine, labels=mine).loss
    loss.backward()
    losses = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(losses, loss.detach())
    torch.testing.assert_close(torch.stack(losses).mean(), ref_loss.detach(), **TOL)  # equal token counts per rank
    for name, p in model.named_parameters():
        assert type(p).__name__ == "DTensor", f"{name} is not sharded"
        full = p.grad.full_tensor()  # FSDP averages the ranks' gradients: the whole batch's mean-loss gradient
        torch.testing.assert_close(full, ref_grads[name], **TOL, msg=lambda m: f"grad of {name}: {m}")

    for m in (model, reference):
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    full_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        ref_sd = reference.state_dict()
        assert full_sd.keys() == ref_sd.keys(), (sorted(full_sd), sorted(ref_sd))
        for name, value in full_sd.items():
            torch.testing.assert_close(value, ref_sd[name], **TOL, msg=lambda m: f"parameter {name}: {m}")
        plain = unsharded_copy(model, full_sd)
        assert type(plain) is BilinearForCausalLM, type(plain)
        plain.save_pretrained(os.path.join(out_dir, "model"), safe_serialization=True)
        reloaded = BilinearForCausalLM.from_pretrained(os.path.join(out_dir, "model")).eval()
        with torch.no_grad():
            expected = reference.eval()(input_ids=batch).logits
            torch.testing.assert_close(plain(input_ids=batch).logits, expected, **TOL)
            assert torch.equal(reloaded(input_ids=batch).logits, plain(input_ids=batch).logits)
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "loss": loss.item(), "ref_loss": ref_loss.item()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
