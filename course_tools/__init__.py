"""course_tools: the maintainers' tooling for the course, kept apart from what the notebooks import.

No notebook imports this package; it uses ``course_utils`` (never the other way round).

- ``validate``      run every notebook under nbval and write report/ (``scripts/validate_gpu.sh``)
- ``compare``       two results folders side by side (``course-compare``)
- ``colab``         one canonical repository URL for every Colab badge and bootstrap cell (``scripts/sync_colab.py``)
- ``nbval_plugin``  the pytest plugin for the notebook harness (pyproject's ``-p course_tools.nbval_plugin``)
- ``preflight``     is this machine ready to run the course (``make check``)
- ``launcher``      run a script in N processes like ``torchrun``, with a timeout and no orphans
                    (``python -m course_tools.launcher``; notebook 07 runs it as a command)
- ``measure_presets`` re-measure the planner's model presets into its ``presets.json``
                    (``python -m course_tools.measure_presets``)
"""
