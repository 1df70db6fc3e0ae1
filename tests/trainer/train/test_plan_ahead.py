"""Plans made in a background thread arrive in order, errors surface at their step, and closing stops the thread."""

import threading

import pytest

from wanloom_trainer.train.plan_ahead import PlansAhead


def test_plans_arrive_in_order_and_end() -> None:
    ahead = PlansAhead(iter(range(10)), depth=3)
    assert list(ahead) == list(range(10))
    with pytest.raises(StopIteration):
        next(ahead)
    ahead.close()


def test_a_planning_error_surfaces_after_the_plans_before_it() -> None:
    def plans():
        yield 0
        yield 1
        raise ValueError("step 2: bad cost model")

    ahead = PlansAhead(plans(), depth=2)
    assert [next(ahead), next(ahead)] == [0, 1]
    with pytest.raises(ValueError, match="step 2: bad cost model"):
        next(ahead)
    ahead.close()


def test_close_stops_a_planner_that_is_ahead() -> None:
    made = []

    def plans():
        for i in range(1000):
            made.append(i)
            yield i

    ahead = PlansAhead(plans(), depth=2)
    assert next(ahead) == 0
    ahead.close()
    assert not any(t.name == "wanloom-plan" and t.is_alive() for t in threading.enumerate())
    assert len(made) <= 5  # it stayed at most `depth` plans ahead
