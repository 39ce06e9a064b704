"""What the real-trainer tests share: a tiny Lightning regressor, and token ids a tiny GPT-2
learns to repeat."""

from __future__ import annotations

from typing import Any

import torch


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 192) -> None:
        self.ids = torch.randint(0, 64, (n, 12), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_regressor(optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW) -> Any:
    """A LightningModule around an 8-16-1 MLP (``.net``), trained with ``optimizer``."""
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                           torch.nn.Linear(16, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return optimizer(self.parameters(), lr=1e-2)

    return Tiny()
