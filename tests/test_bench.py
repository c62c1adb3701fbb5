"""``cacheblend bench``: data set loading, metrics, records and plots (tiny model, 1 prompt)."""

from __future__ import annotations

import json

import pytest
import torch

from cacheblend.bench.deviation import sparsity_profile, spearman
from cacheblend.bench.metrics import output_f1, quality
from cacheblend.bench.tasks import TASKS, load_task
from cacheblend.cli import app
from conftest import make_tiny_model


@pytest.mark.parametrize("name", list(TASKS))
def test_every_data_set_loads_both_splits_disjoint(name):
    task, dev = load_task(name, "dev", None, 4)
    _, test = load_task(name, "test", None, 4)
    assert dev and test and task.metric in ("f1", "rougeL")
    assert all(1 <= len(ex.passages) <= 4 and ex.answers and ex.query for ex in dev + test)
    keys = {ex.query + ex.passages[0] for ex in dev}
    assert not keys & {ex.query + ex.passages[0] for ex in test} or name == "multi_news"  # one query text
    if name == "multi_news":
        assert not {ex.answers[0] for ex in dev} & {ex.answers[0] for ex in test}


def test_metrics():
    assert quality("f1", "the Exeter College", ["Exeter College"]) == 1.0
    assert quality("rougeL", "Tom will buy milk", ["Tom buys milk today"]) > 0.5
    assert output_f1("", "") == 1.0 and output_f1("a b", "c d") == 0.0
    with pytest.raises(ValueError, match="unknown metric"):
        quality("bleu", "a", ["a"])


def test_sparsity_profile_of_a_known_pattern():
    d = torch.zeros(3, 100)
    d[1, :5] = 10.0  # layer 1: five tokens hold everything
    d[2, :5] = 5.0
    d[1:, 5:] = 0.01
    prof = sparsity_profile([d])
    assert prof["layers"] == [1, 2]
    assert prof["top_share"]["0.05"][0] > 0.95
    assert prof["rank_correlation_next_layer"][0] > 0.5
    assert spearman(torch.arange(10.0), torch.arange(10.0)) == pytest.approx(1.0)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, default_model_dir):
    return make_tiny_model(tmp_path_factory.mktemp("bench-tiny"), "llama", default_model_dir)


def test_bench_writes_records_and_plots(tiny_folder, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = app(["bench", "--model", str(tiny_folder), "--dataset", "hotpotqa,samsum", "--limit", "1",
              "--chunks", "2,3", "--ratios", "0.15,1.0", "--deviation", "1", "--json", str(out),
              "--plots", str(tmp_path / "plots")])
    assert rc == 0
    report = json.loads(out.read_text())
    recs = report["records"]
    assert {r["variant"] for r in recs} == {"full", "prefix", "reuse", "blend@0.15", "blend@1"}
    assert len(recs) == 2 * 2 * 5  # data sets x chunk counts x variants
    fields = {"method", "recompute_ratio", "ttft_median_s", "ttft_p90_s", "quality", "first_token_agreement",
              "kl_first_token", "output_f1_vs_full", "store_hit_rate", "chunks", "dataset"}
    assert all(fields <= set(r) for r in recs)
    for r in recs:
        if r["variant"] in ("full", "blend@1", "prefix"):  # exact methods reproduce full prefill
            assert r["first_token_agreement"] == 1.0 and r["output_f1_vs_full"] == 1.0
            assert r["kl_first_token"] == pytest.approx(0.0, abs=1e-4)
        if r["method"] in ("reuse", "blend", "prefix"):
            assert r["store_hit_rate"] == 1.0
    assert report["deviation"]["prompts"] == 1
    for name in ("ttft_vs_chunks.png", "quality_vs_ratio.png", "deviation_sparsity.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 10_000
    assert "blend@0.15" in capsys.readouterr().out


def test_bench_rejects_bad_options(tiny_folder):
    with pytest.raises(SystemExit, match="unknown data set"):
        app(["bench", "--model", str(tiny_folder), "--dataset", "squad", "--plots", ""])
    with pytest.raises(SystemExit, match="unknown methods"):
        app(["bench", "--model", str(tiny_folder), "--methods", "full,turbo", "--plots", ""])
