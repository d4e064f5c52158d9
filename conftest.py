"""Pytest configuration: the notebook harness's settings live in course_utils/nbval_plugin.py,
loaded through pyproject's addopts so they also apply to notebooks run from elsewhere."""
