"""What the engine does when serving fails: a request whose own serving raised fails alone (finish reason
"error"); a step that raised with no request to blame is recovered from (`Failures.recover`) by ending the
running requests, rebuilding the pools if a failed program consumed them, and keeping the waiting ones."""

from __future__ import annotations

import logging

from serve.engine.pools import EnginePools
from serve.engine.requests import FinishReason, Request, RequestOutput
from serve.engine.scheduler import Scheduler

log = logging.getLogger("jaxhybrid.engine")


class Failures:
    """See the module doc. Keeps what a step produced before it raised (`keep`), for `recover` or the next
    step to report (`take`): every request gets exactly one final output."""

    def __init__(self, scheduler: Scheduler, pools: EnginePools):
        self.scheduler, self.pools = scheduler, pools
        self._unreported: dict[str, RequestOutput] = {}  # produced by a step that then raised

    def take(self) -> dict[str, RequestOutput]:
        """The outputs kept from a step that raised (a new step starts from them), none kept after."""
        outputs, self._unreported = self._unreported, {}
        return outputs

    def keep(self, outputs: dict[str, RequestOutput]) -> None:
        """A step raised after it produced `outputs`: keep them for `recover` or the next step."""
        self._unreported = outputs

    def fail(self, req: Request, exc: BaseException, outputs: dict[str, RequestOutput]) -> None:
        """End `req` with an error because serving it raised; everyone else goes on. If the failed program
        took the pools with it, the whole step fails instead (the caller's `recover`)."""
        if self.pools.runner.pools_lost():
            raise RuntimeError("the cache pools were lost in a failed program call") from exc
        if not req.finished:
            self.scheduler.finish(req, FinishReason.ERROR)
        self.report(req, exc, outputs)

    def report(self, req: Request, exc: BaseException, outputs: dict[str, RequestOutput]) -> None:
        """`req`'s final output: an error that says what `exc` was."""
        req.error = f"{type(exc).__name__}: {exc}"
        log.error("request %s failed: %s", req.id, req.error, exc_info=exc)
        outputs[req.id] = RequestOutput(
            req.id, [], [], True, FinishReason.ERROR, req.prefix_hit_tokens, req.error
        )

    def recover(self, reason: str) -> list[RequestOutput]:
        """After a step that raised with no single request to blame: end every running request with an
        error (its cached state may be half written), rebuild the pools if the failed program consumed
        them (the prefix store then forgets its KV blocks; its checkpoints are copies and stay), keep the
        waiting requests. Returns the outputs that tell their clients, with what the failed step produced
        before it raised (a request that finished in it gets its own final output)."""
        outputs = self.take()
        for req in self.scheduler.drop_running():
            req.error = f"the engine step failed: {reason}"
            out = outputs.setdefault(req.id, RequestOutput(req.id, [], [], True, None, req.prefix_hit_tokens))
            out.finished, out.finish_reason, out.error = True, FinishReason.ERROR, req.error
        self.pools.rebuild_lost()
        return list(outputs.values())
