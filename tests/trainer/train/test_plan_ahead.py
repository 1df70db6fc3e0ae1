"""Plans made in a background thread arrive in order, errors surface at their step, and closing stops the thread;
the cost schedule hands every step the model decided for it."""

import threading

import pytest

from wanloom_trainer.feed.plan_ahead import CostSchedule, PlansAhead


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


def test_cost_schedule_plans_a_step_only_once_its_decisions_are_made() -> None:
    schedule = CostSchedule("initial", start=10, lag=3)
    assert [schedule.model_at(s) for s in (10, 11, 12)] == ["initial"] * 3  # no decision of this run reaches them
    asked: list[str] = []
    waiter = threading.Thread(target=lambda: asked.append(schedule.model_at(15)), daemon=True)
    waiter.start()
    schedule.decide(10, None)
    schedule.decide(11, "refit")  # applies from step 14 on
    waiter.join(timeout=0.2)
    assert waiter.is_alive()  # step 15 waits for the decision after step 12
    schedule.decide(12, None)
    waiter.join(timeout=5)
    assert asked == ["refit"]
    assert schedule.model_at(13) == "initial" and schedule.model_at(14) == "refit"
    assert schedule.changes() == [(14, "refit")]


def test_cost_schedule_resumes_with_the_checkpointed_changes_and_releases_on_close() -> None:
    schedule = CostSchedule("initial", start=20, lag=4, changes=[(22, "b"), (14, "a")])
    assert [schedule.model_at(s) for s in (13, 14, 21, 22, 23)] == ["initial", "a", "a", "b", "b"]
    waiter = threading.Thread(target=schedule.model_at, args=(40,), daemon=True)
    waiter.start()
    schedule.close()  # the loop ended: a planning thread waiting for step 40 is let go
    waiter.join(timeout=5)
    assert not waiter.is_alive()


def test_cost_schedule_without_refits_never_waits_and_refuses_changes() -> None:
    schedule = CostSchedule("initial", start=0, lag=None)
    assert schedule.model_at(10_000) == "initial"
    with pytest.raises(ValueError, match="does not refit"):
        schedule.decide(3, "refit")


def test_cost_schedule_changes_models_only_at_window_boundaries() -> None:
    """A planning window is planned once: a change decided for a step inside a window takes effect at the next one."""
    schedule = CostSchedule("initial", start=20, lag=4, changes=[(22, "b"), (13, "a")], window=8)
    schedule.decide(20, None)  # step 24 is planned once the decision after step 20 is made
    assert [schedule.model_at(s) for s in (7, 8, 15, 16, 22, 23, 24)] == [
        "initial", "initial", "initial", "a", "a", "a", "b"
    ]  # fmt: skip
