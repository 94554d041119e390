"""A science model on your own data: a small CNN that learns one time step of the heat equation from 2D
fields kept in an HDF5 file. An example of --dataset MODULE:FACTORY and --model MODULE:FACTORY together
(recipes/harness/model.py and data.py state the contract).

    python recipes/examples/fields.py --out data/fields.h5                  # make the file (seconds)
    python recipes/ddp/train.py --model recipes/examples/fields.py:model \\
        --dataset recipes/examples/fields.py:dataset --data data/fields.h5 --eval-every 10
    torchrun --standalone --nproc_per_node=2 recipes/ddp/train.py --model recipes/examples/fields.py:model \\
        --dataset recipes/examples/fields.py:dataset --data data/fields.h5 --data-workers 2
    sbatch slurm/ddp.sh --model recipes/examples/fields.py:model --dataset recipes/examples/fields.py:dataset \\
        --data $SCRATCH/data/fields.h5

The file: groups "train" and "validation", each with "u" (N, 1, S, S), a smooth random field, and "u_next"
(N, 1, S, S), the same field one explicit heat-equation step later (u + alpha * laplacian(u), periodic).
The CNN's loss is the mean squared error of its prediction of u_next from u; a 3x3 stencil is the exact
answer, so the loss falls towards zero as it learns.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ALPHA = 0.2  # the diffusion number of the step (stable for alpha <= 0.25)


def heat_step(u: torch.Tensor) -> torch.Tensor:
    """One explicit step of du/dt = laplacian(u) on a periodic grid."""
    laplacian = (u.roll(1, -1) + u.roll(-1, -1) + u.roll(1, -2) + u.roll(-1, -2) - 4 * u)
    return u + ALPHA * laplacian


def make_fields(path: Path, train: int, validation: int, size: int, seed: int = 0) -> None:
    """Write the HDF5 file (to a temporary name first: a file that exists is whole)."""
    import h5py

    generator = torch.Generator().manual_seed(seed)
    partial = path.with_name(path.name + ".partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(partial, "w") as file:
        for split, count in (("train", train), ("validation", validation)):
            noise = torch.randn(count, 1, size, size, generator=generator)
            u = F.avg_pool2d(F.pad(noise, (2, 2, 2, 2), mode="circular"), 5, stride=1)  # smooth
            file.create_dataset(f"{split}/u", data=u.numpy())
            file.create_dataset(f"{split}/u_next", data=heat_step(u).numpy())
    os.replace(partial, path)


class Fields(torch.utils.data.Dataset):
    """One split of the file. The file is opened in the process that reads it (DataLoader workers each open
    their own; an h5py handle must not cross a fork)."""

    def __init__(self, path: str, split: str):
        import h5py

        self.path, self.split = path, split
        with h5py.File(path, "r") as file:
            self.length = len(file[f"{split}/u"])
        self._file = None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        import h5py

        if self._file is None or self._file[1] != os.getpid():
            self._file = (h5py.File(self.path, "r"), os.getpid())
        file = self._file[0]
        return torch.from_numpy(file[f"{self.split}/u"][index]), torch.from_numpy(file[f"{self.split}/u_next"][index])


def dataset(args, split: str) -> Fields:
    """--dataset recipes/examples/fields.py:dataset: the file is --data."""
    if args.data == "synthetic" or not Path(args.data).is_file():
        raise FileNotFoundError(f"--data {args.data} is not an HDF5 file of fields: make one with "
                                "python recipes/examples/fields.py --out FILE")
    return Fields(args.data, split)


class HeatCNN(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1, padding_mode="circular")
        self.conv2 = nn.Conv2d(width, 1, 3, padding=1, padding_mode="circular")

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        prediction = inputs + self.conv2(F.gelu(self.conv1(inputs)))
        return F.mse_loss(prediction, targets)


def model(args) -> HeatCNN:
    """--model recipes/examples/fields.py:model"""
    return HeatCNN()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the HDF5 file to write")
    parser.add_argument("--train", type=int, default=512, help="fields in the training split")
    parser.add_argument("--validation", type=int, default=64, help="fields in the validation split")
    parser.add_argument("--size", type=int, default=32, help="grid points per side")
    options = parser.parse_args()
    make_fields(options.out, options.train, options.validation, options.size)
    print(f"[fields] wrote {options.out}: {options.train} + {options.validation} fields of {options.size}x{options.size}")
