"""The bag's tag files are read back as a BagIt validator reads them: tags that other BagIt
tools add are accepted; a wrong Payload-Oxum, a missing version and unreadable files are named.
"""

from __future__ import annotations

from pathlib import Path

from torchverity.batch import verify_batch
from torchverity.batch._bag import bag_problems, write_bag
from torchverity.manifest import ManifestEntry

ENTRIES = [ManifestEntry("data/a.out", 5, "ab" * 32), ManifestEntry("data/b.out", 7, "cd" * 32)]


def test_a_bag_as_written_has_no_problem(tmp_path: Path) -> None:
    write_bag(tmp_path, ENTRIES)
    assert bag_problems(tmp_path, ENTRIES) == []
    assert "Payload-Oxum: 12.2\n" in (tmp_path / "bag-info.txt").read_text()


def test_tags_other_bagit_tools_add_are_accepted(tmp_path: Path) -> None:
    write_bag(tmp_path, ENTRIES)
    (tmp_path / "bag-info.txt").write_text(
        "Bagging-Date: 2026-01-02\nPayload-Oxum: 12.2\nExternal-Description: outputs of a\n"
        "  nightly run, continued on an indented line\nBag-Software-Agent: bagit.py\n")
    (tmp_path / "bagit.txt").write_text("BagIt-Version: 0.97\nTag-File-Character-Encoding: UTF-8\n")
    assert bag_problems(tmp_path, ENTRIES) == []


def test_each_damage_is_named(tmp_path: Path) -> None:
    write_bag(tmp_path, ENTRIES)
    info, bagit = tmp_path / "bag-info.txt", tmp_path / "bagit.txt"
    info.write_text("Payload-Oxum: 12.3\n")
    bagit.write_text("Tag-File-Character-Encoding: UTF-8\n")
    assert bag_problems(tmp_path, ENTRIES) == [
        ("bagit.txt", "does not declare one BagIt-Version"),
        ("bag-info.txt", "Payload-Oxum is 12.3; the committed outputs make 12.2 (bytes.count)"),
    ]
    info.write_bytes(b"\xff\xfe")
    bagit.unlink()
    (bagit_name, why_bagit), (info_name, why_info) = bag_problems(tmp_path, ENTRIES)
    assert (bagit_name, why_bagit) == ("bagit.txt", "is missing beside manifest-sha256.txt")
    assert info_name == "bag-info.txt" and why_info.startswith("cannot be read as UTF-8 text")
    info.write_text("no colon here\n")
    assert bag_problems(tmp_path, ENTRIES)[1] == ("bag-info.txt", "line 1 is not 'Label: value'")


def test_verify_reports_a_damaged_bag_info(tmp_path: Path) -> None:
    from torchverity.batch import run_batch

    (tmp_path / "in").mkdir()
    (tmp_path / "in/x.bin").write_bytes(b"12345")
    assert run_batch(tmp_path / "in", lambda item: item.data, tmp_path / "out").ok
    assert verify_batch(tmp_path / "out").ok
    (tmp_path / "out/bag-info.txt").write_text("Payload-Oxum: 6.1\n")
    result = verify_batch(tmp_path / "out")
    assert [(p.kind, p.path) for p in result.problems] == [("bag-mismatch", "bag-info.txt")]
