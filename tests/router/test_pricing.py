"""What the router prices replicas at (``router/pricing.py``): bounded, continuous, smoothed."""

import math

import pytest

from kvmesh.router.pricing import (
    CONFIDENT_STEPS,
    MAX_HARDWARE_RATIO,
    REFERENCE_STEP,
    FleetPrices,
    MeasuredReplica,
)
from kvmesh.serving.step_costs import StepCosts

BASE = StepCosts(0.007, 2.3e-4, 1e-4, 1e-7)


def scaled(factor: float) -> StepCosts:
    return StepCosts(*(factor * c for c in BASE.terms()))


def fleet(*factors: float, hardware: str = "cpu", steps: float = 1e6) -> list[MeasuredReplica]:
    return [MeasuredReplica(f"r{i}", hardware, scaled(f), steps) for i, f in enumerate(factors)]


def ratio(price: StepCosts, to: StepCosts) -> float:
    return price.step_seconds(*REFERENCE_STEP) / to.step_seconds(*REFERENCE_STEP)


def test_like_hardware_prices_alike_whatever_its_fits_say():
    """Four replicas of one machine type whose fits differ by noise, one 40% low: all priced at
    the median (the old rule kept a fit more than 25% off its own, and that one drew every cold
    prompt)."""
    prices = FleetPrices().update(fleet(1.0, 1.1, 0.95, 0.6), now=0.0)
    assert len({p for p in prices.values()}) == 1
    assert ratio(prices["r3"], BASE) == pytest.approx(1.0, rel=0.06)


def test_a_spread_bounds_like_hardware_and_prices_move_without_a_cliff():
    """With room to differ (spread 1.2), a fit moving away from its peers moves its price
    continuously up to the bound and no further: no step in the price as the fit crosses any
    line."""
    last = None
    for k in range(0, 101):
        own = 0.5 + k / 100  # from half the others' cost to 1.5x
        prices = FleetPrices(spread=1.2).update(fleet(1.0, 1.0, 1.0, own), now=0.0)
        r = ratio(prices["r3"], prices["r0"])
        assert 1 / 1.2 - 1e-9 <= r <= 1.2 + 1e-9
        if last is not None:
            assert abs(r - last) < 0.02, own  # continuous
        last = r


def test_a_fit_counts_by_its_steps():
    """On its own hardware (nothing to clamp it to), a fit 4x the fleet's is trusted by how
    many steps it has seen: little at first, nearly fully after many."""

    def price_ratio(steps: float) -> float:
        replicas = fleet(1.0, 1.0, 1.0) + [MeasuredReplica("gpu", "gpu", scaled(4.0), steps)]
        prices = FleetPrices().update(replicas, now=0.0)
        return ratio(prices["gpu"], prices["r0"])

    assert price_ratio(32) == pytest.approx(4 ** (32 / (32 + CONFIDENT_STEPS)), rel=1e-3)
    assert price_ratio(32) < price_ratio(1000) < price_ratio(1e6)
    assert price_ratio(1e6) == pytest.approx(4.0, rel=0.01)


def test_a_price_follows_a_new_fit_smoothly_and_only_on_fresh_steps():
    prices = FleetPrices(half_life_s=10.0)
    slow = [*fleet(1.0, 1.0, 1.0), MeasuredReplica("x", "other", scaled(1.0), 1e6)]
    prices.update(slow, now=0.0)
    faster = [*fleet(1.0, 1.0, 1.0), MeasuredReplica("x", "other", scaled(0.5), 1e6)]
    # no new steps: a stale fit does not move the price, however long
    assert ratio(prices.update(faster, now=30.0)["x"], BASE) == pytest.approx(1.0, rel=0.01)
    fresh = [*fleet(1.0, 1.0, 1.0), MeasuredReplica("x", "other", scaled(0.5), 2e6)]
    half = prices.update(fresh, now=40.0)["x"]  # one half-life of fresh steps: halfway (in log)
    assert math.log(ratio(half, BASE)) == pytest.approx(0.5 * math.log(0.5), rel=0.02)


def test_no_record_prices_a_replica_beyond_the_hardware_bound():
    replicas = fleet(1.0, 1.0) + [MeasuredReplica("liar", "fastest", scaled(1e-6), 1e9)]
    prices = FleetPrices().update(replicas, now=0.0)
    assert ratio(prices["liar"], prices["r0"]) == pytest.approx(1 / MAX_HARDWARE_RATIO, rel=1e-6)


def test_unmeasured_replicas_price_at_the_median_and_gone_ones_are_forgotten():
    prices = FleetPrices()
    replicas = fleet(1.0, 1.2, 1.4) + [MeasuredReplica("new", "cpu", None, 3)]
    out = prices.update(replicas, now=0.0)
    assert out["new"] == prices.median == scaled(1.2)
    assert set(prices.update(replicas[:2], now=1.0)) == {"r0", "r1"}


def test_spread_below_one_is_refused():
    with pytest.raises(ValueError, match="spread must be >= 1"):
        FleetPrices(spread=0.9)
