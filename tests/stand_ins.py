"""Stand-ins for the standard modules a unit test would otherwise patch for the whole process.

``make test`` runs the notebooks in background threads of the same pytest process, beside the unit tests
(course_tools/notebook_runs.py): those threads build the course's wheel and start kernels with ``subprocess.run``,
look tools up with ``shutil.which`` and share the cores by ``os.cpu_count``. A test that patches ``subprocess.run``
itself changes it for them too, for as long as the test runs: a fake ``run`` that answered "done" once made the wheel
build "succeed" without a wheel, and every installed run of that test run failed. So a test gives the module under
test a stand-in instead, and only that module sees the change::

    monkeypatch.setattr(accounting, "subprocess", stand_in(subprocess, run=fake_run))
"""
from __future__ import annotations

import types

SHARED = ("subprocess", "shutil", "os", "socket", "threading", "time")  # what the background runs use; never patch


class StandIn(types.ModuleType):
    """``real`` with some attributes replaced: every other attribute is the real module's."""

    def __init__(self, real: types.ModuleType, **replaced):
        super().__init__(real.__name__, real.__doc__)
        self.__dict__.update(replaced, _real=real)

    def __getattr__(self, name):
        return getattr(self.__dict__["_real"], name)


def stand_in(real: types.ModuleType, **replaced) -> StandIn:
    """A stand-in for module ``real`` in which ``replaced`` names other values (functions, constants)."""
    missing = [name for name in replaced if not hasattr(real, name)]
    if missing:
        raise AttributeError(f"{real.__name__} has no {', '.join(missing)}: a stand-in replaces what the module has")
    return StandIn(real, **replaced)
