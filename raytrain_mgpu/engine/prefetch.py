"""Read-ahead of a data iterator in a background thread, for a runner whose first rank
waits on its loader (the pipeline's first stage: it cannot fill until micro-batch 0 exists)."""

from __future__ import annotations

import queue
import threading

__all__ = ["Prefetcher"]


class Prefetcher:
    """Reads the next batch in a background thread while the stage computes.

    On the first stage, loading sits on the critical path: the pipeline cannot fill until
    micro-batch 0 exists. Read ahead, it runs in the stage's idle slots (the bubble) instead.
    The thread holds at most one batch ahead and stops with :meth:`close`.
    """

    def __init__(self, iterator):
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(iterator,), daemon=True, name="prefetch")
        self._thread.start()

    def _run(self, iterator) -> None:
        while not self._stop.is_set():
            try:
                item = next(iterator)
            except BaseException as exc:  # StopIteration or a reader error: hand it to the consumer
                item = exc
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return

    def __next__(self):
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
