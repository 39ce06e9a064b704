"""Real artifacts for the provenance tests: keys, certificates, model folders, hub caches."""

from __future__ import annotations

import datetime
import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID


def write_rsa_keys(folder: Path) -> tuple[Path, Path]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    priv, pub = folder / "rsa.pem", folder / "rsa.pub.pem"
    priv.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo))
    return priv, pub


@dataclass(frozen=True)
class Pki:
    ca: Path
    leaf_key: Path
    leaf: Path


def write_pki(folder: Path, *, expired: bool = False, tag: str = "") -> Pki:
    """A self-signed CA and a leaf certificate (digitalSignature, codeSigning) it issued."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"torchverity test CA{tag}")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(days=30))
          .not_valid_after(now + datetime.timedelta(days=3650))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, key_cert_sign=True, crl_sign=True,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    start = now - datetime.timedelta(days=20 if expired else 1)
    end = now - datetime.timedelta(days=10) if expired else now + datetime.timedelta(days=365)
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "model publisher")]))
            .issuer_name(ca_name).public_key(leaf_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.CODE_SIGNING]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = Pki(folder / f"ca{tag}.pem", folder / f"leaf{tag}.key.pem", folder / f"leaf{tag}.pem")
    paths.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths.leaf.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths.leaf_key.write_bytes(leaf_key.private_bytes(serialization.Encoding.PEM,
                                                      serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))
    return paths


def hf_model_folder(folder: Path, *, shard: str | None = None) -> Path:
    """A real ``save_pretrained`` folder: tiny GPT-2 weights, config, tokenizer, .gitattributes."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=64,
                        bos_token_id=0, eos_token_id=0)
    kwargs = {"max_shard_size": shard} if shard else {}
    GPT2LMHeadModel(config).save_pretrained(folder, **kwargs)
    vocab = {f"w{i}": i for i in range(63)} | {"[UNK]": 63}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)
    (folder / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    return folder


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def flip_bit(path: Path, offset: int, bit: int = 0, *, keep_mtime: bool = False) -> None:
    st = path.stat()
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ (1 << bit)]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


# ------------------------------------------------------------------ hub caches


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(name: str) -> bool:
    return name.endswith((".safetensors", ".bin", ".pt", ".msgpack", ".h5"))


def hub_cache_from_folder(cache: Path, repo_id: str, commit: str, folder: Path,
                          revision: str = "main") -> Path:
    """Put ``folder``'s files into a hub cache exactly as ``hf_hub_download`` stores them.

    Uses huggingface_hub's own cache functions: the repo folder name, the
    pointer path, the relative symlink into blobs/ and the ref file. LFS files
    are named by SHA-256, the others by their git blob SHA-1, as the hub does.
    """
    from huggingface_hub.file_download import (
        _cache_commit_hash_for_specific_revision,
        _create_symlink,
        _get_pointer_path,
        repo_folder_name,
    )

    storage = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        data = path.read_bytes()
        etag = hashlib.sha256(data).hexdigest() if is_lfs(rel) else git_blob_sha1(data)
        blob = storage / "blobs" / etag
        pointer = Path(_get_pointer_path(os.fspath(storage), commit, rel))
        blob.parent.mkdir(parents=True, exist_ok=True)
        pointer.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.write_bytes(data)
        _create_symlink(os.fspath(blob), os.fspath(pointer), new_blob=True)
    _cache_commit_hash_for_specific_revision(os.fspath(storage), revision, commit)
    return storage


def local_dir_from_folder(local_dir: Path, commit: str, folder: Path) -> Path:
    """A ``local_dir`` download: the files plus huggingface_hub's own download records."""
    from huggingface_hub._local_folder import write_download_metadata

    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        data = path.read_bytes()
        target = local_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        etag = hashlib.sha256(data).hexdigest() if is_lfs(rel) else git_blob_sha1(data)
        write_download_metadata(local_dir, rel, commit, etag)
    return local_dir
