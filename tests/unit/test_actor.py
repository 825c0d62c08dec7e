"""Actor lifecycle and supervision, with in-process actors (no infrastructure)."""

import anyio
import pytest

from engine.actor import Actor, RestartPolicy, Supervisor, SupervisorGaveUp, describe_error

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


async def test_an_actor_drains_after_the_ones_whose_work_it_serves():
    """The client still needs the server while it drains: the server is asked to drain only once the
    client has finished (without ``drain_after`` the client's last request would never be answered)."""
    log: list[str] = []
    send, receive = anyio.create_memory_object_stream[tuple[str, anyio.Event]](8)

    class Server(Actor):
        async def serve(self):
            async with anyio.create_task_group() as tg:
                async def answer() -> None:
                    async for _, done in receive:
                        done.set()

                tg.start_soon(answer)
                await self.wait_drain_requested()
                log.append("server draining")
                tg.cancel_scope.cancel()

    class Client(Actor):
        async def serve(self):
            await self.wait_drain_requested()
            log.append("client draining")
            done = anyio.Event()
            await send.send(("last step", done))  # in-flight work that needs the server
            await done.wait()
            log.append("client done")

    sup = Supervisor(FAST, drain_timeout_s=3600)
    sup.add("server", Server, drain_after=("client", "not-here"))  # absent names are not waited for
    sup.add("client", Client)
    with anyio.fail_after(30):
        async with send, receive, anyio.create_task_group() as tg:
            tg.start_soon(sup.run)
            await anyio.sleep(0)
            sup.drain()
    assert log == ["client draining", "client done", "server draining"]
    with pytest.raises(ValueError, match="after itself"):
        sup.add("loop", Server, drain_after=("loop",))


def test_describe_error_names_the_leaves_of_an_exception_group() -> None:
    assert describe_error(ValueError("bad input:")) == "ValueError: bad input:"
    assert describe_error(TimeoutError()) == "TimeoutError"
    nested = ExceptionGroup("outer", [ValueError("a"), ExceptionGroup("inner", [TimeoutError()])])
    assert describe_error(nested) == "ValueError: a; TimeoutError"
