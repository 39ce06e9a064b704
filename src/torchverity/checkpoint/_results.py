"""What save and load report, and the warning for checks that could not run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SidecarPolicy = Literal["warn", "require", "ignore"]
DigestSource = Literal["sidecar", "meta", "manifest", "hub", "torch-hub", "signature"]


@dataclass(frozen=True)
class ExpectedDigest:
    """The digest a file is checked against, and the record it came from (``prefix``: the
    record holds only the digest's first hex digits, as a torch.hub file name does)."""

    algo: str
    hex: str
    source: DigestSource
    prefix: bool = False

    def matches(self, actual: str) -> bool:
        return actual.startswith(self.hex) if self.prefix else actual == self.hex


class CheckpointWarning(UserWarning):
    """A checkpoint loaded, but something could not be verified (e.g. no sidecar)."""


@dataclass(frozen=True)
class SaveReport:
    """What ``save`` wrote. ``written`` is False on ranks that left writing to rank 0."""

    path: str
    algo: str
    digest: str
    fingerprint: str
    sidecar: str | None
    meta_path: str | None
    size: int = 0
    written: bool = True


@dataclass(frozen=True)
class LoadReport:
    """What ``load`` verified, and how."""

    path: str
    format: str
    algo: str | None
    digest: str | None
    digest_source: DigestSource | None  # None when nothing was checked
    fingerprint: str | None
    fingerprint_verified: bool
    sidecar_policy: str
    weights_only: bool
    tensors: int
    model_checked: bool = False
    shards: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    # "rehashed": the loaded tensors were hashed and compared with meta.json;
    # "bound": the verified file digest is the one meta.json recorded with it.
    fingerprint_check: str | None = None
    # Fitting into a model (load(..., model=)): keys left out with strict=False, and
    # non-persistent buffers the file holds that the model does not load (as
    # transformers' from_pretrained ignores them).
    missing_keys: tuple[str, ...] = ()
    unexpected_keys: tuple[str, ...] = ()
    ignored_keys: tuple[str, ...] = ()
    # Files of a model folder a model is built from (config.json, tokenizer files,
    # 1_Pooling/config.json...) that matched their record: what vouched for them
    # ("manifest", "hub-cache" or "local-dir") and where (the manifest, the hub repository
    # folder, the local_dir download).
    model_files: tuple[str, ...] = ()
    model_files_against: str | None = None
    model_files_record: str | None = None

    @property
    def verified(self) -> bool:
        return self.digest_source is not None and self.fingerprint_verified
