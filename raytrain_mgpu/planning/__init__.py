"""Deciding before training: checks against data and cluster, memory model, ``auto``, ``compare``.

- ``preflight.py``      data, run-folder and storage checks before Ray is asked for anything;
- ``memory.py``         the memory estimate per device;
- ``auto.py``           ``strategy="auto"``: choose a strategy and its layout;
- ``compare.py``        run candidate strategies briefly and rank them;
- ``compare_report.py`` the comparison's table and files.
"""
