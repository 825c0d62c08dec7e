"""Actor lifecycle and supervision, with in-process actors (no infrastructure)."""

import anyio
import pytest

from engine.actor import Actor, RestartPolicy, Supervisor, SupervisorGaveUp

pytestmark = pytest.mark.anyio

FAST = RestartPolicy(max_restarts=3, restart_window_s=60, backoff_initial_s=0.001, backoff_max_s=0.01)


class Flaky(Actor):
    role = "flaky"

    def __init__(self, log: list, crashes_left: list[int]) -> None:
        super().__init__()
        self.log = log
        self.crashes_left = crashes_left

    async def setup(self):
        self.log.append("setup")

    async def serve(self):
        if self.crashes_left[0] > 0:
            self.crashes_left[0] -= 1
            raise RuntimeError("boom")
        self.log.append("serving")
        await self.wait_drain_requested()
        self.log.append("drained")

    async def teardown(self):
        self.log.append("teardown")


async def test_crashed_actor_is_restarted_and_drains_cleanly():
    log: list[str] = []
    sup = Supervisor(FAST, drain_timeout_s=5)
    crashes_left = [2]
    sup.add("flaky", lambda: Flaky(log, crashes_left))
    async with anyio.create_task_group() as tg:
        tg.start_soon(sup.run)
        while "serving" not in log:
            await anyio.sleep(0.001)
        assert sup.restarts("flaky") == 2
        sup.drain()
    # every life got a teardown, the last one drained
    assert log.count("setup") == 3 and log.count("teardown") == 3
    assert log[-2:] == ["drained", "teardown"]


async def test_supervisor_gives_up_loudly_after_the_budget():
    sup = Supervisor(FAST)
    sup.add("bad", lambda: Flaky([], [100]))
    with pytest.raises(SupervisorGaveUp, match="'bad' crashed 4 times"):
        await sup.run()


async def test_drain_timeout_cancels_a_stuck_actor():
    class Stuck(Actor):
        torn_down = False

        async def serve(self):
            await anyio.sleep_forever()

        async def teardown(self):
            Stuck.torn_down = True

    sup = Supervisor(FAST, drain_timeout_s=0.05)
    sup.add("stuck", Stuck)
    async with anyio.create_task_group() as tg:
        tg.start_soon(sup.run)
        await anyio.sleep(0)
        sup.drain()
    assert Stuck.torn_down


async def test_drain_is_idempotent_and_an_actor_can_finish_on_its_own():
    class Once(Actor):
        async def serve(self):
            return

    sup = Supervisor(FAST)
    sup.add("once", Once)
    assert not sup.finished("once") and not sup.alive()["once"]  # not started is not finished
    sup.drain()
    sup.drain()
    with anyio.fail_after(5):
        await sup.run()
    assert sup.finished("once") and not sup.finished("unknown")
