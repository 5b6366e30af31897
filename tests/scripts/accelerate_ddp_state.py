"""Run under torchrun with 2 processes: ``save_state``/``load_state`` of an Accelerator
through stepvault on every rank; after ``load_state`` each rank repeats the same steps and
draws the same random numbers as after the save (its own RNG state, not rank 0's).

    python -m torch.distributed.run --standalone --nproc_per_node 2 accelerate_ddp_state.py ROOT

Prints ``RANK <r> OK`` on each rank.
"""

from __future__ import annotations

import os
import sys

import torch
from accelerate import Accelerator

from stepvault.integrations.accelerate import load_state, save_state


def main(root: str) -> None:
    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = acc.prepare(model, opt)
    torch.manual_seed(100 + acc.process_index)  # the ranks' RNGs differ

    def train(steps: int) -> list[torch.Tensor]:
        for _ in range(steps):
            loss = model(torch.randn(4, 4)).pow(2).mean()  # dropout: a draw per rank
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()] + [torch.rand(3)]

    train(3)
    progress = {"epoch": 1}
    save_state(acc, root, run="st", step=3, extra=progress)
    expected = train(4)
    progress["epoch"] = 7
    info = load_state(acc, root, run="st", extra=progress)
    assert info.step == 3 and progress == {"epoch": 1}, (info, progress)
    got = train(4)
    assert all(torch.equal(a, b) for a, b in zip(expected, got)), "not the same after load"
    print(f"RANK {acc.process_index} OK", flush=True)
    acc.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    # A gloo thread joinable at interpreter exit once aborted a finished rank (see
    # tests/dist_workers.py): leave at once, the result is printed.
    os._exit(0)
