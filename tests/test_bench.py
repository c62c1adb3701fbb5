"""``cacheblend bench``: data set loading, metrics, records and plots (tiny model, 1 prompt)."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
import torch

from cacheblend.bench.command import BASELINE
from cacheblend.bench.deviation import shift_profile, sparsity_profile
from cacheblend.bench.metrics import output_f1, p90, quality
from cacheblend.bench.stats import spearman
from cacheblend.bench.tasks import TASKS, load_task
from cacheblend.cli import app
from cacheblend.datasets import DataNotFoundError
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
    # the same answer made of an article or a full stop alone normalises to no tokens: it
    # scored 0 against itself (90 of 218 prompts of a one-token study)
    assert output_f1("The", "The") == output_f1(" .", ".") == 1.0 and output_f1("The", ".") == 0.0
    assert [p90(list(range(n))) for n in (2, 4, 5, 8, 10, 100)] == [1, 3, 4, 7, 8, 89]  # nearest rank
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
    assert spearman(list(range(10)), list(range(10))) == pytest.approx(1.0)


def test_shift_profile_is_the_share_of_the_chunk_mean():
    shared = torch.ones(2, 1, 3, 4).expand(2, 1, 3, 4).clone()  # every token of the chunk: the same error
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0])[None, None, :, None]
    centred = torch.ones(2, 1, 4, 4) * signs  # the errors cancel: no shift
    half = shared[:, :, :2] + torch.tensor([1.0, -1.0])[None, None, :, None]  # mean 1, spread 1: half
    prof = shift_profile([[(shared, centred)], [(half, half)]])
    assert prof["shift_share_k"] == [pytest.approx((1.0 + 0.5) / 2)]
    assert prof["shift_share_v"] == [pytest.approx((0.0 + 0.5) / 2)]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, default_model_dir):
    return make_tiny_model(tmp_path_factory.mktemp("bench-tiny"), "llama", default_model_dir)


def test_bench_writes_records_and_plots(tiny_folder, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = app(["bench", "--model", str(tiny_folder), "--dataset", "hotpotqa,samsum", "--limit", "1",
              "--chunks", "2,3", "--ratios", "0.15,1.0", "--deviation", "1", "--answer-tokens", "8",
              "--json", str(out),
              "--plots", str(tmp_path / "plots")])
    assert rc == 0
    report = json.loads(out.read_text())
    recs = report["records"]
    assert {r["variant"] for r in recs} == {"full", "prefix", "reuse", "blend@0.15", "blend@1"}
    assert len(recs) == 2 * 2 * 5  # data sets x chunk counts x variants
    fields = {"method", "recompute_ratio", "ttft_median_s", "ttft_p90_s", "quality", "first_token_agreement",
              "kl_first_token", "output_f1_vs_full", "store_hit_rate", "chunks", "dataset"}
    fields |= {"answer_tokens", "decode_ms_per_token", "answer_total_median_s", "peak_rss_mib", "rss_growth_mib"}
    assert all(fields <= set(r) for r in recs)
    for r in recs:  # end to end: exactly 8 tokens each; the total holds the first token and 7 decode steps
        assert r["answer_tokens"] == 8 and r["decode_ms_per_token"] > 0 and r["peak_rss_mib"] > 100
        assert r["answer_total_median_s"] > r["answer_ttft_median_s"]
    for r in recs:
        if r["variant"] in ("full", "blend@1", "prefix"):  # exact methods reproduce full prefill
            assert r["first_token_agreement"] == 1.0 and r["output_f1_vs_full"] == 1.0
            assert r["kl_first_token"] == pytest.approx(0.0, abs=1e-4)
        if r["method"] in ("reuse", "blend", "prefix"):
            assert r["store_hit_rate"] == 1.0
    assert report["deviation"]["prompts"] == 1
    shift = report["deviation"]["shift_share_k"] + report["deviation"]["shift_share_v"]
    assert len(shift) == 2 * len(report["deviation"]["layers"]) and all(0.0 <= x <= 1.0 for x in shift)
    for name in ("ttft_vs_chunks.png", "total_vs_chunks.png", "quality_vs_ratio.png", "deviation_sparsity.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 10_000
    assert "blend@0.15" in capsys.readouterr().out


def test_bench_rejects_bad_options(tiny_folder):
    with pytest.raises(SystemExit, match="unknown data set"):
        app(["bench", "--model", str(tiny_folder), "--dataset", "squad", "--plots", ""])
    with pytest.raises(SystemExit, match="unknown methods"):
        app(["bench", "--model", str(tiny_folder), "--methods", "full,turbo", "--plots", ""])


def test_data_directory_is_given_never_guessed(monkeypatch, tmp_path):
    """Installed code finds the data only where it is told: ``data=`` / ``--data``, else
    $CACHEBLEND_DATA; a missing directory or file is an error naming how to fix it."""
    data = os.environ["CACHEBLEND_DATA"]  # the Makefile's (or conftest's) ../shared/data
    monkeypatch.delenv("CACHEBLEND_DATA")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataNotFoundError, match="no data directory: pass --data DIR or set CACHEBLEND_DATA"):
        load_task("musique", "dev", 1, 2)
    with pytest.raises(DataNotFoundError, match=re.escape(str(tmp_path / "samsum.jsonl"))):
        load_task("samsum", "dev", 1, 2, data=tmp_path)
    with pytest.raises(FileNotFoundError, match="is not a directory"):  # a DataNotFoundError is both
        load_task("musique", "dev", 1, 2, data=tmp_path / "nowhere")
    _, examples = load_task("musique", "dev", 1, 2, data=data)
    assert len(examples) == 1 and len(examples[0].passages) == 2
    monkeypatch.setenv("CACHEBLEND_DATA", data)
    assert load_task("musique", "dev", 1, 2)[1] == examples
    with pytest.raises(SystemExit, match="no such data file: .*samsum.jsonl"):
        app(["bench", "--dataset", "samsum", "--data", str(tmp_path), "--plots", ""])


def test_bench_peer_needs_a_vllm_python(monkeypatch, tmp_path):
    monkeypatch.delenv("CACHEBLEND_VLLM_PYTHON", raising=False)
    with pytest.raises(SystemExit, match="pass --vllm-python PATH or set CACHEBLEND_VLLM_PYTHON"):
        app(["bench", "--peers", "vllm", "--plots", ""])
    with pytest.raises(SystemExit, match=f"vLLM interpreter {re.escape(str(tmp_path / 'py'))} .* does not exist"):
        app(["bench", "--peers", "vllm", "--vllm-python", str(tmp_path / "py"), "--plots", ""])


_STAND_IN = f"#!{sys.executable}\n" + '''import json, sys
args = sys.argv[1:]
assert args[:2] == ["-m", "cacheblend.bench.vllm_peer"], args
spec = json.load(open(args[2]))
open(sys.argv[0] + ".dtype", "w").write(spec["dtype"])  # what the peer was asked to compute in
if "--serve" in args:  # interleaved: a prompt per line in, a marked line out, vLLM-like log lines around it
    print('@@cacheblend-peer {"ready": true}', flush=True)
    for n, line in enumerate(sys.stdin):
        p = json.loads(line)
        assert p["ids"] and p["warm"] == p["ids"][:len(p["warm"])], p
        if n >= DIE_AFTER:
            sys.exit(3)
        print("INFO vllm says something", flush=True)
        print("@@cacheblend-peer " + json.dumps({"id": p["id"], "method": "vllm_full", "ttft_s": 0.01,
                                                 "first_token": -1}), flush=True)
    sys.exit(0)
assert args[args.index("--methods") + 1] == "vllm_apc", args
recs = [{"id": p["id"], "method": "vllm_apc", "ttft_s": 0.02, "first_token": -1} for p in spec["prompts"]]
json.dump({"peer": "stand-in", "records": recs}, open(args[args.index("--out") + 1], "w"))
'''


def _bench_with_stand_in(tiny_folder, tmp_path, die_after: int, *more: str) -> dict:
    fake = tmp_path / "python"
    fake.write_text(_STAND_IN.replace("DIE_AFTER", str(die_after)))
    fake.chmod(0o755)
    out = tmp_path / "bench.json"
    rc = app(["bench", "--model", str(tiny_folder), "--dataset", "hotpotqa", "--limit", "2", "--chunks", "2",
              "--methods", "full", "--answer-tokens", "0", "--peers", "vllm", "--vllm-python", str(fake),
              "--json", str(out), "--plots", "", *more])
    assert rc == 0
    return json.loads(out.read_text())


def test_bench_runs_the_vllm_peer_with_the_given_python(tiny_folder, tmp_path, capfd):
    """``--peers vllm`` keeps ``PYTHON -m cacheblend.bench.vllm_peer SPEC --serve`` running and
    sends it each prompt right after our methods ran it (vLLM's full prefill and ours are timed
    in the same minute); prefix caching runs afterwards in one batch.  The records merge, and
    the peer's own log lines pass through to stderr."""
    report = _bench_with_stand_in(tiny_folder, tmp_path, die_after=99)
    assert "peer_error" not in report
    peers = {r["variant"]: r for r in report["records"] if r.get("peer")}
    assert set(peers) == {"vllm_full", "vllm_apc"} and peers["vllm_full"]["peer"] == "stand-in"
    assert peers["vllm_full"]["interleaved"] and not peers["vllm_apc"]["interleaved"]
    assert peers["vllm_full"]["first_token_agreement"] == 0.0 and peers["vllm_full"]["examples"] == 2
    assert "INFO vllm says something" in capfd.readouterr().err


def test_a_peer_that_dies_leaves_our_records_standing(tiny_folder, tmp_path):
    report = _bench_with_stand_in(tiny_folder, tmp_path, die_after=1)
    assert "vllm peer failed at hotpotqa/2/hotpotqa-1" in report["peer_error"]
    assert "exited with code 3" in report["peer_error"]
    assert [r["variant"] for r in report["records"]] == ["full"] and report["records"][0]["examples"] == 2


def test_fidelity_study_reports_intervals_and_paired_differences(tiny_folder, tmp_path, capsys):
    out = tmp_path / "study.json"
    rc = app(["bench", "--model", str(tiny_folder), "--fidelity-only", "--dataset", "hotpotqa,samsum",
              "--limit", "2", "--chunks", "2", "--max-new-tokens", "3",
              "--variants", "reuse;blend@1.0;blend@guard:max_risk=0",
              "--json", str(out), "--plots", str(tmp_path / "plots")])
    assert rc == 0
    report = json.loads(out.read_text())
    pooled = {r["variant"]: r for r in report["study"]["all"]}
    assert set(pooled) == {"reuse", "blend@1.0", "blend@guard:max_risk=0", report["study"]["baselines"][0]}
    for name in ("blend@1.0", "blend@guard:max_risk=0"):  # exact: full prefill's answers, interval [1, 1]
        r = pooled[name]
        assert r["prompts"] == 4 and r["agree"] == {"mean": 1.0, "low": 1.0, "high": 1.0, "n": 4}
        assert r["kl"]["high"] == pytest.approx(0.0, abs=1e-4) and r["exact"] == 1.0
    assert pooled["blend@guard:max_risk=0"]["escalated"] == 1.0
    vs = pooled["reuse"]["vs"][report["study"]["baselines"][0]]
    assert vs["kl"]["low"] <= vs["kl"]["mean"] <= vs["kl"]["high"]
    assert len(report["samples"]) == 4 * 5  # prompts x (full + 4 variants)
    assert (tmp_path / "plots" / "fidelity_frontier.png").stat().st_size > 10_000
    assert "paired differences" in capsys.readouterr().out


def test_fidelity_study_skips_to_fresh_prompts(tiny_folder, tmp_path):
    """--skip N starts after the first N examples of each data set (a confirmation run on
    prompts the exploration did not see); samples keep the examples' own indices."""
    out = tmp_path / "study.json"
    rc = app(["bench", "--model", str(tiny_folder), "--fidelity-only", "--dataset", "hotpotqa", "--skip", "3",
              "--limit", "2", "--chunks", "2", "--max-new-tokens", "2", "--variants", "blend@0.2:selection=probe",
              "--json", str(out), "--plots", ""])
    assert rc == 0
    samples = json.loads(out.read_text())["samples"]
    assert sorted({s["example"] for s in samples}) == [3, 4]
    assert {s["variant"] for s in samples} == {"full", "blend@0.2:selection=probe", BASELINE}


def test_a_prompt_over_the_context_is_skipped_not_fatal(tiny_folder, tmp_path):
    """A prompt that does not fit the model's context (the tiny model's 1,024 tokens; a
    long multi_news article did this to SmolLM2's 8,192) is listed as skipped, and the
    study goes on with the rest; it used to end the whole run with an error."""
    out = tmp_path / "study.json"
    rc = app(["bench", "--model", str(tiny_folder), "--fidelity-only", "--dataset", "multi_news,hotpotqa",
              "--limit", "1", "--chunks", "2", "--max-new-tokens", "2", "--variants", "reuse",
              "--json", str(out), "--plots", ""])
    assert rc == 0
    report = json.loads(out.read_text())
    [skipped] = report["study"]["skipped"]
    assert (skipped["dataset"], skipped["example"]) == ("multi_news", 0) and skipped["tokens"] > 1024
    assert {s["dataset"] for s in report["samples"]} == {"hotpotqa"}


def test_fidelity_study_takes_a_system_message(tiny_folder, tmp_path):
    """--system puts a system message into every prompt (the frame a chunk sink may differ
    from): the study records it, and full prefill's answers change with it."""
    kl = {}
    for system in (None, "You answer from the passages, briefly."):
        out = tmp_path / f"study-{system is None}.json"
        rc = app(["bench", "--model", str(tiny_folder), "--fidelity-only", "--dataset", "hotpotqa", "--limit", "2",
                  "--chunks", "2", "--max-new-tokens", "2", "--variants", "reuse", "--json", str(out), "--plots", ""]
                 + (["--system", system] if system else []))
        assert rc == 0
        report = json.loads(out.read_text())
        assert report["study"]["system"] == system
        kl[system] = [s["kl"] for s in report["samples"] if s["variant"] == "reuse"]
    assert kl[None] != kl["You answer from the passages, briefly."]
    with pytest.raises(SystemExit, match="--system goes with --fidelity-only"):
        app(["bench", "--model", str(tiny_folder), "--system", "hi"])


def test_fidelity_study_rejects_bad_variants(tiny_folder):
    with pytest.raises(SystemExit, match="not field=value"):
        app(["bench", "--model", str(tiny_folder), "--fidelity-only", "--variants", "blend@0.1:colour=red"])


def test_the_vllm_peer_computes_in_the_engine_dtype(tiny_folder, tmp_path):
    """A bfloat16 engine against a float32 vLLM would measure the dtype, not the method."""
    report = _bench_with_stand_in(tiny_folder, tmp_path, 99, "--dtype", "bfloat16")
    assert (tmp_path / "python.dtype").read_text() == "bfloat16"
    assert {r["dtype"] for r in report["records"]} == {"bfloat16"}
    report = _bench_with_stand_in(tiny_folder, tmp_path, 99)
    assert (tmp_path / "python.dtype").read_text() == "float32"


@pytest.mark.parametrize("kernel", [True, False], ids=["VmHWM", "sampler"])
def test_peak_rss_sees_a_freed_allocation_and_starts_again(monkeypatch, tmp_path, kernel):
    """The answer's peak memory: an allocation freed inside the block still counts, and the
    next block starts from the current resident set (the kernel's peak is reset), not from
    the earlier peak."""
    import mmap
    import time

    from cacheblend.bench.latency import PeakRSS

    if not kernel:
        monkeypatch.setattr(PeakRSS, "CLEAR", tmp_path / "absent" / "clear_refs")
    mib = 1024 * 1024
    with PeakRSS() as first:
        # fresh pages from the kernel, written so they are resident: a bytearray could reuse
        # free heap memory that is already resident after earlier tests (and failed so in CI)
        block = mmap.mmap(-1, 300 * mib)
        for i in range(0, 300 * mib, mmap.PAGESIZE):
            block[i] = 1
        time.sleep(0.05)  # the sampler's interval is 5 ms
        block.close()
    assert first.peak - first.before >= 250 * mib
    with PeakRSS() as second:
        pass
    assert second.peak - second.before < 50 * mib


def test_the_default_baseline_is_the_papers_selection():
    """The baseline inherited the check pool (the default since 2026-12-06): it ranked only
    the top half of chunk tokens by the stored hint, under the paper's name."""
    from cacheblend.bench.command import BASELINE
    from cacheblend.bench.fidelity import parse_spec
    from cacheblend.config import RequestOptions

    blend = RequestOptions.parse(parse_spec(BASELINE).options).blend(30)
    assert (blend.selection, blend.check_pool, blend.chunk_heads, blend.shift_share, blend.check_layers) == \
        ("deviation", 1.0, 0, 0.0, (1,))
