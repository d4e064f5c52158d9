"""Work a test waits on, started early in a thread of the test run (the course's pytest plugin calls a module's
``start_in_background`` at collection): one Future per key, its result or its exception for the test to report."""
import concurrent.futures
import threading

_FUTURES: dict = {}


def start(key: str, work) -> concurrent.futures.Future:
    """``work()`` in a daemon thread, once per ``key``; returns its Future."""
    if key not in _FUTURES:
        future = _FUTURES[key] = concurrent.futures.Future()

        def run():
            try:
                future.set_result(work())
            except BaseException as err:  # noqa: BLE001  the waiting test reports it
                future.set_exception(err)

        threading.Thread(target=run, name=key, daemon=True).start()
    return _FUTURES[key]
