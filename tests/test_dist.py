"""dist: on one process every reduction is the identity and the shard is everything; on two processes (gloo) sums,
max / min and integer counts equal the same reduction done in one process, a broadcast gives rank 0's values, and the
shards cover every item once; `init_distributed` joins only the group the environment describes."""
import os

import pytest
import torch

from entropy_grpo.dist import (all_reduce_counts, all_reduce_extreme, all_reduce_sum, broadcast_, init_distributed,
                               rank, shard_slice, world_size)
from gloo import gloo_group, spawn_two

SIZES = (0, 1, 2, 7, 10)   # item counts to shard, fewer than, equal to and more than the ranks


def local_values(r):
    "Rank r's share: tensors of three dtypes and shapes, an extreme, and counts (with a key that is not summed)."
    g = torch.Generator().manual_seed(r)
    sums = [torch.randn(3, 4, generator=g), torch.arange(5) * (r + 1), torch.tensor(2.5 + r, dtype=torch.float64)]
    return dict(sums=sums,
                extreme=torch.randn(6, generator=g), counts=dict(kept=3 + r, changed=10 * r, note=f"rank {r}"))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_shard_slices_cover_every_item_once(n, ws):
    shards = [list(range(n))[shard_slice(n, ws, r)] for r in range(ws)]
    assert [i for s in shards for i in s] == list(range(n))                 # contiguous, in order, no item twice
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_one_process_is_the_identity():
    assert (world_size(), rank(), shard_slice(7)) == (1, 0, slice(0, 7))
    v = local_values(0)
    before = [t.clone() for t in v["sums"]]
    assert all_reduce_sum(v["sums"]) is v["sums"] and all(torch.equal(a, b) for a, b in zip(v["sums"], before))
    for op in ("max", "min"):
        t = v["extreme"].clone()
        assert all_reduce_extreme(t, op) is t and torch.equal(t, v["extreme"])
    assert all_reduce_counts(dict(v["counts"]), ["kept", "changed"]) == v["counts"]
    assert broadcast_(v["sums"]) is v["sums"] and all(torch.equal(a, b) for a, b in zip(v["sums"], before))


def test_init_distributed_joins_only_what_the_environment_describes(monkeypatch):
    for k in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"): monkeypatch.delenv(k, raising=False)
    assert init_distributed() is False and world_size() == 1             # no launcher: one process
    monkeypatch.setenv("WORLD_SIZE", "1"); assert init_distributed() is False
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE='two': expected a process count >= 1"): init_distributed()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2 but RANK, MASTER_ADDR, MASTER_PORT not set"):
        init_distributed()


def _worker(r, world, port, out_dir):
    os.environ.update(RANK=str(r), WORLD_SIZE=str(world))    # what torchrun sets (gloo_group sets MASTER_*)
    with gloo_group(r, world, port):
        joined = init_distributed()                          # already in the group: joins nothing twice
        v = local_values(r)
        b = broadcast_([v["extreme"].clone()])[0]
        sums = all_reduce_sum(v["sums"])
        mx, mn = all_reduce_extreme(v["extreme"].clone(), "max"), all_reduce_extreme(v["extreme"].clone(), "min")
        counts = all_reduce_counts(v["counts"], ["kept", "changed"])
        shards = {n: list(range(n))[shard_slice(n)] for n in SIZES}
        torch.save(dict(world=world_size(), rank=rank(), joined=joined, broadcast=b, sums=sums, max=mx, min=mn,
                        counts=counts, shards=shards),
                   os.path.join(out_dir, f"rank{r}.pt"))


def test_two_processes_equal_one_process(tmp_path):
    spawn_two(_worker, str(tmp_path))
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert [(g["world"], g["rank"], g["joined"]) for g in got] == [(2, 0, True), (2, 1, True)]
    a, b = local_values(0), local_values(1)
    for g in got:
        assert torch.equal(g["broadcast"], a["extreme"])                     # rank 0's values on both ranks
        for s, x, y in zip(g["sums"], a["sums"], b["sums"]):
            assert s.dtype == x.dtype and torch.equal(s, x + y)              # two addends: exact in the float64 buffer
        assert torch.equal(g["max"], torch.maximum(a["extreme"], b["extreme"]))
        assert torch.equal(g["min"], torch.minimum(a["extreme"], b["extreme"]))
        assert g["counts"] == dict(kept=7, changed=10, note=f"rank {g['rank']}")   # only the listed keys are summed
    for n in SIZES:
        assert got[0]["shards"][n] + got[1]["shards"][n] == list(range(n))
