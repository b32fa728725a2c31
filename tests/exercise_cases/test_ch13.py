"""Chapter 13: a reader's engine loop (take_inbox, route, turn), turned by AsyncLLM as loop_cls in the live server."""

from minivllm.exercises import check_engine_loop
from minivllm.serving.engine_loop import EngineLoop

from exercise_cases import Check


def take_one(loop, item):
    """One inbox item into the engine, as the solution does it."""
    if item[0] == "abort":
        loop.abort(item[1])
        return
    _, request_id, token_ids, params, arrival_time = item
    try:
        loop.engine.add_request(request_id, token_ids, params, arrival_time=arrival_time)
    except ValueError as e:
        loop.deliver(request_id, e, last=True)


class MyEngineLoop(EngineLoop):
    """The solution notebook's answer."""

    def take_inbox(self):
        while self.inbox:
            item = self.inbox.popleft()
            if item[0] == "abort":
                self.abort(item[1])
                continue
            _, request_id, token_ids, params, arrival_time = item
            try:
                self.engine.add_request(request_id, token_ids, params, arrival_time=arrival_time)
            except ValueError as e:
                self.deliver(request_id, e, last=True)

    def route(self, outputs):
        for out in outputs:
            self.deliver(out.request_id, out, last=out.finished)

    def turn(self):
        self.take_inbox()
        if not self.engine.has_unfinished_requests():
            self.idle()
            return None
        outputs = self.engine.step()
        self.route(outputs)
        return outputs


class SkipsAbortedAdds(MyEngineLoop):
    """Right too: an add whose stream is already closed (its client left) never reaches the engine."""

    def take_inbox(self):
        while self.inbox:
            item = self.inbox.popleft()
            if item[0] == "abort":
                self.abort(item[1])
            elif item[1] in self.streams:
                try:
                    self.engine.add_request(item[1], item[2], item[3], arrival_time=item[4])
                except ValueError as e:
                    self.deliver(item[1], e, last=True)


class TakesACopyUnderTheLock(MyEngineLoop):
    """Right too: the inbox copied and cleared at once under the lock the handlers append under, then taken."""

    def take_inbox(self):
        with self.guard:
            items = list(self.inbox)
            self.inbox.clear()
        for item in items:
            take_one(self, item)


class IteratesThenClears(MyEngineLoop):
    """The issue's loop: over the inbox, then clear it; a handler appending meanwhile breaks the iteration."""

    def take_inbox(self):
        for item in self.inbox:
            take_one(self, item)
        self.inbox.clear()


class CopiesThenClears(MyEngineLoop):
    """Over a copy of the inbox, then clear it: no error, but what arrived meanwhile is cleared away."""

    def take_inbox(self):
        for item in list(self.inbox):
            take_one(self, item)
        self.inbox.clear()


class CopiesWithoutTheLock(MyEngineLoop):
    """Copy, clear, then take: what a handler appends between the copy and the clear is lost."""

    def take_inbox(self):
        items = list(self.inbox)
        self.inbox.clear()
        for item in items:
            take_one(self, item)


class OneTryAroundTheLoop(MyEngineLoop):
    """The issue's loop: one try around the whole inbox; after a refused add the rest waits a turn."""

    def take_inbox(self):
        request_id = None
        try:
            while self.inbox:
                item = self.inbox.popleft()
                if item[0] == "abort":
                    self.abort(item[1])
                    continue
                _, request_id, token_ids, params, arrival_time = item
                self.engine.add_request(request_id, token_ids, params, arrival_time=arrival_time)
        except ValueError as e:
            self.deliver(request_id, e, last=True)


class StepsWhenIdle(MyEngineLoop):
    def turn(self):
        self.take_inbox()
        outputs = self.engine.step()  # an empty engine steps too, and the loop never sleeps
        self.route(outputs)
        return outputs


class NeverSleeps(MyEngineLoop):
    def turn(self):
        self.take_inbox()
        if not self.engine.has_unfinished_requests():
            return None  # no idle(): AsyncLLM turns again at once
        return super().turn()


class AddsAfterTheStep(MyEngineLoop):
    def turn(self):
        if not self.engine.has_unfinished_requests():
            self.take_inbox()
            if not self.engine.has_unfinished_requests():
                self.idle()
                return None
        outputs = self.engine.step()
        self.route(outputs)
        self.take_inbox()  # too late: what arrived waits for the step after next
        return outputs


class ForgetsToReturn(MyEngineLoop):
    def turn(self):
        super().turn()


class RoutesByArrival(MyEngineLoop):
    def route(self, outputs):
        for request_id, out in zip(list(self.streams), outputs):  # the streams' order is not the step's
            self.deliver(request_id, out, last=out.finished)


class StopsAtAFinishedOne(MyEngineLoop):
    def route(self, outputs):
        for out in outputs:
            self.deliver(out.request_id, out, last=out.finished)
            if out.finished:
                return  # the outputs after it in this step are dropped


class FirstOutputOnly(MyEngineLoop):
    def route(self, outputs):
        if outputs:
            self.deliver(outputs[0].request_id, outputs[0], last=outputs[0].finished)


class NeverCloses(MyEngineLoop):
    def route(self, outputs):
        for out in outputs:
            self.deliver(out.request_id, out)


class ClosesAtOnce(MyEngineLoop):
    def route(self, outputs):
        for out in outputs:
            self.deliver(out.request_id, out, last=True)


class IgnoresAborts(MyEngineLoop):
    def take_inbox(self):
        while self.inbox:
            item = self.inbox.popleft()
            if item[0] == "add":
                self.engine.add_request(item[1], item[2], item[3], arrival_time=item[4])


class AbortsInTheEngineOnly(MyEngineLoop):
    def abort(self, request_id):
        self.engine.abort_request(request_id)  # the metrics never hear of it


class AbortsBeforeAdds(MyEngineLoop):
    def take_inbox(self):
        items = list(self.inbox)
        self.inbox.clear()
        for item in [i for i in items if i[0] == "abort"] + [i for i in items if i[0] == "add"]:
            self.inbox.append(item)
            super().take_inbox()


class RefusalEscapes(MyEngineLoop):
    def take_inbox(self):
        while self.inbox:
            item = self.inbox.popleft()
            if item[0] == "abort":
                self.abort(item[1])
            else:
                self.engine.add_request(item[1], item[2], item[3], arrival_time=item[4])


class RefusalSwallowed(MyEngineLoop):
    def take_inbox(self):
        while self.inbox:
            item = self.inbox.popleft()
            if item[0] == "abort":
                self.abort(item[1])
                continue
            try:
                self.engine.add_request(item[1], item[2], item[3], arrival_time=item[4])
            except ValueError:
                pass  # its stream never hears back


class RefusalLeftOpen(MyEngineLoop):
    def take_inbox(self):
        while self.inbox:
            item = self.inbox.popleft()
            if item[0] == "abort":
                self.abort(item[1])
                continue
            try:
                self.engine.add_request(item[1], item[2], item[3], arrival_time=item[4])
            except ValueError as e:
                self.deliver(item[1], e)


CHECKS = [Check("13", check_engine_loop, [MyEngineLoop, SkipsAbortedAdds, TakesACopyUnderTheLock], {
    "steps an idle engine": (StepsWhenIdle, "instead of stepping"),
    "never sleeps": (NeverSleeps, "without calling self.idle"),
    "adds after the step": (AddsAfterTheStep, "r2 waited in the inbox"),
    "forgets to return the outputs": (ForgetsToReturn, "return the step's outputs"),
    "routes by arrival order": (RoutesByArrival, ("r1's stream received r3's output", "its own request")),
    "drops the outputs after a finished one": (StopsAtAFinishedOne, "deliver every output of a step"),
    "delivers one output per step": (FirstOutputOnly, "deliver every output of a step"),
    "never closes a finished stream": (NeverCloses, ("still open", "last=True")),
    "closes a stream at its first output": (ClosesAtOnce, "closed after its output"),
    "ignores aborts": (IgnoresAborts, "never aborted r1"),
    "aborts without the metrics": (AbortsInTheEngineOnly, "self.abort"),
    "aborts before adds": (AbortsBeforeAdds, "in the order it came"),
    "a refused add escapes": (RefusalEscapes, "escaped the turn"),
    "a refused add swallowed": (RefusalSwallowed, "waits forever"),
    "a refused add left open": (RefusalLeftOpen, "still open"),
    "iterates over the inbox, then clears it": (IteratesThenClears, (
        "deque mutated during iteration", "take_inbox was iterating over self.inbox", r"self.inbox.popleft\(\)")),
    "iterates over a copy, then clears the inbox": (CopiesThenClears, (
        "r2 never reached the engine", "the inbox was cleared after r2 arrived", "never iterate")),
    "copies and clears without the lock": (CopiesWithoutTheLock, (
        "right after take_inbox read the inbox", "r2 was lost", "self.guard")),
    "one try around the whole inbox loop": (OneTryAroundTheLoop, (
        "r2's add and r3's abort waited for the next turn", "one try around the whole inbox loop")),
}, passes="the live server")]
