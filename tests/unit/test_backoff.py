"""The one doubling back-off (`kvpool.backoff`), which reconnects, the breaker and the lookup
channel share."""

from kvpool.backoff import Backoff


def test_the_delay_doubles_to_its_cap_and_starts_over_after_a_success():
    b = Backoff(0.5, 3.0)
    assert not b.failing
    assert [b.failed() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert b.failing
    b.reset()
    assert not b.failing and b.failed() == 0.5
