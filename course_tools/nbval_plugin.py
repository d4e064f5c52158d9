"""Pytest plugin for the course's notebook harness (loaded by pyproject's ``-p course_tools.nbval_plugin``).

- Notebooks and tests run without a display and without the internet.
- nbval compares stderr in checked cells; warnings and progress bars there are not lessons, so stderr is skipped.
- The committed outputs come from a profile-smoke run. In profile full (a GPU run) sizes, and so printed numbers,
  differ by design: there saved outputs are not compared, and the claim checks are the test.
"""
from __future__ import annotations

import os

os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _profile_is_full() -> bool:
    try:
        from course_utils.hardware import course_profile

        return course_profile() == "full"
    except Exception:  # a bad COURSE_PROFILE fails in the notebook itself, with its message
        return False


def _patch_nbval() -> None:
    try:
        from nbval.plugin import IPyNbCell, IPyNbFile
    except ImportError:  # nbval missing: the unit tests still run
        return
    if not getattr(IPyNbFile, "_course_patched", False):
        original_init = IPyNbFile.__init__

        def init_without_stderr(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            self.skip_compare = tuple(self.skip_compare) + ("stderr",)

        IPyNbFile.__init__ = init_without_stderr
        IPyNbFile._course_patched = True
    if _profile_is_full() and not getattr(IPyNbCell, "_course_full_profile", False):
        IPyNbCell.compare_outputs = lambda self, test, ref, skip_compare=None: True
        IPyNbCell._course_full_profile = True


_patch_nbval()
