"""Pytest configuration shared by the unit tests and the notebook harness (nbval)."""
import os

# Notebooks and tests run without a display and without the internet.
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

try:  # nbval compares stderr in checked cells; warnings and progress bars there are not lessons
    from nbval.plugin import IPyNbFile

    if "stderr" not in IPyNbFile.__dict__.get("_course_skip", ()):
        _original_init = IPyNbFile.__init__

        def _init_without_stderr(self, *args, **kwargs):
            _original_init(self, *args, **kwargs)
            self.skip_compare = tuple(self.skip_compare) + ("stderr",)

        IPyNbFile.__init__ = _init_without_stderr
        IPyNbFile._course_skip = ("stderr",)
except ImportError:  # nbval missing: the unit tests still run
    pass
