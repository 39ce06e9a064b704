"""What the real-trainer tests share: a tiny Lightning regressor, and a Hugging Face Trainer
of a tiny GPT-2 learning to repeat token ids."""

from __future__ import annotations

from pathlib import Path
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


def tiny_gpt2_trainer(output_dir: Path, callbacks: list[Any], *, steps: int,
                      optim: str = "adamw_torch_fused", **arguments: Any) -> Any:
    """A ``transformers.Trainer`` of a one-layer GPT-2 on :class:`Tokens`, saving a
    ``checkpoint-N`` folder every 5 steps; ``arguments`` go to ``TrainingArguments``."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64,
                                     n_positions=16)
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=8,
        learning_rate=1e-3, logging_strategy="no", save_strategy="steps", save_steps=5,
        report_to=[], disable_tqdm=True, use_cpu=True, dataloader_num_workers=0, seed=0,
        optim=optim, **arguments,
    )
    return transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args,
                                train_dataset=Tokens(), callbacks=callbacks)
