"""The torch names known without importing torch are what this torch says they are."""

from __future__ import annotations

import torch
from torch import _weights_only_unpickler as wo
from torch._utils import IMPORT_MAPPING, NAME_MAPPING

from torchverity.pickles import _listing, _torch_names


def test_the_known_names_are_in_torchs_weights_only_allowlist() -> None:
    assert set(_torch_names.MODELED) <= set(wo._get_allowed_globals())
    assert set(_listing._STAND_INS) == _torch_names.MODELED


def test_no_known_name_is_one_torch_remaps() -> None:
    for qualname in _torch_names.MODELED:
        module, _, name = qualname.rpartition(".")
        assert module not in IMPORT_MAPPING and (module, name) not in NAME_MAPPING


def test_the_dtype_and_storage_tables_match_this_torch() -> None:
    assert {n: getattr(torch, n).itemsize for n in _torch_names.ITEMSIZE} == \
        _torch_names.ITEMSIZE
    typed = {v: str(k).removeprefix("torch.")
             for k, v in torch.storage._dtype_to_storage_type_map().items() if k.is_floating_point
             or k.is_complex or k in (torch.bool, torch.uint8, torch.int8, torch.int16,
                                      torch.int32, torch.int64)}
    assert typed == _torch_names.STORAGES
