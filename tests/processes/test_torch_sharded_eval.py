"""Exact sharded evaluation on real gloo process groups of 1, 2 and 3 ranks.

A 1001-sample validation set is split into strided, unpadded shards (334/334/333 for 3 ranks,
uneven last batches); every metric must equal the single-process value computed directly with
numpy / scikit-learn on the whole set, to 1e-9, on every rank alike.
"""

from __future__ import annotations

import multiprocessing
import pickle

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp


class _Worker:
    """tests/sharded_eval_worker.py, imported on first use: it imports torchmetrics and scikit-learn, seconds
    of every pytest worker's collection while one runs these tests."""

    def __getattr__(self, name: str):
        import sharded_eval_worker

        return getattr(sharded_eval_worker, name)


worker = _Worker()


def roc_auc_score(labels, scores) -> float:
    from sklearn.metrics import roc_auc_score as auc

    return auc(labels, scores)


pytestmark = pytest.mark.timeout(120)

TOL = 1e-9
PRELOAD = ["torch", "torch.distributed", "sklearn.metrics", "torchmetrics.classification", "cadence.torch"]


def _start(world_size: int, tmp: str) -> list[dict]:
    # forkserver: a clean server process imports torch, sklearn, torchmetrics and cadence once, then
    # forks the ranks of every world size from it (spawn would import them in each of the 6
    # processes; fork would copy this test process, threads and all). Only modules importable
    # without tests/ on sys.path: Python 3.11's forkserver does not pass sys.path to the server.
    multiprocessing.set_forkserver_preload(PRELOAD)
    mp.start_processes(worker.run, args=(world_size, f"{tmp}/rendezvous", tmp), nprocs=world_size,
                       start_method="forkserver", join=True)
    ranks = []
    for r in range(world_size):
        with open(f"{tmp}/rank{r}.pkl", "rb") as f:
            ranks.append(pickle.load(f))
    return ranks


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"world{n}")
def world(request, tmp_path_factory):
    """(world_size, [results of each rank]): one process group per world size, all scenarios in it."""
    n = request.param
    return n, _start(n, str(tmp_path_factory.mktemp(f"world{n}")))


@pytest.fixture(scope="module")
def expected():
    return expected_of(worker.N)


def expected_of(n: int) -> dict:
    """The metrics of one process over the first ``n`` samples."""
    x, y = (t[:n] for t in worker.make_data().tensors)
    with torch.no_grad():
        logits = worker.make_model()(x).squeeze(1).numpy()
    y = y.numpy()
    scores = 1.0 / (1.0 + np.exp(-logits))
    correct = (scores > 0.5).astype(np.int64) == y
    loss = np.logaddexp(0.0, logits) - y * logits
    return {
        "accuracy": correct.mean(),
        "loss": loss.mean(),
        "acc_mean": correct.mean(),
        "acc_per_sample": correct.mean(),
        "auc": roc_auc_score(y, scores),
        "auc_fn": roc_auc_score(y, scores),
        "auc_plain_fn": roc_auc_score(y, scores),
        "max_score": scores.max(),
        "min_score": scores.min(),
        "positives": float(y.sum()),
        "median": float(np.sort(scores)[(len(scores) - 1) // 2]),  # torch.median: the lower middle
        "count": len(scores),
    }


def ok(result):
    assert result[0] == "ok", result[-1]
    return result[1]


def test_shards_are_uneven_and_cover_the_set_once():
    sizes = {w: [len(worker.shard(range(worker.N), r, w)) for r in range(w)] for w in (1, 2, 3)}
    assert sizes == {1: [1001], 2: [501, 500], 3: [334, 334, 333]}
    assert sorted(i for r in range(3) for i in worker.shard(range(worker.N), r, 3)) == list(range(worker.N))


def test_metrics_equal_single_process_values(world, expected):
    n, ranks = world
    logs = ok(ranks[0]["metrics"])
    names = [k for k in expected if k not in ("median", "count")]
    assert set(logs) >= set(names) and "logits" not in logs
    for name in names:
        assert abs(logs[name] - expected[name]) <= TOL, (n, name, logs[name], expected[name])
    assert logs["positives"] == expected["positives"]  # counts are exact


def test_every_rank_returns_the_same_dict(world):
    n, ranks = world
    assert len(ranks) == n
    for scenario in ("metrics", "twice", "limited", "merged_aggregate", "after_errors"):
        results = [ok(r[scenario]) for r in ranks]
        assert all(res == results[0] for res in results), scenario


def test_reducers_are_fresh_for_each_evaluation(world):
    _, ranks = world
    first, second = ok(ranks[0]["twice"])
    assert first == second == ok(ranks[0]["metrics"])
    assert ok(ranks[0]["after_errors"]) == first


def test_num_steps_limits_each_ranks_batches(world, expected):
    n, ranks = world
    logs = ok(ranks[0]["limited"])
    # each rank evaluates its first 2 batches of 64: 128 samples per rank
    x, y = worker.make_data().tensors
    idx = np.concatenate([np.arange(r, worker.N, n)[: 2 * worker.BATCH] for r in range(n)])
    with torch.no_grad():
        scores = torch.sigmoid(worker.make_model()(x[idx]).squeeze(1)).numpy()
    correct = (scores > 0.5).astype(np.int64) == y[idx].numpy()
    assert abs(logs["accuracy"] - correct.mean()) <= TOL and abs(logs["acc_mean"] - correct.mean()) <= TOL
    assert abs(logs["auc"] - roc_auc_score(y[idx].numpy(), scores)) <= TOL


def test_torchmetrics_metric_gives_the_same_value(world, expected):
    pytest.importorskip("torchmetrics")
    n, ranks = world
    logs = ok(ranks[0]["metrics"])
    assert abs(logs["tm_auroc"] - expected["auc"]) <= 1e-6, (n, logs["tm_auroc"], expected["auc"])
    assert abs(logs["tm_accuracy"] - expected["accuracy"]) <= 1e-6


def test_aggregate_logs_merged_across_ranks(world, expected):
    _, ranks = world
    logs = ok(ranks[0]["merged_aggregate"])
    assert logs["count"] == expected["count"]
    assert abs(logs["median"] - expected["median"]) <= TOL
    assert abs(logs["accuracy"] - expected["accuracy"]) <= TOL  # plain scalars alongside


def test_named_splits_are_each_exact_over_uneven_shards(world, expected):
    n, ranks = world
    logs = ok(ranks[0]["named_splits"])
    assert list(logs) == ["all", "head"] and all(ok(r["named_splits"]) == logs for r in ranks)
    for split, want in (("all", expected), ("head", expected_of(worker.HEAD))):
        got = logs[split]
        assert got["count"] == want["count"] and got["positives"] == want["positives"], (n, split)
        for name in ("accuracy", "loss", "acc_mean", "auc", "max_score", "min_score", "median"):
            assert abs(got[name] - want[name]) <= TOL, (n, split, name, got[name], want[name])


def test_aggregate_logs_without_merge_is_a_clear_error(world, expected):
    n, ranks = world
    if n == 1:  # one process: no merge needed
        logs = ok(ranks[0]["unmerged_aggregate"])
        assert logs["count"] == expected["count"]
        return
    for r in ranks:
        status, kind, message, _ = r["unmerged_aggregate"]
        assert (status, kind) == ("error", "TypeError")
        assert "merge_aggregated_logs" in message and "build_metrics()" in message and f"over {n} processes" in message


def test_an_error_on_one_rank_is_raised_on_every_rank(world):
    n, ranks = world
    if n == 1:
        pytest.skip("needs two ranks")
    status, kind, message, _ = ranks[1]["failing_rank"]
    assert (status, kind, message) == ("error", "ValueError", "bad batch on rank 1")
    for r in [ranks[0], *ranks[2:]]:
        status, kind, message, _ = r["failing_rank"]
        assert (status, kind) == ("error", "RuntimeError")
        assert "failed on rank(s) 1 (ValueError: bad batch on rank 1)" in message


# -- in process: the evaluator's handling of build_metrics (no process group) ------------------------


class FakeMetric(torch.nn.Module):
    """Duck-typed like a torchmetrics.Metric: update / compute / reset on an nn.Module."""

    def __init__(self):
        super().__init__()
        self.seen: list = []

    def update(self, *args, **kwargs):
        self.seen.append((args, kwargs))

    def compute(self):
        return torch.tensor(float(len(self.seen)))

    def reset(self):
        self.seen = []


class TwoRanks:
    """A coordinator that says world_size=2 (no collective may be reached in these tests)."""

    rank, world_size, is_chief = 0, 2, True

    def all_gather(self, obj):
        raise AssertionError("no collective expected")


def _single(task, ctx=None):
    from cadence.torch import Context, TorchEvaluator

    return TorchEvaluator(task, task.build_model(), ctx=ctx or Context())


def test_reducer_keys_are_not_batch_averaged_and_reducers_are_reset():
    from cadence.metrics import Sum

    shared = Sum()  # handed back on every call: the evaluator resets it

    class Task(worker.ShardedTask):
        def build_metrics(self):
            return {"positives": shared, "tm_auroc": FakeMetric()}

    ev = _single(Task())
    first = ev.evaluate()
    assert first == ev.evaluate()
    assert first["positives"] == 508.0  # a plain average would be 508 / 1001
    batches = -(-worker.N // worker.BATCH)
    assert first["tm_auroc"] == batches and type(first["tm_auroc"]) is float  # a 1-element tensor as a number
    assert ev.evaluate(0) == {}  # no batch: no reducer values either


def test_torchmetrics_reducer_forms():
    from cadence.metrics import MetricReducer
    from cadence.torch import TorchMetricsReducer

    m = FakeMetric()
    r = TorchMetricsReducer(m)
    assert isinstance(r, MetricReducer) and TorchMetricsReducer(r).metric is m
    r.update((1, 2))
    r.update({"preds": 3})
    r.update(torch.zeros(2))
    assert [a for a, _ in m.seen[:1]] == [(1, 2)] and m.seen[1] == ((), {"preds": 3})
    assert r.per_slot_reduce() is None and r.cross_slot_reduce([None]) == 3.0
    r.reset()
    assert m.seen == []
    with pytest.raises(TypeError, match="needs a torchmetrics.Metric"):
        TorchMetricsReducer(object())


def test_bad_build_metrics_are_clear_errors():
    from cadence.metrics import Max

    cases = [
        ([Max()], r"build_metrics\(\) must return a dict"),
        ({"m": 3}, r"metric 'm' must be a cadence.metrics.MetricReducer"),
        ({"m": Max}, r"metric 'm' is the class Max, not a reducer: write Max\(\)"),
    ]
    for returned, message in cases:
        class Task(worker.ShardedTask):
            def build_metrics(self, returned=returned):
                return returned

        with pytest.raises(TypeError, match=message):
            _single(Task()).evaluate()


def test_aggregate_logs_without_merge_fails_before_any_collective():
    from cadence.torch import Context

    ctx = Context()
    ctx.coordinator = TwoRanks()
    with pytest.raises(TypeError, match=r"Define Aggregating.merge_aggregated_logs\(self, states\)"):
        _single(worker.Aggregating(), ctx).evaluate()
