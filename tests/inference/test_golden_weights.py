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

    def build(state):
        model = net().eval()
        model.load_state_dict(state)

        def predict(item):
            with torch.no_grad():
                return model(torch.ones(4)).numpy().tobytes()

        predict.model = model
        return predict
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


def test_cli_says_the_weights_failed_when_every_output_matched(setup: dict[str, Path],
                                                              run_cli) -> None:
    bad = run_cli("golden", "check", "--model", "tv_golden_models:net", "--golden",
                  setup["golden"], "--weights", setup["bad"])
    assert bad.code == 1
    assert ("the outputs match the record, but the weights are not the recorded ones "
            "(1 tensor(s) differ: 0.weight)") in bad.err
    assert "no longer reproduces" not in bad.err
    assert f"torchverity inspect {setup['bad']}" in bad.err
    assert "CKPT" not in bad.err and "OLD NEW" not in bad.out + bad.err


def test_serve_refusal_says_what_failed_with_the_real_command(setup: dict[str, Path],
                                                             run_cli) -> None:
    pytest.importorskip("fastapi")
    from tv_golden_models import net  # type: ignore[import-not-found]

    def serve(weights: Path) -> tuple[int, str]:
        done = run_cli("serve", "--check", "--model", "tv_golden_models:net", "--weights",
                       weights, "--golden", setup["golden"], "--input-spec", "x:float32:-1,4")
        return done.code, done.err

    code, err = serve(setup["bad"])
    assert code == 1
    assert ("the outputs match the record, but the weights are not the recorded ones "
            "(1 tensor(s) differ: 0.weight), so the model is not served") in err
    assert "does not compute what was recorded" not in err
    model = net()
    with torch.no_grad():
        model[2].bias[0] += 1.0  # moves every output
    moved = setup["root"] / "moved.pt"
    torchverity.save(model.state_dict(), moved)
    code, err = serve(moved)
    assert code == 1 and "no longer reproduces its golden outputs" in err
    assert "weights are not the recorded ones (1 tensor(s) differ: 2.bias)" in err
    assert (f"torchverity golden check --model tv_golden_models:net --weights {moved} "
            f"--golden {setup['golden']}") in err
    assert f"torchverity verify {moved}" in err
    assert "MODULE:CALLABLE" not in err and "CKPT" not in err


def test_a_record_without_a_weights_fingerprint_is_said_to_check_outputs_only(
        setup: dict[str, Path], run_cli) -> None:
    """A record of a plain callable holds no weights fingerprint: a check that passes on its
    outputs says the weights were not compared, with the command that records them."""
    from tv_golden_models import net  # type: ignore[import-not-found]

    model = net().eval()
    bare = setup["root"] / "bare.json"
    golden.record(lambda x: model(x), torch.load(setup["root"] / "x.pt"), bare)
    base = ("golden", "check", "--model", "tv_golden_models:net", "--weights", setup["bad"])
    passed = run_cli(*base, "--golden", bare)
    assert passed.code == 0  # the outputs match: the weight change is out of the inputs' reach
    assert "the record holds no weights fingerprint, so the weights were not compared" \
        in passed.err, passed.err
    assert f"torchverity golden record --model tv_golden_models:net --weights {setup['bad']}" \
        in passed.err
    recorded = run_cli(*base[:-2], "--weights", setup["good"], "--golden", setup["golden"])
    assert recorded.code == 0 and "fingerprint" not in recorded.err, recorded.err
    refused = run_cli(*base, "--golden", bare, "--check-weights")
    assert refused.code == 2 and "torchverity golden record ..." not in refused.err


def test_batch_says_the_weights_failed_and_which_checkpoint_to_look_at(
        setup: dict[str, Path], run_cli) -> None:
    inputs = setup["root"] / "in"
    inputs.mkdir()
    (inputs / "a.txt").write_text("a")
    base = ("batch", "run", "--inputs", inputs, "--model", "tv_golden_models:build",
            "--golden", setup["golden"])
    assert run_cli(*base, "--weights", setup["good"], "--out", setup["root"] / "ok").code == 0
    bad = run_cli(*base, "--weights", setup["bad"], "--out", setup["root"] / "bad")
    assert bad.code == 1
    assert ("failed its golden check before the first item: the outputs match the record, "
            "but the weights are not the recorded ones (1 tensor(s) differ: 0.weight)") \
        in bad.err, bad.err
    assert f"torchverity inspect {setup['bad']}" in bad.err
    assert "golden check --golden" not in bad.err and "selftest" not in bad.err


def test_tensors_on_one_side_only_are_told_from_changed_ones(setup: dict[str, Path]) -> None:
    """A model with a layer the recorded one lacked is another model, not changed weights."""
    from tv_golden_models import net  # type: ignore[import-not-found]

    model = net().eval()
    torchverity.load(setup["good"], model=model)
    model.register_buffer("extra_scale", torch.ones(2))  # unused by forward: outputs match
    result = golden.check(model, setup["golden"])
    assert not result.ok and result.parts == ["weights"]
    message = result.failures[0].message
    assert "1 not in the record (extra_scale)" in message, message
    assert "changed (" not in message
