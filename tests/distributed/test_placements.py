"""The placement logic of the distributed checks, in one process (no process group).

Which ranks a tensor is compared across, that shards are never compared with
other shards, when a vote is too unclear to heal from, and that full-tensor
digests add up from shards at their global positions.
"""

from __future__ import annotations

from typing import Any

import pytest


def _hsdp_layout() -> Any:
    from torchverity.distributed._placements import Layout

    # rank = 2 * replicate + shard, as init_device_mesh("cpu", (2, 2)) lays it out
    return Layout((0, 1, 2, 3), ("replicate", "shard"), ((0, 0), (0, 1), (1, 0), (1, 1)))


def test_replica_groups_follow_the_non_replicated_mesh_dimensions() -> None:
    from torchverity.distributed._placements import shard_label

    layout = _hsdp_layout()
    assert layout.replica_groups(()) == ((0, 1, 2, 3),)
    assert layout.replica_groups(("shard",)) == ((0, 2), (1, 3))
    assert layout.replica_groups(("replicate",)) == ((0, 1), (2, 3))
    assert layout.replica_groups(("replicate", "shard")) == ((0,), (1,), (2,), (3,))
    assert shard_label(layout, ("shard",), (1, 3)) == "shard (shard=1)"
    assert shard_label(layout, (), (0, 1, 2, 3)) == ""
    assert layout.where(3) == "replicate=1, shard=1"


def test_shards_are_never_compared_with_other_shards() -> None:
    import torch

    from torchverity.distributed._checks import _vote_placed

    # Tensor "w" is sharded on "shard": ranks 0/2 hold shard 0, ranks 1/3 shard 1 (other bytes).
    # Tensor "step" is plain: all four ranks hold it.
    rows = [[[10, 10], [7, 7]], [[20, 20], [7, 7]], [[10, 10], [7, 7]], [[20, 20], [7, 7]]]
    gathered = torch.tensor(rows)
    found, compared = _vote_placed(_hsdp_layout(), ["w", "step"], [("shard",), ()], gathered)
    assert found == () and compared == 2
    gathered[3, 0] = torch.tensor([21, 20])  # rank 3's copy of shard 1 differs from rank 1's
    gathered[2, 1] = torch.tensor([8, 7])  # rank 2's step differs from the other three
    found, _ = _vote_placed(_hsdp_layout(), ["w", "step"], [("shard",), ()], gathered)
    assert [(d.name, d.shard, d.replicas, d.odd_ranks) for d in found] == [
        ("w", "shard (shard=1)", (1, 3), ()),
        ("step", "", (0, 1, 2, 3), (2,)),
    ]


def test_unclear_votes_are_refused_and_pairs_ask_for_a_third_opinion() -> None:
    from torchverity.distributed._checks import ReplicaCheckResult, TensorDisagreement
    from torchverity.distributed._repair import _unclear

    coords = ((0, "r=0"), (1, "r=1"), (2, "r=2"))
    pair = TensorDisagreement("w", ((0,), (1,)), (), "shard (s=0)", (0, 1))
    three = TensorDisagreement("w", ((0,), (1,), (2,)), (), "shard (s=0)", (0, 1, 2))
    clear = TensorDisagreement("w", ((0, 1), (2,)), (2,), "shard (s=0)", (0, 1, 2))

    def result(*ds: TensorDisagreement) -> ReplicaCheckResult:
        return ReplicaCheckResult("parameters", 0, (0, 1, 2), 1, 0, ds, coordinates=coords)

    assert _unclear(result(pair)) == "w shard (s=0) has only 2 replicas"
    assert _unclear(result(three)) == "no strict majority for w shard (s=0)"
    assert _unclear(result(clear)) is None
    assert "third opinion" in result(pair).summary()
    assert "third opinion" not in result(three).summary()
    assert result(clear).summary() == (
        "parameters differ between replicas: rank 2 (r=2) disagrees with the majority of 3 "
        "replicas of w shard (s=0) (ranks 0, 1, 2)")


def test_full_tensor_sums_add_up_from_shards_at_their_global_positions() -> None:
    import torch

    from torchverity.distributed._fullsums import _partial_sums

    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.float64):
        full = (torch.randn(6, 10) * 50).to(dtype)
        whole = _partial_sums(full, [6, 10], [0, 0])
        cols = [_partial_sums(full[:, a:b].contiguous(), [6, 10], [0, a])
                for a, b in ((0, 3), (3, 7), (7, 10))]
        rows = [_partial_sums(full[a:b].contiguous(), [6, 10], [a, 0]) for a, b in ((0, 4), (4, 6))]
        assert torch.equal(sum(cols), whole) and torch.equal(sum(rows), whole)
        flipped = full.clone()
        flipped.view(-1)[13:14].view(torch.uint8)[0] ^= 1
        assert not torch.equal(_partial_sums(flipped, [6, 10], [0, 0]), whole)
    # Two elements swapped between positions give different sums.
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    swapped = t.clone()
    swapped[0, 0], swapped[2, 3] = t[2, 3], t[0, 0]
    assert not torch.equal(_partial_sums(t, [3, 4], [0, 0]),
                           _partial_sums(swapped, [3, 4], [0, 0]))


def test_heal_policy_rejects_bad_settings() -> None:
    import torch

    import torchverity.distributed as tvd
    from torchverity.errors import UsageError

    with pytest.raises(UsageError, match="every must be >= 1"):
        tvd.HealPolicy(torch.nn.Linear(2, 2), every=0)
    with pytest.raises(UsageError, match="on_unclear 'stop' or 'rollback'"):
        tvd.HealPolicy(torch.nn.Linear(2, 2), on_unclear="retry")  # type: ignore[arg-type]


def test_a_clear_majority_points_to_the_repair() -> None:
    from torchverity.distributed._checks import ReplicaCheckResult, TensorDisagreement
    from torchverity.errors import ReplicaMismatchError

    clear = TensorDisagreement("w", ((0, 1), (2,)), (2,), "", (0, 1, 2))
    pair = TensorDisagreement("w", ((0,), (1,)), (), "", (0, 1))
    with pytest.raises(ReplicaMismatchError) as caught:
        ReplicaCheckResult("parameters", 0, (0, 1, 2), 1, 0, (clear,)).raise_if_failed()
    assert "repair_replicas(model, optimizer, result)" in str(caught.value.hint)
    with pytest.raises(ReplicaMismatchError) as caught:
        ReplicaCheckResult("parameters", 0, (0, 1), 1, 0, (pair,)).raise_if_failed()
    assert "repair_replicas" not in str(caught.value.hint)
