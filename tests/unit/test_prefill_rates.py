"""The tier's prefill figures (``kvstore.tier.prefill``): per tenant and layout, the median of
the recent reports, forgotten with age, bounded in keys. Injected clock."""

from __future__ import annotations

import pytest

from kvstore.errors import ConfigError, InvalidArgument
from kvstore.tier.prefill import PrefillRates

A, B = b"a" * 32, b"b" * 32


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_median_of_recent_reports_per_tenant_and_layout() -> None:
    rates = PrefillRates(samples=3, clock=Clock())
    assert rates.rate("t", A) == 0.0
    for rate in (1000.0, 2000.0, 9000.0):
        rates.report("t", A, rate)
    assert rates.rate("t", A) == 2000.0  # one odd engine does not swing it
    rates.report("t", A, 0.0)  # an engine without a figure: nothing kept
    rates.report("t", A, 3000.0)  # the oldest (1000) drops out of the last three: 2000, 9000, 3000
    assert rates.rate("t", A) == 3000.0
    assert rates.rate("t", B) == 0.0 and rates.rate("u", A) == 0.0


def test_old_reports_are_forgotten() -> None:
    clock = Clock()
    rates = PrefillRates(max_age_s=60.0, clock=clock)
    rates.report("t", A, 1000.0)
    clock.now += 30.0
    rates.report("t", A, 3000.0)
    clock.now += 40.0  # the first is 70 s old
    assert rates.rate("t", A) == 3000.0
    clock.now += 61.0
    assert rates.rate("t", A) == 0.0


def test_the_least_recently_reported_key_goes_first() -> None:
    rates = PrefillRates(max_keys=2, clock=Clock())
    rates.report("t", A, 1.0)
    rates.report("t", B, 2.0)
    rates.report("t", A, 1.0)  # A is the most recent now
    rates.report("u", A, 3.0)
    assert rates.rate("t", B) == 0.0 and rates.rate("t", A) == 1.0 and rates.rate("u", A) == 3.0


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan"), True, "5"])
def test_bad_rates_and_settings_are_refused(bad: object) -> None:
    with pytest.raises(InvalidArgument, match="prefill_tokens_per_s"):
        PrefillRates().report("t", A, bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        PrefillRates(samples=0)
