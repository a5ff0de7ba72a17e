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
