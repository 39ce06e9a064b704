"""Demo step: signed models, and Hugging Face and torch.hub caches checked offline."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
from pathlib import Path

from torchverity.demo import DemoContext
from torchverity.provenance._keys import write_key_pair

TITLE = ("Provenance: OpenSSF model signatures, signed attestations, Hugging Face and "
         "torch.hub caches offline")
NEEDS = ("sign",)


def _signed_model(ctx: DemoContext, model_dir: Path) -> tuple[Path, Path]:
    priv, pub = write_key_pair(ctx.workdir)
    ctx.say("record the folder in SHA-256, the digest OpenSSF signatures hold, then sign it "
            "with an ECDSA P-256 key (the manifest's digests are reused):")
    ctx.cli("manifest", str(model_dir), "--algo", "sha256")
    ctx.cli("sign", str(model_dir), "--key", str(priv))
    sig = str(model_dir / "model.sig")
    ctx.cli("verify", str(model_dir), "--signature", sig, "--public-key", str(pub))
    tampered = ctx.workdir / "signed-copy"
    shutil.copytree(model_dir, tampered)
    ctx.say("someone who can write the files changes one byte and rewrites the manifest:")
    ctx.cli("inject", "bitflip", str(tampered / "model.pt"), "--offset", "900", "--bit", "0")
    ctx.cli("manifest", str(tampered))
    ctx.cli("verify", str(tampered))
    _rc, out, _err = ctx.cli("verify", str(tampered), "--signature",
                             str(tampered / "model.sig"), "--public-key", str(pub), expect=1)
    ctx.expect("mismatched  model.pt" in out, "the signature refuses it and names model.pt")
    _protected_load(ctx, tampered / "model.pt", pub)
    return priv, pub


def _protected_load(ctx: DemoContext, path: Path, pub: Path) -> None:
    """Code that calls plain torch.load, run under the switch with the key to trust."""
    import torch

    from torchverity import IntegrityError, protected

    try:
        with protected("refuse", public_key=pub):
            torch.load(path)
        refused = ""
    except IntegrityError as exc:
        refused = exc.message
        ctx.say(f"plain torch.load under protect(public_key=...) was refused: {refused}")
    ctx.expect("model.pt" in refused and "signature" in refused,
               "the switch checks the signature beside the file and refuses the changed one")


def _attested(ctx: DemoContext, priv: Path, pub: Path) -> None:
    import torch

    import torchverity

    ckpt = ctx.workdir / "attested" / "model.safetensors"
    ckpt.parent.mkdir()
    torchverity.save(torch.nn.Linear(8, 4).state_dict(), ckpt, meta={"step": 100}, seed=0)
    ctx.say("a signed attestation ties the checkpoint's bytes to its fingerprint and training "
            "record (in-toto Statement v1):")
    ctx.cli("attest", str(ckpt), "--key", str(priv))
    att = f"{ckpt}.intoto.json"
    ctx.cli("verify", str(ckpt), "--attestation", att, "--public-key", str(pub))
    ctx.cli("inject", "bitflip", str(ckpt), "--offset", "120", "--bit", "2")
    _rc, out, err = ctx.cli("verify", str(ckpt), "--attestation", att, "--public-key", str(pub),
                            expect=1)
    ctx.expect("model.safetensors" in out + err and "mismatched" in out + err,
               "the attestation refuses the changed checkpoint and names it")


def _hub_cache(home: Path, files: dict[str, bytes], commit: str) -> Path:
    """The layout huggingface_hub writes: blobs named by content, relative snapshot links."""
    repo = home / "hub" / "models--demo--tiny"
    for name, data in files.items():
        lfs = name.endswith(".safetensors")
        blob = hashlib.sha256(data).hexdigest() if lfs else \
            hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (repo / "blobs").mkdir(parents=True, exist_ok=True)
        (repo / "blobs" / blob).write_bytes(data)
        link = repo / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(repo / "blobs" / blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return repo


def _edited_snapshot_config(ctx: DemoContext, snapshot: Path) -> None:
    """A cached config.json edited through its link: the model built from it is another."""
    import torchverity

    config = snapshot / "config.json"
    kept = config.read_bytes()
    ctx.say("the cached config.json edited in place (its blob no longer hashes to its name):")
    config.write_bytes(b'{"in": 64}\n')
    try:
        torchverity.load(snapshot)
        named = False
    except torchverity.IntegrityError as exc:
        named = exc.path == str(config)
    config.write_bytes(kept)
    ctx.expect(named, "torchverity.load of the snapshot folder names the edited config.json "
               "before reading the weights")


def _torch_hub_download(ctx: DemoContext, weights: Path) -> None:
    """A file fetched by torch.hub (as torchvision's pretrained weights are), its name
    holding its digest's first hex digits; one bit flips in the cache."""
    import torch

    name = f"linear-{hashlib.sha256(weights.read_bytes()).hexdigest()[:8]}.pth"
    origin = ctx.workdir / "model-zoo"
    origin.mkdir()
    shutil.copy(weights, origin / name)
    checkpoints = ctx.workdir / "torch_home" / "hub" / "checkpoints"
    ctx.say("torch.hub downloads weights (load_state_dict_from_url, check_hash=True) into "
            f"its cache as {name}:")
    # torch.hub says "Downloading: ..." on stdout, which holds the demo's data (--json).
    with contextlib.redirect_stdout(sys.stderr):
        torch.hub.load_state_dict_from_url((origin / name).as_uri(),
                                           model_dir=str(checkpoints), check_hash=True,
                                           progress=False)
    cached = checkpoints / name
    ctx.cli("verify", str(cached))
    ctx.cli("inject", "bitflip", str(cached), "--offset", "900", "--bit", "1")
    _rc, out, _err = ctx.cli("verify", str(cached), expect=1)
    ctx.expect("mismatched" in out, "verify finds the flipped bit against the name torch.hub "
               "gave the file (torch.hub checks it only at the download)")


def run(ctx: DemoContext) -> None:
    import torch

    import torchverity

    torch.manual_seed(0)
    model_dir = ctx.workdir / "signed"
    model_dir.mkdir()
    state = torch.nn.Linear(32, 16).state_dict()
    torch.save(state, model_dir / "model.pt")
    (model_dir / "config.json").write_text('{"in": 32, "out": 16}\n')
    _attested(ctx, *_signed_model(ctx, model_dir))

    ctx.say("a Hugging Face hub cache, built locally in the hub's own layout:")
    weights = ctx.workdir / "model.safetensors"
    torchverity.save(state, weights)
    commit = "c0ffee" + "0" * 34
    repo = _hub_cache(ctx.workdir / "hf_home", {"model.safetensors": weights.read_bytes(),
                                                "config.json": b'{"in": 32}\n'}, commit)
    ctx.cli("verify", str(ctx.workdir / "hf_home"))
    _edited_snapshot_config(ctx, repo / "snapshots" / commit)
    blob = next(p for p in (repo / "blobs").iterdir() if len(p.name) == 64)
    ctx.say("one bit flips in the cached weights blob (same size, no error from the hub library):")
    ctx.cli("inject", "bitflip", str(blob), "--offset", "200", "--bit", "3")
    _rc, out, _err = ctx.cli("verify", str(repo), expect=1)
    ctx.expect("damaged" in out and "model.safetensors" in out,
               "verify names the damaged model.safetensors of that revision, offline")
    try:
        torchverity.load(repo / "snapshots" / commit / "model.safetensors")
        refused = False
    except torchverity.IntegrityError as exc:
        refused = "Hugging Face hub" in exc.message
    ctx.expect(refused, "torchverity.load on the cached path refuses the damaged blob")
    pt = ctx.workdir / "linear.pth"
    torch.save(state, pt)
    _torch_hub_download(ctx, pt)
