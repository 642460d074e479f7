"""A whole DDP run: torchrun --standalone --nproc_per_node=2 examples/minimal_ddp.py"""
import os

import torch
import torch.distributed as dist
from torch.nn.functional import mse_loss
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

GLOBAL_BATCH, EPOCHS, WORKERS, SEED = 32, 5, 2, 0


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":  # one GPU per process: the one this node's LOCAL_RANK names
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")  # torchrun's env
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)  # the same data and initial weights on every rank
    x = torch.randn(512, 8)  # a synthetic regression problem: y = x . (1, ..., 8)
    y = x @ torch.arange(1.0, 9.0) + 0.1 * torch.randn(512)
    dataset = TensorDataset(x, y.unsqueeze(1))
    sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)  # this rank's shard
    loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // world_size, sampler=sampler,
                        num_workers=WORKERS, persistent_workers=WORKERS > 0)
    model = DDP(torch.nn.Linear(8, 1).to(device))  # copies rank 0's weights to all
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        total = torch.zeros((), device=device)  # this rank's sum of batch losses
        for inputs, targets in loader:
            loss = mse_loss(model(inputs.to(device)), targets.to(device))
            optimizer.zero_grad()
            loss.backward()  # DDP averages the gradients over the ranks here
            optimizer.step()
            total += loss.detach()
        dist.all_reduce(total)  # summed over the ranks, in place, on every rank
        if rank == 0:  # one line per epoch, not one per rank; how many ranks took part
            mean = total.item() / world_size / len(loader)
            print(f"epoch {epoch + 1}/{EPOCHS}: loss {mean:.4f}, ranks {world_size}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
