"""Latency percentiles: nearest rank, weighted by the items each latency stands for."""

from __future__ import annotations

import math

import pytest

from engine._core.report import LATENCY_SAMPLE, LatencyHistogram, VerifierReport, percentile


def test_percentile_by_nearest_rank() -> None:
    values = [0.5, 0.1, 0.4, 0.2, 0.3]
    assert [percentile(values, q) for q in (0, 20, 21, 50, 100)] == [0.1, 0.1, 0.2, 0.3, 0.5]
    assert math.isnan(percentile([], 50))


def test_percentile_weighted_by_items() -> None:
    # one chunk of 990 items at 1 ms each, and ten single calls of 500 ms
    values, weights = [0.5] * 10 + [0.001], [1] * 10 + [990]
    assert percentile(values, 50, weights) == 0.001
    assert percentile(values, 99, weights) == 0.001  # rank 990: the chunk's last item
    assert percentile(values, 99.1, weights) == 0.5
    assert percentile(values, 50) == 0.5  # unweighted, the single calls would be the median
    with pytest.raises(ValueError):
        percentile(values, 50, weights[:-1])


def test_histogram_counts_items() -> None:
    histogram = LatencyHistogram()
    histogram.extend([0.5, 0.001], [10, 990])
    histogram.add(0.002)
    assert sum(histogram.counts.values()) == 1001
    assert histogram.percentile(50) == pytest.approx(0.001, rel=0.025)
    assert histogram.percentile(99.5) == pytest.approx(0.5, rel=0.025)


def test_a_running_histogram_takes_a_thinned_sample_of_a_large_batchs_latencies() -> None:

    calls = 50 * LATENCY_SAMPLE + 7
    latencies = [0.001 * (1 + (i * 7919) % 1000) for i in range(calls)]  # 1..1000 ms, spread over the batch
    report = VerifierReport(kind="endpoint", ref="u", key="u", provenance={}, items=calls, latencies=latencies)
    sample, weights = report.latency_sample()
    assert len(sample) <= LATENCY_SAMPLE
    assert abs(sum(weights) - calls) <= 51  # each entry stands for the calls it was picked from
    histogram = LatencyHistogram()
    histogram.extend(sample, weights)
    for q in (50, 99):
        assert histogram.percentile(q) == pytest.approx(report.latency(q), rel=0.05)


def test_a_small_batchs_latencies_are_taken_whole() -> None:
    report = VerifierReport(kind="plugin", ref="r", key="k", provenance={}, items=30,
                            latencies=[0.1, 0.2, 0.3], latency_items=[10, 10, 10])
    assert report.latency_sample() == ([0.1, 0.2, 0.3], [10, 10, 10])


def test_totals_merge_adds_another_runs_figures_and_buckets() -> None:
    from engine._core.report import VerifierTotals

    one, two = VerifierTotals("plugin", "v:s"), VerifierTotals("plugin", "v:s")
    for totals, seconds, peak in ((one, 0.001, 3), (two, 0.002, 5)):
        totals.add(VerifierReport(kind="plugin", ref="v:s", key="k", provenance={}, items=2, reward_sum=1.5,
                                  latencies=[seconds], latency_items=[2], peak_in_flight=peak, retries=1))
    one.merge(VerifierTotals.from_json(two.to_json()))
    assert (one.items, one.reward_sum, one.retries, one.peak_in_flight) == (4, 3.0, 2, 5)
    assert sum(one.latency.counts.values()) == 4
    assert one.latency.percentile(100) == pytest.approx(0.002, rel=0.03)


# --- the one accumulator of figures (docs/design.md, "Figures") ---------------------------------------------


@pytest.mark.parametrize("weighted", [False, True], ids=["one-item-calls", "chunks"])
def test_a_thinned_sample_stands_for_every_item_exactly(weighted: bool) -> None:
    """Each kept latency stands for the items of the stride it was picked from: a histogram's counts add up to
    the batch's items, which ``engine bench`` shows bucket by bucket."""
    calls = 3 * LATENCY_SAMPLE + 5
    latencies = [0.001 * (1 + i % 10) for i in range(calls)]
    items = [1 + i % 4 for i in range(calls)] if weighted else []
    report = VerifierReport(kind="plugin", ref="r", key="k", provenance={}, items=sum(items) or calls,
                            latencies=latencies, latency_items=items)
    sample, weights = report.latency_sample()
    assert len(sample) == len(weights) <= LATENCY_SAMPLE
    assert sum(weights) == report.items


def test_totals_count_a_failed_batch_by_its_error_type_and_a_timeout_by_its_field() -> None:
    from engine._core.report import VerifierTotals
    from engine._errors import RubricError, VerificationError

    totals = VerifierTotals("rubric", "a/b@1")
    # the judge's words start otherwise: only the field says it timed out
    totals.failed(VerificationError("rubric", "a/b@1", "judge request failed: timed out", timed_out=True))
    totals.failed(VerificationError("rubric", "a/b@1", "timed out, said the judge's reply"))
    totals.failed(RubricError("a/b@1", "no version 1"))
    assert (dict(totals.errors), totals.timeouts) == ({"VerificationError": 2, "RubricError": 1}, 1)
    assert totals.items == 0 and math.isnan(totals.mean_reward)


def test_totals_add_every_figure_of_a_report_and_merge_them_all() -> None:
    from engine._core.report import VerifierTotals

    def report(peak: int) -> VerifierReport:
        return VerifierReport(kind="rubric", ref="a/b@1", key="a/b", provenance={}, items=2, reward_sum=1.0,
                              latencies=[0.01, 0.03], latency_items=[1, 1], waited=0.5, busy=0.04, retries=1,
                              peak_in_flight=peak, active=0.05, startup=[0.2], spent={"total_tokens": 10})

    one, two = VerifierTotals("rubric", "a/b@1"), VerifierTotals("rubric", "a/b@1")
    one.add(report(4))
    two.add(report(2))
    one.merge(two)
    assert (one.items, one.reward_sum, one.retries, one.waited, one.busy, one.active) == (4, 2.0, 2, 1.0, 0.08, 0.1)
    assert (one.peak_in_flight, one.latest_peak_in_flight) == (4, 2)  # the most of any; the latest one's
    assert (one.startup_calls, one.startup_seconds, one.startup_longest) == (2, 0.4, 0.2)
    assert one.spent == {"total_tokens": 20}
    assert sum(one.latency.counts.values()) == 4 and one.latency.seconds == pytest.approx(0.08)


def test_a_histogram_read_at_prometheus_bounds_counts_each_item_once_and_cumulatively() -> None:
    histogram = LatencyHistogram()
    histogram.extend([0.0002, 0.003, 0.003, 0.04, 7.0, 500.0], [1, 2, 3, 4, 5, 6])
    bounds = (0.001, 0.01, 0.1, 1.0, 10.0)
    assert histogram.at_most(bounds) == [1, 6, 10, 10, 15, 21]  # the last: every item, past the last bound too
    assert histogram.seconds == pytest.approx(0.0002 + 0.015 + 0.16 + 35 + 3000)
