"""Data the real-trainer tests share: token ids a tiny GPT-2 learns to repeat."""

from __future__ import annotations

import torch


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 192) -> None:
        self.ids = torch.randint(0, 64, (n, 12), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}
