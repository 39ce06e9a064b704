"""The fingerprint of a checkpoint file or sharded folder, read without running code from it."""

from __future__ import annotations

import os

from torchverity.checkpoint._fp_record import DEVICE, EXACT, LEGACY_EXACT, Fingerprint, Mode


def fingerprint_file(path: str | os.PathLike[str], *,
                     mode: Mode | str = "exact") -> Fingerprint:
    """Fingerprint a checkpoint file, Hugging Face folder or index without executing code from it.

    A .safetensors file streams each tensor's bytes through its hash with one
    small buffer (memory stays flat whatever the size, and torch is not
    imported). So does a .pt file laid out as ``torch.save`` writes a state dict
    (its pickle is read inertly, :mod:`torchverity.pickles._listing`; a
    non-contiguous view's elements are gathered with numpy). Any other .pt file,
    and the ``device`` mode, go through PyTorch's restricted ``weights_only``
    unpickler with memory-mapped storages.
    """
    from torchverity.checkpoint._folders import resolve
    from torchverity.checkpoint._onnx import is_onnx
    from torchverity.pickles._file_format import checkpoint_format

    target = resolve(path)
    algo = {"exact": EXACT, "auto": EXACT}.get(mode, mode)
    onnx = target.index is None and is_onnx(target.file)
    if onnx and algo in (EXACT, LEGACY_EXACT):
        from torchverity.checkpoint._onnx import onnx_contents

        found_onnx = onnx_contents(target.file, algo)
        if found_onnx is not None:
            return found_onnx[1]
    if not onnx and algo in (EXACT, LEGACY_EXACT):
        if target.index is None and checkpoint_format(target.file) == "safetensors":
            from torchverity.checkpoint._st_fingerprint import fingerprint_safetensors
            from torchverity.pickles._limits import check_safetensors_limits

            check_safetensors_limits(target.file)  # a huge header is refused before parsing
            return fingerprint_safetensors(target.file, algo)
        from torchverity.checkpoint._diff_listing import fingerprint_of, listing

        found = listing(path, algo, canonical=True)
        if found is not None:
            return fingerprint_of(found, algo)
    from torchverity.checkpoint._fingerprint import fingerprint
    from torchverity.checkpoint._onnx import onnx_initializers
    from torchverity.checkpoint._read import read_unverified

    obj = onnx_initializers(target.file) if onnx else read_unverified(path)
    return fingerprint(obj, mode=DEVICE if algo == DEVICE else mode)
