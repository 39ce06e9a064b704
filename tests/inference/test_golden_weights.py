"""The golden check compares the weights' fingerprint whenever the record holds one, even
when every output bit matches: a weight the golden inputs never reach still changes it.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

import torchverity
from torchverity import golden

MODELS = textwrap.dedent(
    """
    import torch

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    """
)


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    (tmp_path / "tv_golden_models.py").write_text(MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    from tv_golden_models import net  # type: ignore[import-not-found]

    model = net().eval()
    inputs = torch.randn(5, 4)
    inputs[:, 3] = 0.0  # the golden inputs never reach column 3 of the first layer
    torch.save(inputs, tmp_path / "x.pt")
    golden.record(model, inputs, tmp_path / "g.json")
    torchverity.save(model.state_dict(), tmp_path / "good.pt")
    with torch.no_grad():
        model[0].weight[1, 3] += 0.5
    torchverity.save(model.state_dict(), tmp_path / "bad.pt")
    return {"root": tmp_path, "good": tmp_path / "good.pt", "bad": tmp_path / "bad.pt",
            "golden": tmp_path / "g.json"}


def test_a_weight_change_that_moves_no_output_fails(setup: dict[str, Path]) -> None:
    from tv_golden_models import net  # type: ignore[import-not-found]

    model = net().eval()
    torchverity.load(setup["bad"], model=model)
    result = golden.check(model, setup["golden"])
    assert not result.ok and result.parts == ["weights"]
    assert result.weights_changed == ("0.weight",)
    assert golden.check(model, setup["golden"], weights=False).ok  # outputs alone: identical


def test_cli_compares_weights_by_default_and_on_request(setup: dict[str, Path],
                                                        run_cli) -> None:
    base = ("golden", "check", "--model", "tv_golden_models:net", "--golden", setup["golden"])
    assert run_cli(*base, "--weights", setup["good"]).code == 0
    assert run_cli(*base, "--weights", setup["good"], "--check-weights").code == 0
    bad = run_cli(*base, "--weights", setup["bad"])
    assert bad.code == 1 and "0.weight" in bad.out
    assert run_cli(*base, "--weights", setup["bad"], "--check-weights").code == 1
    assert run_cli(*base, "--weights", setup["bad"], "--no-check-weights").code == 0
