"""Checkpoints as users save them, for the tests of the torch-free zip readers: every
dtype, views with offsets, shared storages, non-contiguous views and plain values; real
Lightning Trainer checkpoints."""

from __future__ import annotations

import logging
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch


def state(epoch: int = 3) -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 8, generator=g)
    ints = torch.arange(-4, 4)
    model = {
        "w": torch.randn(16, 8, generator=g), "h": torch.randn(10, generator=g).half(),
        "bf": torch.randn(10, generator=g).bfloat16(), "d": torch.randn(3, generator=g).double(),
        "f8": torch.randn(5, generator=g).to(torch.float8_e4m3fn),
        "f8b": torch.randn(5, generator=g).to(torch.float8_e5m2),
        "c64": torch.randn(4, generator=g, dtype=torch.complex64),
        "c128": torch.randn(2, generator=g, dtype=torch.complex128),
        **{str(dt).removeprefix("torch."): ints.to(dt) for dt in (
            torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)},
        **{str(dt).removeprefix("torch."): ints.abs().to(dt) for dt in (
            torch.uint16, torch.uint32, torch.uint64)},
        "mask": torch.tensor([True, False, True]),
        "base": base, "rows": base[2:5], "t": base.t(), "every3": base[:, ::3],
        "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
        "p": torch.nn.Parameter(torch.ones(3)),
    }
    return {"model": model, "epoch": epoch, "lr": 0.1, "name": "run", "note": None,
            "done": False, "dtype": torch.float16, "device": torch.device("cpu"),
            "sizes": [torch.Size([2, 3]), (1, 2.5)]}


def flip(t: torch.Tensor, index: int, bit: int) -> None:
    raw = t.view(-1).view(torch.uint8)
    raw[index * t.element_size() + bit // 8] ^= 1 << (bit % 8)


def lightning_net(hparams: Any) -> Any:
    """A one-layer LightningModule whose hyper-parameters are ``hparams``."""
    import lightning as L

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    class Net(L.LightningModule):
        def __init__(self, cfg: Any) -> None:
            super().__init__()
            self.save_hyperparameters(cfg)
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            return self.layer(batch[0]).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=0.01)

    return Net(hparams)


def lightning_checkpoint(net: Any, path: Path, steps: int, *,
                         checkpointing: bool = False) -> Path:
    """Train ``net`` ``steps`` steps with a real Trainer and save its checkpoint at ``path``;
    ``checkpointing`` keeps the Trainer's default ModelCheckpoint callback, whose state the
    checkpoint then holds."""
    import lightning as L

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)),
                                       batch_size=2)
    trainer = L.Trainer(max_steps=steps, logger=False, enable_checkpointing=checkpointing,
                        enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(path.parent), accelerator="cpu", devices=1)
    trainer.fit(net, data)
    trainer.save_checkpoint(path)
    return path


def lightning_checkpoints(root: Path, hparams: Any) -> tuple[Path, Path]:
    """Two checkpoints of one run (after 2 and 4 steps)."""
    torch.manual_seed(0)
    net = lightning_net(hparams)
    return (lightning_checkpoint(net, root / "step2.ckpt", 2),
            lightning_checkpoint(net, root / "step4.ckpt", 4))


def bert() -> Any:
    """A small transformers BERT model (skips the test without transformers)."""
    import pytest

    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                     intermediate_size=37, vocab_size=100,
                                     max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.BertModel(config).eval()


def save_bin_shards(model: Any, folder: Path, max_shard_size: str = "40KB") -> None:
    """The sharded pytorch_model-*.bin layout with its index, as transformers 4.x wrote it
    (one pytorch_model.bin when it fits in one shard)."""
    from huggingface_hub import save_torch_state_dict

    folder.mkdir(parents=True)
    model.config.save_pretrained(folder)
    save_torch_state_dict(model.state_dict(), folder, safe_serialization=False,
                          max_shard_size=max_shard_size)


def tiny_ldm_pipeline(folder: Path, **save: Any) -> Path:
    """A diffusers latent-diffusion pipeline of two weight components (unet/, vqvae/) and a
    scheduler, saved with ``save_pretrained(folder, **save)``."""
    import diffusers

    torch.manual_seed(0)
    vqvae = diffusers.VQModel(in_channels=1, out_channels=1, block_out_channels=(8,),
                              layers_per_block=1, latent_channels=2, num_vq_embeddings=8,
                              norm_num_groups=4, sample_size=8)
    unet = diffusers.UNet2DModel(
        sample_size=8, in_channels=2, out_channels=2, layers_per_block=1,
        block_out_channels=(8, 16), norm_num_groups=4,
        down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"))
    pipe = diffusers.LDMPipeline(vqvae=vqvae, unet=unet,
                                 scheduler=diffusers.DDIMScheduler(num_train_timesteps=10))
    pipe.save_pretrained(folder, **save)
    return folder


# A model module whose build reads the folder's config.json, as from_pretrained does: {folder}
# is filled in. build() notes each build in built.txt beside this module.
BERT_FOLDER_MODEL = '''
import pathlib
import torch
import transformers

FOLDER = {folder!r}


def build():
    transformers.logging.set_verbosity_error()
    (pathlib.Path(__file__).parent / "built.txt").open("a").write("built\\n")
    model = transformers.AutoModel.from_config(transformers.AutoConfig.from_pretrained(FOLDER))
    model.input_spec = ["input_ids:int64:1,-1"]
    return model


def build_batch(state):
    model = build().eval()
    model.load_state_dict(state)

    def fn(item):
        with torch.no_grad():
            return model(torch.tensor([[2, 5, 6, 3]])).last_hidden_state
    return fn
'''


def bert_folder(folder: Path) -> Path:
    """A BERT folder as a user has it: ``save_pretrained`` weights and config.json, a
    tokenizer, a generation config and ``.gitattributes`` (skips without transformers)."""
    import pytest

    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    folder.mkdir(parents=True)
    vocab = folder.parent / f"{folder.name}-vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world"]))
    bert().save_pretrained(folder)
    transformers.BertTokenizer(str(vocab)).save_pretrained(folder)
    transformers.GenerationConfig(max_new_tokens=4).save_pretrained(folder)
    (folder / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    return folder


def importable_copy(recorded: Path, tmp_path: Path, module: str) -> Path:
    """A copy of a recorded BERT folder in ``tmp_path`` and, beside it, ``module``.py whose
    build reads the copy's config.json (:data:`BERT_FOLDER_MODEL`); the caller puts
    ``tmp_path`` on ``sys.path``."""
    copy = Path(shutil.copytree(recorded, tmp_path / "bert"))
    (tmp_path / f"{module}.py").write_text(BERT_FOLDER_MODEL.format(folder=str(copy)))
    return copy


# The modules of a sentence-transformers model with a Dense head (as LaBSE and sentence-t5
# are saved): each module's folder, in modules.json order.
SENTENCE_MODULES = (("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Dense", "Dense"),
                    ("3_Normalize", "Normalize"))


def sentence_transformers_folder(folder: Path) -> Path:
    """The folder ``SentenceTransformer.save`` writes (sentence-transformers 5.x), built
    file by file as that library lays it out: the inner model's ``save_pretrained`` files
    (config.json, model.safetensors, tokenizer) at the root with modules.json,
    sentence_bert_config.json, config_sentence_transformers.json and a README model card;
    1_Pooling/config.json; 2_Dense/config.json with its own model.safetensors; an empty
    3_Normalize/."""
    import json

    import transformers
    from safetensors.torch import save_file

    bert_folder(folder)
    (folder / "generation_config.json").unlink()  # a sentence encoder has none
    (folder / "modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": path,
         "type": f"sentence_transformers.models.{kind}"}
        for i, (path, kind) in enumerate(SENTENCE_MODULES)], indent=2))
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 64, "do_lower_case": False}, indent=2))
    (folder / "config_sentence_transformers.json").write_text(json.dumps({
        "model_type": "SentenceTransformer",
        "__version__": {"sentence_transformers": "5.1.0", "transformers": transformers.__version__,
                        "pytorch": torch.__version__},
        "prompts": {"query": "", "document": ""}, "default_prompt_name": None,
        "similarity_fn_name": "cosine"}, indent=2))
    (folder / "README.md").write_text("---\ntags:\n- sentence-transformers\n---\n# tiny\n")
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 32, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": False, "include_prompt": True}, indent=4))
    (folder / "2_Dense").mkdir()
    (folder / "2_Dense" / "config.json").write_text(json.dumps({
        "in_features": 32, "out_features": 16, "bias": True,
        "activation_function": "torch.nn.modules.activation.Tanh"}))
    dense = torch.nn.Linear(32, 16)
    save_file({"linear.weight": dense.weight.detach().contiguous(),
               "linear.bias": dense.bias.detach().contiguous()},
              folder / "2_Dense" / "model.safetensors")
    (folder / "3_Normalize").mkdir()
    return folder
