"""PettingFlow's benchmarks: each module is a script that prints side-by-side ratios (docs/benchmarks.md).

Run one as a module from the repository root, e.g. ``.venv/bin/python -m bench.roofline --help``; the modules
import each other as ``from bench import common``. ``bench/common.py`` sets the thread and offline environment
before torch is imported, so every script imports it first.
"""
